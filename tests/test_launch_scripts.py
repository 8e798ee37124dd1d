"""The device scripts, dry: every Python command they would run on the GPU machines parses its arguments.

Device time is scarce (a few calls per session) and a multi-GPU machine may be lent once; a misspelt flag
found there costs a whole call. Each script runs here with ``tests/argv_shim.py`` standing in for python3
(it records the calls), then every recorded distlab/kernels command goes through its module's own parser.
"""

import os
import subprocess
import sys

import pytest

from tests.argv_shim import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = os.path.join(ROOT, "tests", "argv_shim.py")


def dry_run(tmp_path, script, *args, packed=True):
    log = tmp_path / "calls.jsonl"
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": f"{sys.executable} {SHIM}", "SHIM_LOG": str(log)}
    proc = subprocess.run(["bash", script, str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    if packed:   # the device tool returns at most 8 files: the scripts pack everything into one
        assert (out / "logs.tar.gz").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return check(log)


@pytest.mark.parametrize("gpus", ["8", "2"])
def test_multigpu_check_commands_parse(tmp_path, gpus):
    parsed, skipped, errors = dry_run(tmp_path, "launch/multigpu_check.sh", gpus, "all")
    assert not errors, errors
    for module in ("distlab.cp.ring", "distlab.cp.ulysses", "distlab.cp.usp", "distlab.tp", "distlab.moe",
                   "distlab.collectives", "distlab.cp.compare", "distlab.infer"):
        assert module in parsed, (module, parsed)
    trains = [c for c in parsed if c == "distlab.train"]
    assert len(trains) == (2 + 7 if gpus == "8" else 6), parsed   # model part at 8 and 4 GPUs; zero part (HSDP at 4+)


@pytest.mark.parametrize("part", ["all", "check", "attention", "ring", "memory", "gemm", "model", "curriculum"])
def test_gpu_kernels_check_commands_parse(tmp_path, part):
    parsed, skipped, errors = dry_run(tmp_path, "launch/gpu_kernels_check.sh", part)
    assert not errors, errors
    assert parsed or (part == "check" and any("kernel_checks.py" in c for c in skipped)), (part, skipped)


@pytest.mark.parametrize("script", ["launch/gpu_check.sh", "launch/gpu_overlap_check.sh", "launch/gpu_moe_check.sh",
                                    "launch/gpu_packed_check.sh", "launch/gpu_fa4_check.sh", "launch/gpu_zero_check.sh",
                                    "launch/gpu_host_debug.sh"])
def test_one_gpu_check_commands_parse(tmp_path, script):
    parsed, skipped, errors = dry_run(tmp_path, script, packed=False)
    assert not errors, errors
    assert parsed, skipped


@pytest.mark.parametrize("part", ["kernels", "timing", "verify", "fa4land", "fa4land2", "fa4keep", "fa4zero", "fa4kept", "fa4s8k",
                                  "fa4confirm", "fold33", "foldgpu33", "origins33", "foldpre34", "foldpre34s"])
def test_gpu_host_check_commands_parse(tmp_path, part):
    parsed, skipped, errors = dry_run(tmp_path, "launch/gpu_host_check.sh", part)
    assert not errors, errors
    assert parsed, skipped


def test_ring_bookkeeping_cpu_runs(tmp_path):
    """``launch/ring_bookkeeping_cpu.py`` (the stubbed ring forward's host time behind a PERF figure) still runs
    against today's ring, in its own process (it replaces module functions), and refuses without the
    interpreter's flag."""
    script = os.path.join(ROOT, "launch", "ring_bookkeeping_cpu.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, script, "--passes", "3", "--rounds", "1", "--heap", "1000", "--freeze"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "µs a pass" in proc.stdout, proc.stdout + proc.stderr
    assert "by generation: [" in proc.stdout and "1000 objects held, frozen" in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, script, "--passes", "3", "--rounds", "1", "--stub", "kernels"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "kept outputs (default): best" in proc.stdout \
        and "DISTLAB_RING_KEEP_OUTPUTS=0: best" in proc.stdout, proc.stdout + proc.stderr
    env.pop("TRITON_INTERPRET")
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr
