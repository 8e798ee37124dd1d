"""The launch scripts and the submitit submitter against a real one-node SLURM (slurmctld + slurmd).

The cluster is started by ``distlab.slurm_local`` when Debian's SLURM binaries are installed (``.ci/run``
installs them) and stopped at the end (exactly the two daemons it started). Without them these tests
skip and say why. Assertions read the job's output, not only sbatch's exit code (sbatch --wait also
returns 0 for a job cancelled while pending).
"""

import os
import subprocess
import sys

import pytest

from distlab.slurm_local import LocalSlurm, missing_binaries

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def slurm():
    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM is not installed here (missing {', '.join(missing)}; apt-get install slurmctld slurmd "
                    f"slurm-client)")
    with LocalSlurm() as cluster:
        yield cluster


def sbatch(cluster, tmp_path, *args, env=None, timeout=180):
    out = tmp_path / "job.out"
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "DISTLAB_LOG_DIR": str(tmp_path / "logs"), **(env or {})}
    proc = subprocess.run(["sbatch", "--wait", "-o", str(out), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    return proc, out.read_text() if out.exists() else ""


def test_sbatch_usp_study_with_gloo_processes(slurm, tmp_path):
    proc, log = sbatch(slurm, tmp_path, "launch/usp.sh", "--ulysses", "2", "--ring", "2", "--seq", "256",
                       "--device", "cpu", "--check", env={"DISTLAB_NPROC_PER_NODE": "4"})
    assert proc.returncode == 0, proc.stderr + log[-3000:]
    assert "1 node(s) x 4 process(es)" in log
    assert "usp 2x2 (zigzag) attention" in log and "check vs one device" in log and "PASS" in log
    # per-rank logs from torchrun's --log-dir
    ranks = sorted(p.parent.name for p in (tmp_path / "logs").rglob("stdout.log"))
    assert ranks == ["0", "1", "2", "3"]


def test_sbatch_missing_module_fails_at_once(slurm, tmp_path):
    proc, log = sbatch(slurm, tmp_path, "launch/run.sh", "distlab.cp.nope", timeout=60)
    assert proc.returncode != 0 and "no module named distlab.cp.nope" in log


def test_sbatch_degrees_the_world_cannot_hold_fail_on_every_rank(slurm, tmp_path):
    proc, log = sbatch(slurm, tmp_path, "launch/usp.sh", "--ulysses", "2", "--ring", "2", "--device", "cpu",
                       env={"DISTLAB_NPROC_PER_NODE": "3"}, timeout=120)
    assert proc.returncode != 0
    assert log.count("error (ranks 0-2): --ulysses 2 x --ring 2 = 4, but the world size is 3") == 1, log[-3000:]


def test_submitit_job_on_slurm_returns_the_study_json(slurm, tmp_path):
    pytest.importorskip("submitit", reason="the slurm extra (submitit) is not installed")
    from distlab.submit import submit

    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = slurm.conf
    try:
        result = submit("distlab.cp.ring", ["--seq", "128", "--check", "--device", "cpu", "--iters", "1"],
                        tasks_per_node=2, cluster="slurm", folder=str(tmp_path / "submitit"), timeout_s=300)
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF")
        else:
            os.environ["SLURM_CONF"] = old
    assert result["world_size"] == 2 and result["check_passed"] and result["launcher"] == "torchrun"


def test_submitit_local_executor_without_slurm(tmp_path):
    pytest.importorskip("submitit", reason="the slurm extra (submitit) is not installed")
    from distlab.submit import submit

    result = submit("distlab.cp.ulysses", ["--seq", "128", "--check", "--device", "cpu", "--iters", "1"],
                    tasks_per_node=2, cluster="local", folder=str(tmp_path / "submitit"), timeout_s=300)
    assert result["method"] == "ulysses" and result["world_size"] == 2 and result["check_passed"]


def test_scripts_refuse_to_run_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", "launch/usp.sh", "--seq", "128"], env=env, capture_output=True, text=True,
                          timeout=30, cwd=REPO)
    assert proc.returncode == 2 and "submit it with sbatch" in proc.stderr


def test_submit_refuses_an_unknown_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.submit", "--cluster", "local", "--folder", str(tmp_path),
                           "-m", "distlab.cp.nope"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "no module named 'distlab.cp.nope'" in proc.stderr


def test_sbatch_training_script(slurm, tmp_path):
    proc, log = sbatch(slurm, tmp_path, "launch/train.sh", "--config", "tiny", "--steps", "5", "--device", "cpu",
                       env={"DISTLAB_NPROC_PER_NODE": "2"})
    assert proc.returncode == 0, proc.stderr + log[-3000:]
    assert "trained steps 0..4 on 2 rank(s), dp 2 x tp 1 x ring 1 x ulysses 1" in log


def test_slurm_local_stops_its_daemons_on_sigterm():
    """``python -m distlab.slurm_local`` in the foreground, then SIGTERM (a terminal closed, a job killed):
    it stops the slurmctld and slurmd it started instead of leaving them orphaned."""
    import re
    import signal
    import time

    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM is not installed here (missing {', '.join(missing)})")
    proc = subprocess.Popen([sys.executable, "-m", "distlab.slurm_local"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": REPO})
    line = proc.stdout.readline()                      # printed once the node is idle
    conf = re.search(r"SLURM_CONF=(\S+)", line)
    assert conf, line

    def daemons():
        out = subprocess.run(["pgrep", "-f", conf.group(1)], capture_output=True, text=True).stdout
        return [p for p in out.split() if p]

    assert daemons(), "no daemon runs with that configuration"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 15
    while daemons() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not daemons(), "slurmctld/slurmd left running after SIGTERM"
