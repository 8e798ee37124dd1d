"""Start-up: launcher environments, Layout validation and mesh, the `distlab run` argument rewrite."""

import pytest

from distlab.cli import torchrun_args
from distlab.runtime import Layout, launch_env


def test_launch_env_reads_torchrun_then_slurm_then_single(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.setenv(var, "x")   # so that monkeypatch restores the variable's absence afterwards too
        monkeypatch.delenv(var)
    assert launch_env() == ("single", 0, 1, 0)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-node7")
    monkeypatch.setenv("PATH", "/nonexistent")           # no scontrol: fall back to the first node name
    assert launch_env() == ("slurm", 5, 8, 1)
    import os

    assert os.environ["MASTER_ADDR"] == "gpu-node7" and os.environ["MASTER_PORT"] == str(20000 + 1234)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launch_env() == ("torchrun", 3, 4, 3)       # torchrun inside an allocation wins


@pytest.mark.parametrize("dims,message", [
    (dict(world_size=8, dp=2, cp=2, tp=3), "multiply to 12, but the world size is 8"),
    (dict(world_size=4, dp=0, cp=4), "dp=0"),
    (dict(world_size=4, cp=2.0, dp=2), "cp=2.0"),
    (dict(world_size=6, cp=6, ulysses=4), "cp=6 is not divisible by the given CP axis degree 4"),
    (dict(world_size=6, cp=6, ulysses=2, ring=2), "ulysses=2 x ring=2 = 4, but cp=6"),
    (dict(world_size=8, ulysses=2, ring=2), "multiply to 4, but the world size is 8"),
])
def test_parallel_dims_refuses_bad_degrees(dims, message):
    with pytest.raises(ValueError, match=message):
        Layout(**dims)


def mesh_groups(**degrees):
    import torch.distributed as dist

    mesh = Layout(dist.get_world_size(), **degrees).build_mesh("cpu")
    return {axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in ("dp", "cp", "ring", "ulysses", "tp")}


def test_parallel_dims_builds_named_mesh(pools):
    groups = pools(8).run(mesh_groups, dp=2, cp=2, tp=2)
    # tp is innermost (adjacent ranks), then the CP axes (pure ring here), then dp
    assert groups[0] == {"dp": [0, 4], "cp": [0, 2], "ring": [0, 2], "ulysses": [0], "tp": [0, 1]}
    assert groups[7] == {"dp": [3, 7], "cp": [5, 7], "ring": [5, 7], "ulysses": [7], "tp": [6, 7]}


def test_parallel_dims_cp_axes(pools):
    groups = pools(8).run(mesh_groups, ulysses=2, ring=2, tp=2)
    # ulysses is inside ring; cp is their flattening
    assert groups[0] == {"dp": [0], "cp": [0, 2, 4, 6], "ring": [0, 4], "ulysses": [0, 2], "tp": [0, 1]}
    assert groups[5] == {"dp": [5], "cp": [1, 3, 5, 7], "ring": [1, 5], "ulysses": [5, 7], "tp": [4, 5]}
    dims = Layout(8, cp=4, ring=2, tp=2)
    assert (dims.ulysses, dims.ring, dims.cp) == (2, 2, 4)
    assert Layout(4, cp=4).ring == 4


@pytest.mark.parametrize("argv,want", [
    (["--nproc", "4", "-m", "distlab.cp.ring", "--seq", "8192"],
     ["--standalone", "--nproc-per-node", "4", "-m", "distlab.cp.ring", "--seq", "8192"]),
    (["--nproc=8", "-m", "x", "--nproc", "3"], ["--standalone", "--nproc-per-node", "8", "-m", "x", "--nproc", "3"]),
    (["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "train.py", "-v"],
     ["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "train.py", "-v"]),
])
def test_distlab_run_rewrites_nproc_and_passes_the_rest(argv, want):
    assert torchrun_args(argv) == want


def test_distlab_run_needs_a_program():
    with pytest.raises(SystemExit) as e:
        torchrun_args(["--nproc", "2"])
    assert e.value.code == 2


def test_program_arguments_are_not_parsed_by_torchrun():
    from distlab.cli import split_program

    launcher, program = split_program(["--nproc", "2", "-m", "distlab.collectives", "--max", "1G", "--min", "8"])
    assert launcher == ["--standalone", "--nproc-per-node", "2", "-m", "distlab.collectives"]
    assert program == ["--max", "1G", "--min", "8"]     # '--max' would be "ambiguous" to torchrun's argparse


def stalled_mesh_collective(timeout_s):
    """Rank 1 never joins an all-reduce on a mesh subgroup: rank 0 must fail after about timeout_s."""
    import time as _time

    import torch
    import torch.distributed as dist

    from distlab import comm
    from distlab.runtime import Layout

    mesh = Layout(comm.group_size(), dp=2).build_mesh("cpu", timeout_s=timeout_s)
    group = mesh.get_group("dp")
    if comm.group_rank() == 1:
        _time.sleep(timeout_s + 6)
        return None
    t0 = _time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as e:   # gloo's timeout error (DistBackendError is a RuntimeError)
        return _time.monotonic() - t0, str(e)[:200]
    return None


def test_a_stalled_rank_times_out_mesh_subgroups():
    """DeviceMesh subgroups get the runtime's timeout, not gloo's 30 minutes (issue #27). Its own pool: a
    timed-out gloo pair is closed for good, and the shared pools must not inherit that."""
    from distlab.testing import ProcessGroupPool

    pool = ProcessGroupPool(2)
    try:
        got = pool.run(stalled_mesh_collective, 3.0, timeout_s=60)[0]
    finally:
        pool.close()
    assert got is not None and 2.5 < got[0] < 20, got        # waited its timeout, not gloo's 30 minutes
