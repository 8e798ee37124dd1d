"""Fault injection: NaN/inf inputs, ranks given different shapes, bad inputs, frozen and killed ranks and
launchers, checkpoint writes killed at random points, corrupted and crafted checkpoints.

Each test asserts on the outcome a user sees: the error text, how long the failure took, and that no
earlier checkpoint was lost. The multi-rank parts run on real gloo groups (the session's pools) or under
``distlab run``.
"""

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from distlab import comm
from distlab.cp import allgather_attention, ring_attention, ulysses_attention, usp_attention
from distlab.model import checkpoint
from distlab.model.config import load_config
from distlab.model.llama import Llama
from tests.test_packed import CASES, _inputs, methods, reference

ENV = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------------------------ NaN / inf
def nan_and_inf_reach_the_outputs(case):
    """Runs on every rank: a NaN in one query and an inf in one key, under every method and layout; the
    forward's NaN pattern must be the math's, and every gradient the math makes NaN somewhere must be."""
    cu, causal, window = CASES[case]
    q, k, v, dout = _inputs(8, 2)
    cu_t = torch.tensor(cu)
    found = {}
    for fault in ("nan_q", "inf_k"):
        qf, kf = q.clone(), k.clone()
        if fault == "nan_q":
            qf[0, 61, 3, 2] = float("nan")
        else:
            kf[1, 50, 1, 0] = float("inf")
        want = reference(qf, kf, v, dout, cu, causal, window)
        assert want[0].isnan().any()
        for name, fn, sh, ga in methods(comm.group_size(), 8):
            local = [sh(t, cu_t).requires_grad_(True) for t in (qf, kf, v)]
            out = fn(*local, causal=causal, cu_seqlens=cu_t, window=window)
            out.backward(sh(dout, cu_t))
            got = [ga(t, cu_t) for t in (out.detach(), *(x.grad for x in local))]
            same_nans = torch.equal(got[0].isnan(), want[0].isnan())
            ok = ~want[0].isnan()
            close = torch.allclose(got[0][ok], want[0][ok], rtol=1e-9, atol=1e-9)
            grads = all(bool(g.isnan().any()) == bool(w.isnan().any()) for g, w in zip(got[1:], want[1:]))
            found[f"{fault} {name}"] = (same_nans, close, grads)
    return found


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["one_doc", "spanning", "window_over_shards", "full_in_docs"])
def test_nan_and_inf_in_the_inputs_reach_every_method_and_layout(pools, world, case):
    found = pools(world).run(nan_and_inf_reach_the_outputs, case)[0]
    bad = {name: r for name, r in found.items() if r != (True, True, True)}
    assert not bad, f"(forward NaNs as the math, finite rows equal, gradients NaN as the math): {bad}"
    assert any(name.startswith("inf_k usp") for name in found) == (world == 4)


