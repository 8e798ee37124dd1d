"""The ring study end to end, as a user runs it: the launcher, torchrun processes, the JSON, exit codes."""

import json
import os
import subprocess
import sys
import time

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd, timeout=120):
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_launcher_runs_ring_study_with_check_and_json(tmp_path, layout):
    out = tmp_path / "ring.json"
    proc, _ = run([sys.executable, "-m", "distlab", "run", "--nproc", "3", "-m", "distlab.cp.ring", "--seq", "384",
                   "--device", "cpu", "--layout", layout, "--check", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check vs one device" in proc.stdout and "PASS" in proc.stdout
    result = json.loads(out.read_text())
    assert result["world_size"] == 3 and result["launcher"] == "torchrun" and result["check_passed"]
    assert max(result["max_rel_error"].values()) < 1e-5
    assert result["comm_forward"]["calls"] == {"ring_kv": 2}
    assert result["comm_forward_backward"]["calls"] == {"ring_kv": 4, "ring_dkv": 3}
    shares = [r["work_share"] for r in result["ranks"]]
    assert abs(sum(shares) - 1) < 1e-9
    if layout == "zigzag":   # causal zigzag: equal work; contiguous: the last rank does the most
        assert max(shares) - min(shares) < 1e-9
    else:
        assert shares == sorted(shares) and shares[-1] > 2 * shares[0]


def test_plain_python_is_world_size_one(tmp_path):
    out = tmp_path / "one.json"
    proc, _ = run([sys.executable, "-m", "distlab.cp.ring", "--seq", "256", "--device", "cpu", "--check", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["launcher"] == "single" and result["check_passed"]
    assert result["comm_forward_backward"]["calls"] == {}


def test_bad_sequence_length_fails_fast_on_every_rank():
    proc, elapsed = run([sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.cp.ring",
                         "--seq", "250", "--device", "cpu", "--layout", "zigzag"], timeout=90)
    assert proc.returncode != 0
    assert proc.stderr.count("error (ranks 0, 1): sequence length 250 is not divisible by 4") == 1, proc.stderr[-3000:]
    assert elapsed < 60


def test_usp_study_cli_reports_model_equal_to_measured(tmp_path):
    out = tmp_path / "usp.json"
    proc, _ = run([sys.executable, "-m", "distlab", "run", "--nproc", "4", "-m", "distlab.cp.usp", "--ulysses", "2",
                   "--ring", "2", "--seq", "256", "--device", "cpu", "--check", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 measured == model" in proc.stdout
    result = json.loads(out.read_text())
    assert result["method"] == "usp 2x2 (zigzag)" and result["check_passed"]
    assert result["comm_forward"]["calls"] == {"all_to_all": 4, "ring_kv": 1}


def test_compare_runs_every_method_on_the_same_problem(tmp_path):
    out, png = tmp_path / "cp.json", tmp_path / "cp.png"
    proc, _ = run([sys.executable, "-m", "distlab", "run", "--nproc", "4", "-m", "distlab.cp.compare", "--seq", "256",
                   "--device", "cpu", "--check", "--json", str(out), "--plot", str(png)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    names = [m["method"] for m in result["methods"]]
    assert names == ["ring (contiguous)", "ring (zigzag)", "allgather (zigzag)", "ulysses", "usp 2x2 (zigzag)"]
    for m in result["methods"]:
        assert m["check_passed"], m["method"]
        assert all(r["fwd_bwd_bytes"] == m["model_bytes"]["fwd_bwd"] for r in m["ranks"]), m["method"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in proc.stdout
    else:
        assert png.stat().st_size > 10_000


def test_usp_degrees_that_do_not_match_the_world_fail_on_every_rank():
    proc, elapsed = run([sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.cp.usp", "--ulysses",
                         "2", "--ring", "2", "--seq", "256", "--device", "cpu"], timeout=90)
    assert proc.returncode != 0
    assert proc.stderr.count("error (ranks 0, 1): --ulysses 2 x --ring 2 = 4, but the world size is 2") == 1, proc.stderr[-3000:]
    assert elapsed < 60
