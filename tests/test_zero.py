"""Sharded data parallelism (ZeRO-1/2/3, HSDP) and activation checkpointing against one device and against
replicated DP, on real gloo process groups."""

import pytest
import torch

from distlab import comm
from distlab.model import Llama, ModelConfig
from distlab.model.config import TrainConfig
from distlab.model.data import batch, corpus
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout
from distlab.zero import checkpoint_blocks


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


def sharded_vs_replicated(dtype, steps=2, ac="none", **layout):
    """ZeRO against replicated DP in the same layout otherwise, on the same batches: each step's loss, the
    first step's gradients (after clipping) and the weights after the AdamW steps, as relative errors."""
    from distlab.train import make_optimizer, train_step

    cfg = TrainConfig(lr=1e-2, warmup=1, steps=10, grad_clip=1.0)
    out = {}
    replicated = {k: v for k, v in layout.items() if k not in ("dp_shard", "dp_replicate", "zero")}
    for name, kw, mode in (("replicated", replicated, "none"), ("sharded", layout, ac)):
        model = build(reference(dtype), mode, **kw)
        optimizer = make_optimizer(model, cfg)
        step_grads = lambda: grads_of(model)   # noqa: E731
        losses, grads = [], None
        for step in range(steps):
            ids, targets, ctx = model.shard_batch(*batch(corpus(), step, 4, 16))
            if step == 0:   # the gradients the first AdamW step sees
                original = optimizer.step
                optimizer.step = lambda: (grads_seen.append(step_grads()), original())[1]   # noqa: E731
                grads_seen = []
            losses.append(train_step(model, optimizer, ids, targets, step, cfg, ctx=ctx))
            if step == 0:
                optimizer.step, grads = original, grads_seen[0]
        weights = model.zero.full_tensors(lambda p: p.detach()) if model.zero else \
            model.full_tensors(lambda p: p.detach())
        out[name] = (losses, grads, weights)
    (la, ga, wa), (lb, gb, wb) = out["replicated"], out["sharded"]
    return (max(abs(a - b) / abs(a) for a, b in zip(la, lb)), max(rel(gb[k], ga[k]) for k in ga),
            max(rel(wb[k], wa[k]) for k in wa))


REPLICATED = [dict(dp_shard=4, zero=1), dict(dp_shard=4, zero=2), dict(dp_shard=4), dict(dp_shard=2, tp=2),
              dict(dp_shard=2, dp_replicate=2, ac="selective"), dict(dp_shard=2, ring=2, ac="full")]


@pytest.mark.parametrize("case", REPLICATED, ids=[_name(c) for c in REPLICATED])
def test_adamw_steps_match_replicated(pools, case):
    """float32: losses and gradients within 1e-6 (bit-equal when every sum has two terms, as the shard and
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
