"""The knobs registry: every DISTLAB_* variable declared once, read through distlab.knobs, an unknown one
refused before any work, overrides for sweeps."""

import os
import re
import subprocess
import sys

import pytest

from distlab import knobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def test_no_module_reads_a_distlab_variable_from_the_environment_directly():
    """Only the registry reads DISTLAB_* (and the launcher plumbing that sets them for its ranks)."""
    plumbing = {"knobs.py", "cli.py", "bench.py"}
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "distlab")):
        for name in files:
            if name.endswith(".py") and name not in plumbing:
                text = open(os.path.join(folder, name)).read()
                if re.search(r"(environ(\.get)?[\[(]|getenv\()\s*f?[\"']DISTLAB_", text):
                    offenders.append(os.path.relpath(os.path.join(folder, name), ROOT))
    assert not offenders, offenders


def test_every_distlab_variable_the_code_names_is_declared():
    names = set()
    for folder, _, files in os.walk(ROOT):
        if ".git" in folder:
            continue
        for name in files:
            if name.endswith((".py", ".sh")) and not name.startswith("test_knobs"):
                names |= set(re.findall(r"DISTLAB_([A-Z0-9_]*[A-Z0-9])\b", open(os.path.join(folder, name)).read()))
    prefixes = {"TRITON_ATTN", "KERNEL", "GROUPED_GEMM", "TRITON"}   # names built as PREFIX_<knob>
    undeclared = sorted(n for n in names if n not in knobs.KNOBS and n not in prefixes)
    assert not undeclared, undeclared


def test_every_kernel_knob_read_is_declared():
    """``kernels.launch.knob(NAME, ...)`` reads KERNEL_NAME: each such name must be declared."""
    read = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "distlab")):
        for name in files:
            if name.endswith(".py"):
                read |= set(re.findall(r"\bknob\(\"([A-Z_]+)\"", open(os.path.join(folder, name)).read()))
    assert read and not sorted(f"KERNEL_{n}" for n in read if f"KERNEL_{n}" not in knobs.KNOBS)


def test_an_unknown_variable_fails_loudly_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "distlab.cp.ring", "--seq", "16", "--heads", "2", "--kv-heads", "1"],
                          capture_output=True, text=True, timeout=120, env={**ENV, "DISTLAB_TRITON_ATN_PDL": "1"})
    assert proc.returncode == 2 and "unknown environment variable(s) DISTLAB_TRITON_ATN_PDL" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_override_and_set_put_values_in_force_and_back():
    before = knobs.get("TRITON_ATTN_PDL")
    with knobs.override(TRITON_ATTN_PDL="1"):
        assert knobs.get("TRITON_ATTN_PDL") == "1"
        with knobs.override(TRITON_ATTN_PDL=None):
            assert knobs.get("TRITON_ATTN_PDL") == "0"
    assert knobs.get("TRITON_ATTN_PDL") == before
    knobs.set(KERNEL_ROPE_TOKENS=4)
    assert knobs.get("KERNEL_ROPE_TOKENS") == "4"
    knobs.unset("KERNEL_ROPE_TOKENS")
    assert knobs.get("KERNEL_ROPE_TOKENS") is None
    assert knobs.parse_settings("PDL=1;DISTLAB_TRITON_ATTN_TMA=0", "TRITON_ATTN_") == {"TRITON_ATTN_PDL": "1",
                                                                                        "TRITON_ATTN_TMA": "0"}
    with pytest.raises(ValueError, match="unknown knob"):
        with knobs.override(NO_SUCH=1):
            pass


def test_the_table_lists_every_knob():
    proc = subprocess.run([sys.executable, "-m", "distlab.knobs"], capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 0
    assert all(f"DISTLAB_{name}" in proc.stdout for name in knobs.KNOBS)
