"""Sharded data parallelism (ZeRO-1/2/3, HSDP) and activation checkpointing against one device and against
replicated DP, on real gloo process groups."""

import contextlib

import pytest
import torch

from distlab import comm
from distlab.model import Llama, ModelConfig
from distlab.model.config import TrainConfig
from distlab.model.data import batch, corpus
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout
from distlab.testing import ProcessGroupPool
from distlab.zero import checkpoint_blocks


@contextlib.contextmanager
def fresh_pool(pools, world, fsdp2):
    """The shared pool, or for a task that runs FSDP2 a pool of its own: DTensor caches what it derives from a
    mesh by the mesh's value (shape, ranks, names), so a later task's equal mesh got a cached mesh whose
    groups the shared pool had destroyed after the earlier task ("Could not resolve the process group")."""
    if not fsdp2:
        yield pools(world)
        return
    pool = ProcessGroupPool(world)
    try:
        yield pool
    finally:
        pool.close()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def reference(dtype, experts=0, seed=0, kv_heads=2):
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=kv_heads, ffn=96, moe_experts=experts)
    torch.manual_seed(seed)
    ref = Llama(cfg, dtype=dtype)
    with torch.no_grad():
        for m in ref.modules():
            if m.__class__.__name__ == "RMSNorm":
                m.weight.uniform_(0.5, 1.5)
    return ref


def build(ref, ac="none", **layout):
    layout = Layout.for_model(comm.group_size(), **layout)
    return checkpoint_blocks(ParallelLlama(ref, layout, layout.build_mesh("cpu")), ac)


def grads_of(model):
    """A copy of every gradient in the one-device names (the pieces gathered under ZeRO)."""
    def get(p):
        return p.grad.clone() if p.grad is not None else torch.zeros_like(p)

    return model.zero.full_tensors(get) if model.zero else model.full_tensors(get)


def sharded_vs_one_device(ac="none", experts=0, kv_heads=2, **layout):
    """Loss and every gradient, float64, against the one-device model on the same global batch."""
    ref = reference(torch.float64, experts, kv_heads=kv_heads)
    ids, targets = batch(corpus(), 3, 12, 16)
    loss_ref = ref.loss(ids, targets)
    loss_ref.backward()
    model = build(ref, ac, **layout)
    my_ids, my_targets, ctx = model.shard_batch(ids, targets)
    for _ in range(2):   # twice: the hooks must leave the model ready for the next step
        for p in model.optimizer_parameters():
            p.grad = None
        with comm.CommLog() as log:
            loss = model.loss(my_ids, my_targets, **ctx)
            loss.backward()
            model.sync_gradients()
    n = comm.group_size(model.replica_group)
    errors = {"loss": rel(comm.all_reduce_raw(loss.detach().reshape(1), model.replica_group) / n,
                          loss_ref.detach().reshape(1))}
    want = dict(ref.named_parameters())
    for name, g in grads_of(model).items():
        errors[name] = rel(g, want[name].grad)
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters()))
    errors["grad_norm"] = abs(model.zero.grad_norm().item() - norm.item()) / norm.item() if model.zero else 0.0
    return errors, dict(log.calls), model.zero.step_counts() if model.zero else {}


SHARDED = [dict(dp_shard=2, zero=z) for z in (1, 2, 3)] + [
    dict(dp_shard=3), dict(dp_shard=4), dict(dp_shard=4, zero=2),
    dict(dp_shard=2, tp=2), dict(dp_shard=2, tp=2, zero=1), dict(dp_shard=2, ring=2), dict(dp_shard=2, tp=2, sp=True),
    dict(dp_shard=2, dp_replicate=2), dict(dp_shard=1, ring=2, tp=2),
    dict(dp_shard=2, ac="full"), dict(dp_shard=2, ac="selective"), dict(dp_shard=2, ac="selective", tp=2),
    dict(dp_shard=2, ring=2, ac="full"), dict(dp_shard=2, experts=4), dict(dp_shard=2, tp=2, experts=4),
    dict(dp_shard=2, tp=2, kv_heads=1), dict(dp_shard=2, tp=2, kv_heads=1, zero=1)]


def _name(case):
    return "-".join(f"{k.replace('dp_', '')}{v}" for k, v in case.items())


@pytest.mark.parametrize("case", SHARDED, ids=[_name(c) for c in SHARDED])
def test_sharded_matches_one_device(pools, case):
    layout = {k: v for k, v in case.items() if k not in ("ac", "experts", "kv_heads")}
    world = (layout.get("dp_shard", 1) * layout.get("dp_replicate", 1) * layout.get("tp", 1) * layout.get("ring", 1))
    for errors, calls, counts in pools(world).run(sharded_vs_one_device, case.get("ac", "none"),
                                                   case.get("experts", 0), case.get("kv_heads", 2), **layout):
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
        if layout.get("zero", 3) >= 2 and world // layout.get("tp", 1) > 1:
            assert calls["reduce_scatter"] >= 3   # a reduce-scatter per block and the root, per step
        if layout.get("zero", 3) == 3:   # each block gathered for its forward and again for its backward
            assert counts["all_gather"] >= 2 * (2 * 2 + 1) - 1, counts


