"""distlab next to Hugging Face transformers (the ``hf`` extra): both import in one process.

transformers 5 depends on Hugging Face's ``kernels`` package; distlab's own kernels live under
``distlab.kernels`` so that a checkout or an install of distlab never shadows it.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transformers_llama_imports_next_to_distlab_from_the_repo_root():
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    code = ("import distlab.kernels.attention, distlab.model.llama\n"
            "import transformers.models.llama.modeling_llama as m\n"
            "import transformers.models.mixtral.modeling_mixtral\n"
            "print(m.LlamaDecoderLayer.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "LlamaDecoderLayer" in proc.stdout, proc.stderr[-3000:]


def test_no_top_level_package_named_kernels():
    assert not os.path.exists(os.path.join(ROOT, "kernels")), "a top-level kernels/ shadows Hugging Face's kernels"