# ------------------------------------------------------------------------ ranks given different inputs
def different_inputs_on_one_rank(method):
    """Runs on every rank: the last rank gets another sequence length (or feature count); returns the error
    each rank raised and the collectives it logged."""
    from distlab.runtime import Layout
    from distlab.tp.linear import ColumnParallelLinear, RowParallelLinear

    comm.forget_agreed()   # what an earlier task checked must not let one rank skip the check
    world, rank = comm.group_size(), comm.group_rank()
    odd = rank == world - 1
    seq = 6 if odd else 10          # lengths no other test uses
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, 4, 6, generator=g)
    k = v = torch.randn(1, seq, 2, 6, generator=g)
    with comm.CommLog() as log:
        try:
            if method == "ring":
                ring_attention(q, k, v, None, causal=True)
            elif method == "ulysses":
                ulysses_attention(q, k, v, None, causal=True)
            elif method == "allgather":
                allgather_attention(q, k, v, None, causal=True)
            elif method == "usp":
                mesh = Layout(world, cp=world, ulysses=2, ring=world // 2).build_mesh("cpu")
                usp_attention(q, k, v, mesh.get_group("ulysses"), mesh.get_group("ring"), causal=True)
            elif method == "ring_docs":   # one rank's documents differ
                cu = torch.tensor([0, 7, 10 * world] if odd else [0, 9, 10 * world])
                ring_attention(*(torch.randn(1, 10, 4, 6),) * 3, None, causal=True, cu_seqlens=cu)
            elif method == "column_sp":
                layer = ColumnParallelLinear(12, 8, group=None, sequence_parallel=True)
                layer(torch.randn(2, seq, 12))
            elif method == "row":
                layer = RowParallelLinear(8 * world, 12, group=None)
                layer(torch.randn(2, 5, 8 + odd))
            return "no error", dict(log.calls)
        except ValueError as e:
            return str(e), dict(log.calls)


@pytest.mark.parametrize("method,world", [("ring", 2), ("ulysses", 2), ("allgather", 3), ("usp", 4),
                                          ("ring_docs", 3), ("column_sp", 2), ("row", 2)])
def test_a_rank_given_other_shapes_fails_everywhere_with_one_clear_error(pools, method, world):
    """gloo used to abort that rank with SIGABRT ("Received data size doesn't match") and NCCL hangs."""
    t0 = time.monotonic()
    results = pools(world).run(different_inputs_on_one_rank, method, timeout_s=60)
    assert time.monotonic() - t0 < 20
    for rank, (error, calls) in enumerate(results):
        assert "were given different inputs" in error, (rank, error)
        assert f"rank {world - 1}:" in error or f"rank {world - 1} differs" in error, error
        assert not calls, f"rank {rank} ran collectives before refusing: {calls}"


def bad_input(what):
    from distlab.runtime import Layout
    from distlab.tp.linear import ColumnParallelLinear, RowParallelLinear

    world = comm.group_size()
    with comm.CommLog() as log:
        try:
            if what == "head_dim_0_ulysses":
                q, k = torch.randn(1, 8, 4, 0), torch.randn(1, 8, 2, 0)
                ulysses_attention(q, k, k, None, causal=True)
            elif what == "head_dim_0_usp":
                mesh = Layout(world, cp=world, ulysses=2, ring=world // 2).build_mesh("cpu")
                q, k = torch.randn(1, 8, 4, 0), torch.randn(1, 8, 2, 0)
                usp_attention(q, k, k, mesh.get_group("ulysses"), mesh.get_group("ring"), causal=True)
            elif what == "meta_ring":
                q = torch.empty(1, 8, 4, 8, device="meta")
                ring_attention(q, q, q, None, causal=True)
            elif what == "tp_in_features":
                ColumnParallelLinear(12, 8, sequence_parallel=True)(torch.randn(2, 4, 10))
            elif what == "tp_dtype":
                RowParallelLinear(8, 12)(torch.randn(2, 4, 8 // world, dtype=torch.float64))
            elif what == "tp_meta":
                ColumnParallelLinear(12, 8)(torch.empty(2, 4, 12, device="meta"))
            return "no error", dict(log.calls)
        except ValueError as e:
            return str(e), dict(log.calls)


@pytest.mark.parametrize("what,message", [("head_dim_0_ulysses", "head_dim must be >= 1"),
                                          ("head_dim_0_usp", "head_dim must be >= 1"),
                                          ("meta_ring", "meta tensor"), ("tp_in_features", "takes 12"),
                                          ("tp_dtype", "float64"), ("tp_meta", "meta tensor")])
def test_bad_inputs_are_a_value_error_before_any_collective(pools, what, message):
    for rank, (error, calls) in enumerate(pools(4).run(bad_input, what, timeout_s=60)):
        assert message in error, (rank, error)
        assert not calls, f"rank {rank} ran collectives before refusing: {calls}"


# --------------------------------------------------------------------------------------------- checkpoints
def _tiny(**overrides):
    cfg, _ = load_config("tiny")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _saved(path, cfg=None, step=1):
    """A real checkpoint: one AdamW step of the tiny model, saved to ``path`` as ``step``."""
    torch.manual_seed(0)
    cfg = cfg or _tiny()
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab, (2, 16))
    model.loss(ids, ids).backward()
    opt.step()
    checkpoint.save(str(path), model, opt, step)
    return cfg, model


def _flip(path, offset_from_middle=0, n=64):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 + offset_from_middle)
        chunk = bytearray(f.read(n))
        f.seek(-len(chunk), 1)
        f.write(bytes(b ^ 0xFF for b in chunk))


def test_a_corrupted_shard_or_manifest_is_refused(tmp_path):
    cfg, _ = _saved(tmp_path / "step_1")
    checkpoint.check_folder(str(tmp_path / "step_1"), cfg)
    for file, damage, message in [("model.safetensors", "flip", "SHA-256"), ("optimizer.safetensors", "flip", "SHA-256"),
                                  ("model.safetensors", "truncate", "bytes"), ("distlab.json", "garble", "damaged"),
                                  ("optimizer.safetensors", "delete", "missing")]:
        case = tmp_path / f"{file}-{damage}"
        subprocess.run(["cp", "-r", str(tmp_path / "step_1"), str(case)], check=True)
        target = case / file
        if damage == "flip":
            _flip(target)
        elif damage == "truncate":
            os.truncate(target, os.path.getsize(target) - 100)
        elif damage == "garble":
            target.write_text(target.read_text()[:-40])
        else:
            target.unlink()
        with pytest.raises(ValueError, match=message):
            checkpoint.load(str(case), cfg, lambda m: m, lambda m: torch.optim.AdamW(m.parameters()))


def test_a_crafted_checkpoint_cannot_run_code(tmp_path):
    """Pickles placed where the old format kept them, or in place of the tensors with matching checksums:
    nothing from the folder is unpickled, through the library and through train / infer."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    cfg, _ = _saved(tmp_path / "step_1")
    evil = tmp_path / "evil" / "step_1"
    subprocess.run(["mkdir", "-p", str(evil.parent)], check=True)
    subprocess.run(["cp", "-r", str(tmp_path / "step_1"), str(evil)], check=True)
    (evil / ".metadata").write_bytes(pickle.dumps(Payload()))
    (evil / "model.safetensors").write_bytes(pickle.dumps({"w": Payload()}))
    manifest = json.loads((evil / "distlab.json").read_text())
    manifest["files"]["model.safetensors"] = {"bytes": os.path.getsize(evil / "model.safetensors"),
                                              "sha256": checkpoint._sha256(evil / "model.safetensors")}
    (evil / "distlab.json").write_text(json.dumps(manifest))
    old = tmp_path / "old_format" / "step_1"   # torch.distributed.checkpoint's layout: a pickled .metadata
    old.mkdir(parents=True)
    (old / ".metadata").write_bytes(pickle.dumps(Payload()))
    (old / "distlab.json").write_text(json.dumps({"step": 1, "model": manifest["model"]}))
    with pytest.raises(ValueError, match="not a readable safetensors"):
        checkpoint.load_weights(str(evil), cfg)
    with pytest.raises(ValueError, match="older distlab"):
        checkpoint.load_weights(str(old), cfg)
    for cmd in (f"-m distlab.train --config tiny --steps 2 --resume {evil}", f"-m distlab.infer --checkpoint {old}"):
        proc = subprocess.run([sys.executable, *cmd.split()], capture_output=True, text=True, env=ENV, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()


def test_resuming_into_another_model_is_refused_with_both_values(tmp_path):
    _saved(tmp_path / "step_1", _tiny(layers=2))
    with pytest.raises(ValueError, match="layers: saved 2, now 1"):
        checkpoint.check_folder(str(tmp_path / "step_1"), _tiny(layers=1))


WRITER = """
import sys, time, torch
from distlab.model import checkpoint
from distlab.model.config import load_config
cfg, _ = load_config("tiny")
weights = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(12)}   # 48 MB: a write takes a while
print("ready", flush=True)
n = 0
while True:
    n += 1
    checkpoint.write_folder(sys.argv[1], 5, cfg, {**weights, "n": torch.tensor([float(n)])})
"""


def test_a_checkpoint_write_killed_at_random_points_never_loses_a_complete_one(tmp_path):
    """A process rewrites step_5 again and again (as a resumed run rewrites a step) and is SIGKILLed at a
    random moment, 12 times. step_3 and the last complete step_5 must survive every kill whole."""
    cfg = _tiny()
    ckpt = tmp_path / "ckpt"
    _saved(ckpt / "step_3", step=3)
    rng = random.Random(0)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    outcomes = []
    for trial in range(12):
        proc = subprocess.Popen([sys.executable, str(script), str(ckpt / "step_5")], stdout=subprocess.PIPE,
                                text=True, env=ENV)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        best = checkpoint.latest(str(ckpt))
        assert best in (str(ckpt / "step_5"), str(ckpt / "step_3"))
        assert checkpoint.check_folder(str(ckpt / "step_3"), cfg) == 3
        if os.path.exists(ckpt / "step_5"):
            assert best == str(ckpt / "step_5")
            assert checkpoint.check_folder(str(ckpt / "step_5"), cfg) == 5   # whole: size and SHA-256 agree
        leftovers = [d for d in os.listdir(ckpt) if d.startswith(".")]
        outcomes.append((os.path.exists(ckpt / "step_5"), len(leftovers)))
    assert any(present for present, _ in outcomes), "no write ever completed: the trials proved nothing"
    assert any(left for _, left in outcomes), "no kill ever landed inside a write: the trials proved nothing"


def test_resume_latest_picks_the_newest_complete_step_and_says_which(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = lambda *a: subprocess.run([sys.executable, "-m", "distlab.train", "--config", "tiny", *a],  # noqa: E731
                                    capture_output=True, text=True, env=ENV, timeout=300)
    proc = run("--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    assert proc.returncode == 0, proc.stderr
    (ckpt / "step_6").mkdir()                                     # a folder without a manifest: not complete
    (ckpt / "step_6" / "model.safetensors").write_bytes(b"partial")
    proc = run("--steps", "5", "--checkpoint-dir", str(ckpt), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr
    assert f"--resume latest: {ckpt}/step_4" in proc.stdout and "resumed from" in proc.stdout
    proc = run("--steps", "1", "--checkpoint-dir", str(tmp_path / "empty"), "--resume", "latest")
    assert proc.returncode == 0 and "starting at step 0" in proc.stdout, proc.stderr


# ----------------------------------------------------------------------------------- frozen and killed
def _distlab_run(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "distlab", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})


def _worker_pids(launcher_pid):
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    pids = {}
    for pid in map(int, out):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            pids[int(rank)] = pid
    return pids


def _wait_for_workers(proc, n, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _worker_pids(proc.pid)
        if len(pids) == n:
            return pids
        time.sleep(0.2)
    raise AssertionError("the workers did not start")


@pytest.mark.starts_early   # ~40 of its ~50 s are the timeout and torchrun's grace running out
def test_a_frozen_rank_fails_the_job_within_the_timeout_naming_the_collective():
    """SIGSTOP one worker of a TP run: its mesh groups time out after DISTLAB_TIMEOUT_S (they used to keep
    gloo's 30-minute default), and the error names the collective, where it was called and the frozen rank."""
    proc = _distlab_run("--nproc", "2", "-m", "distlab.train", "--config", "tiny", "--tp", "2", "--steps", "5000",
                        env={"DISTLAB_TIMEOUT_S": "8"})
    pids = _wait_for_workers(proc, 2)
    while "step" not in proc.stdout.readline():   # training has started
        pass
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert took < 8 + 40, took   # the timeout, then torchrun's 30 s grace before SIGKILL of the frozen rank
    assert "timed out after 8 s" in err and "collective all_reduce" in err and "called from distlab/" in err, err
    assert "error (rank 1): killed by SIGKILL" in err and "did not stop on SIGTERM" in err, err


def test_workers_die_with_a_sigkilled_launcher():
    proc = _distlab_run("--nproc", "2", "-m", "distlab.train", "--config", "tiny", "--steps", "5000")
    pids = _wait_for_workers(proc, 2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    alive = list(pids.values())
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split()[2] != "Z"]
        time.sleep(0.1)
    assert not alive, f"workers {alive} outlived their launcher"


def test_a_killed_rank_ends_the_job_naming_it():
    proc = _distlab_run("--nproc", "2", "-m", "distlab.train", "--config", "tiny", "--steps", "5000")
    pids = _wait_for_workers(proc, 2)
    while "step" not in proc.stdout.readline():
        pass
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - t0 < 15
    assert "rank 1" in err and "SIGKILL" in err, err


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_and_inf_reach_the_outputs_of_every_gpu_backend(dtype):
    """Each CUDA attention backend, and the merge of two key blocks, forward and backward: a NaN query row
    and an infinite key give the NaN pattern of the math (the merges and the Triton backward used to turn a
    NaN LSE into 'no key')."""
    from distlab.kernels.lse_merge import merge_attention
    from distlab.kernels.attention import attention_backward, attention_forward, available_backends

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 256, 4, 64, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    q[0, 100, 1, 3] = float("nan")
    k[0, 60, 0, 5] = float("inf")
    want, _ = attention_forward(q.double().cpu(), k.double().cpu(), v.double().cpu(), True, None, "torch")
    for backend in available_backends("cuda", dtype):
        out, lse = attention_forward(q, k, v, True, None, backend)
        assert torch.equal(out.isnan().cpu(), want.isnan()), backend
        dq, dk, dv = attention_backward(do, q, k, v, out, lse, True, None, backend)
        assert dq.isnan().any() and dk.isnan().any() and dv.isnan().any(), backend
        # the same keys in two blocks, merged: the rows that see the inf key and the NaN row stay NaN
        o1, l1 = attention_forward(q, k[:, :128], v[:, :128], False, None, backend)
        o2, l2 = attention_forward(q, k[:, 128:], v[:, 128:], False, None, backend)
        merged, _ = merge_attention(*merge_attention(None, None, o1, l1), o2, l2)
        full, _ = attention_forward(q, k, v, False, None, backend)
        assert torch.equal(merged.isnan(), full.isnan()), backend