def train_steps(dtype, steps=2, ac="none", fsdp_impl="hand", **layout):
    """(each step's loss, the first step's gradients after clipping, the weights after the AdamW steps)."""
    from distlab.train import make_optimizer, train_step

    cfg = TrainConfig(lr=1e-2, warmup=1, steps=10, grad_clip=1.0)
    layout = Layout.for_model(comm.group_size(), **layout)
    model = checkpoint_blocks(ParallelLlama(reference(dtype), layout, layout.build_mesh("cpu"), fsdp_impl), ac)
    optimizer = make_optimizer(model, cfg)
    original, seen, losses = optimizer.step, [], []
    optimizer.step = lambda: (seen.append(grads_of(model)), original())[1]   # noqa: E731
    for step in range(steps):
        ids, targets, ctx = model.shard_batch(*batch(corpus(), step, 4, 16))
        losses.append(train_step(model, optimizer, ids, targets, step, cfg, ctx=ctx))
    weights = model.zero.full_tensors(lambda p: p.detach()) if model.zero else model.full_tensors(lambda p: p.detach())
    return losses, seen[0], weights


def sharded_vs_replicated(dtype, ac="none", fsdp_impl="hand", **layout):
    """ZeRO against replicated DP in the same layout otherwise (or, ``fsdp_impl="torch"``, FSDP2 against the
    hand-written ZeRO), on the same batches: relative errors of the losses, the gradients, the weights."""
    if fsdp_impl == "torch":
        la, ga, wa = train_steps(dtype, ac=ac, **layout)
    else:
        la, ga, wa = train_steps(dtype, **{k: v for k, v in layout.items() if k not in ("dp_shard", "dp_replicate", "zero")})
    lb, gb, wb = train_steps(dtype, ac=ac, fsdp_impl=fsdp_impl, **layout)
    return (max(abs(a - b) / abs(a) for a, b in zip(la, lb)), max(rel(gb[k], ga[k]) for k in ga),
            max(rel(wb[k], wa[k]) for k in wa))


REPLICATED = [dict(dp_shard=4, zero=1), dict(dp_shard=4, zero=2), dict(dp_shard=4), dict(dp_shard=2, tp=2),
              dict(dp_shard=2, dp_replicate=2, ac="selective"), dict(dp_shard=2, ring=2, ac="full")]


@pytest.mark.parametrize("case", REPLICATED, ids=[_name(c) for c in REPLICATED])
def test_adamw_steps_match_replicated(pools, case):
    """ZeRO against replicated DP, and FSDP2 against the hand-written ZeRO. float32: losses and gradients within 1e-6 (bit-equal when every sum has two terms, as the shard and
    replica groups of 2 give); the weights after AdamW in float64 within 1e-10. (In float32 AdamW's first
    update lr·g/(|g|+eps) turns an ulp of a near-zero gradient, summed in another order over 4 ranks, into
    ~1e-5 of a weight: the optimizer's conditioning, not the sharding.)"""
    two_term = case.get("dp_shard", 1) * case.get("ring", 1) <= 2 and case.get("dp_replicate", 1) <= 2 and \
        case.get("dp_shard", 1) * case.get("dp_replicate", 1) * case.get("ring", 1) <= 2
    for loss_err, grad_err, weight_err in pools(4).run(sharded_vs_replicated, torch.float32, **case):
        assert loss_err <= 1e-6 and grad_err <= 1e-6, (loss_err, grad_err)
        if two_term:
            assert loss_err == grad_err == weight_err == 0.0, (loss_err, grad_err, weight_err)
    for loss_err, grad_err, weight_err in pools(4).run(sharded_vs_replicated, torch.float64, **case):
        assert max(loss_err, grad_err, weight_err) <= 1e-10, (loss_err, grad_err, weight_err)


FSDP2 = [dict(dp_shard=4), dict(dp_shard=2, ring=2, zero=2), dict(dp_shard=2, dp_replicate=2, ac="selective")]


def fsdp2_against_hand(path):
    """Every FSDP2 comparison in one task (see ``fresh_pool``): each layout against the hand-written ZeRO in
    float32 and float64, then the checkpoints resharded."""
    out = {f"{_name(case)}-{dtype}": sharded_vs_replicated(dtype, fsdp_impl="torch", **case)
           for case in FSDP2 for dtype in (torch.float32, torch.float64)}
    return out, save_then_load(path)


def test_fsdp2_matches_the_hand_written_zero_and_checkpoints_reshard(pools, tmp_path):
    """FSDP2 (``--fsdp-impl torch``) against the hand-written ZeRO: losses and gradients within 1e-6 (float32),
    and weights too within 1e-10 (float64). Then a checkpoint saved at --dp-shard 4 (hand) loads at dp-shard 2 x tp 2
    (hand), HSDP 2 x 2 under FSDP2 and replicated dp 4 with every weight and AdamW moment equal, and the next
    step's loss within 1e-6."""
    with fresh_pool(pools, 4, True) as pool:
        results = pool.run(fsdp2_against_hand, str(tmp_path / "step_1"))
    for compared, resharded in results:
        for name, (loss_err, grad_err, weight_err) in compared.items():   # float32 weights: see above
            assert max(loss_err, grad_err) <= 1e-6 and ("float32" in name or weight_err <= 1e-10), (name, compared)
        for name, (state_err, loss_err, step) in resharded.items():
            assert step == 1 and state_err == 0.0 and loss_err < 1e-6, (name, resharded)


def bad_layout(**layout):
    return Layout.for_model(comm.group_size(), **layout)


@pytest.mark.parametrize("layout,message", [
    (dict(dp_shard=3), "does not divide the 4 data-parallel"),
    (dict(zero=2), "give --dp-shard"),
    (dict(dp_shard=2, dp_replicate=3), "but the other degrees leave"),
    (dict(dp_shard=2, zero=4), "--zero 4"),
])
def test_bad_sharding_refused_on_every_rank(pools, layout, message):
    for ok, text in pools(4).run_all(bad_layout, **layout):
        assert not ok and message in text, text


def test_train_resumes_a_zero_run_bit_for_bit(tmp_path):
    """distlab.train --dp-shard 2 saves consolidated checkpoints and resumes in the same layout bit for bit;
    --memory prints the table and the collectives of a step. (Resharding: the FSDP2 test below.)"""
    import json
    import os
    import subprocess
    import sys

    def run(*flags):
        out = tmp_path / f"run{len(list(tmp_path.glob('*.json')))}.json"
        cmd = [sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.train", "--config", "tiny",
               "--steps", "4", "--device", "cpu", "--json", str(out), "--dp-shard", "2", "--ac", "selective", *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text()), proc.stdout

    straight, text = run("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2", "--memory")
    assert "parameters" in text and "ZeRO-3 per step (the last): all_gather 5, hooks" in text, text
    assert straight["zero_counts"]["reduce_scatter"] == 3                 # 2 blocks + the root
    same, _ = run("--resume", str(tmp_path / "ckpt" / "step_2"))
    assert sorted(same["losses"], key=int) == ["2", "3"]
    assert same["losses"] == {s: straight["losses"][s] for s in same["losses"]}   # bit for bit


def save_then_load(path, dtype=torch.float32):   # checkpoints load into a float32 model
    """One AdamW step at --dp-shard 4, saved; loaded at dp-shard 2 x tp 2 (hand), HSDP 2 x 2 under FSDP2 and
    replicated dp 4: every weight and moment equal to the saved ones, and the next step's loss equal."""
    from distlab.model import checkpoint
    from distlab.train import make_optimizer, train_step

    cfg = TrainConfig(lr=1e-2, warmup=1, steps=10)
    layouts = {"saved": (dict(dp_shard=4), "hand"), "hand-tp2": (dict(dp_shard=2, tp=2), "hand"),
               "torch-hsdp": (dict(dp_shard=2, dp_replicate=2), "torch"), "replicated": ({}, "hand")}

    def build_for(name):
        kw, impl = layouts[name]
        layout = Layout.for_model(comm.group_size(), **kw)
        mesh = layout.build_mesh("cpu")
        return lambda ref: ParallelLlama(ref, layout, mesh, impl)

    def state(model, optimizer):
        full = model.zero.full_tensors if model.zero else model.full_tensors
        out = {f"w.{k}": v for k, v in full(lambda p: p.detach()).items()}
        for key in ("exp_avg", "exp_avg_sq"):
            out.update({f"{key}.{k}": v for k, v in full(lambda p: optimizer.state[p][key]).items()})
        return out

    def next_loss(model, optimizer):
        ids, targets, ctx = model.shard_batch(*batch(corpus(), 1, 4, 16))
        return train_step(model, optimizer, ids, targets, 1, cfg, ctx=ctx)

    model = build_for("saved")(reference(dtype))
    optimizer = make_optimizer(model, cfg)
    ids, targets, ctx = model.shard_batch(*batch(corpus(), 0, 4, 16))
    train_step(model, optimizer, ids, targets, 0, cfg, ctx=ctx)
    checkpoint.save(path, model, optimizer, 1)
    saved = state(model, optimizer)
    want = next_loss(model, optimizer)
    errors = {}
    for name in ("hand-tp2", "torch-hsdp", "replicated"):
        loaded, opt, step = checkpoint.load(path, model.cfg, build_for(name), lambda m: make_optimizer(m, cfg))
        got = state(loaded, opt)
        errors[name] = (max(rel(got[k], saved[k]) for k in saved), abs(next_loss(loaded, opt) - want) / abs(want), step)
    return errors


@pytest.mark.parametrize("flags,message", [
    (("--dp-shard", "1", "--tp", "2", "--fsdp-impl", "torch"), "--fsdp-impl torch runs with --tp 1"),
])
def test_train_refuses_bad_sharding_on_every_rank(flags, message):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.train", "--config", "tiny",
           "--steps", "1", "--device", "cpu", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "error (ranks 0, 1)" in proc.stderr and message in proc.stderr, proc.stderr[-2000:]
