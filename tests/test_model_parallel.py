"""The sharded mini Llama (DP × TP, with and without SP) against the one-device model: loss and every
gradient at 1e-10 (float64), and one AdamW step giving equal weights."""

import pytest
import torch

from distlab import comm
from distlab.model import Llama, ModelConfig
from distlab.model.data import batch, corpus, packed_batch
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout


def parallel(ref, dp, tp, ring=1, ulysses=1, sp=False, cp_layout="zigzag", cp_method="ring"):
    """The ParallelLlama of this layout on a new mesh: the pool destroys the groups a task creates when it
    returns (``distlab.testing``), so a mesh cannot outlive its test."""
    layout = Layout(comm.group_size(), dp=dp, tp=tp, ring=ring, ulysses=ulysses, sp=sp, cp_layout=cp_layout,
                    cp_method=cp_method)
    return ParallelLlama(ref, layout, layout.build_mesh("cpu"))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def parallel_vs_one_device(dp, tp, sp, ring=1, ulysses=1, layout="zigzag", experts=0, packed=False, cp_method="ring"):
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, moe_experts=experts)
    torch.manual_seed(0)
    ref = Llama(cfg, dtype=torch.float64)
    with torch.no_grad():
        for m in ref.modules():
            if m.__class__.__name__ == "RMSNorm":
                m.weight.uniform_(0.5, 1.5)
    if packed:   # documents of 1-8 tokens: boundaries inside every shard, ignored targets spread unevenly
        data = corpus()
        starts = torch.randint(1, 9, (len(data) // 2,), generator=torch.Generator().manual_seed(1)).cumsum(0)
        ids, targets, docs = packed_batch(data, starts[starts < len(data)], 3, 4, 16)
    else:
        (ids, targets), docs = batch(corpus(), 3, 4, 16), None
    loss_ref = ref.loss(ids, targets, docs)
    loss_ref.backward()
    model = parallel(ref, dp, tp, ring, ulysses, sp, layout, cp_method)
    tpg = model.tp_group
    if packed:
        my_ids, my_targets, ctx = model.shard_batch(ids, targets, docs)
    else:
        my_ids, my_targets, ctx = model.shard_batch(ids, targets)
    with comm.CommLog() as log:
        loss = model.loss(my_ids, my_targets, **ctx)
    loss.backward()
    model.sync_gradients()
    loss_all = comm.all_reduce_raw(loss.detach().reshape(1), model.replica_group) / (dp * ring * ulysses)
    errors = {"loss": rel(loss_all, loss_ref.detach().reshape(1)),
              "embed": rel(comm.all_gather_raw(model.embed.weight.grad, tpg, 0), ref.embed.weight.grad),
              "head": rel(comm.all_gather_raw(model.head.weight.grad, tpg, 0), ref.head.weight.grad),
              "norm": rel(model.norm.weight.grad, ref.norm.weight.grad)}
    for i, (block, rblock) in enumerate(zip(model.blocks, ref.blocks)):
        if experts:   # MoE block: attention over tp, experts sharded over dp x cp x tp, no dense MLP
            grads = block.full_tensors(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
            for name in ("qkv", "o", "norm1", "norm2"):
                errors[f"block{i}.{name}"] = rel(grads[name], getattr(rblock, name).weight.grad)
            errors[f"block{i}.router"] = rel(block.moe.router.weight.grad, rblock.moe.router.weight.grad)
            for name in ("w_gate", "w_up", "w_down"):
                full = comm.all_gather_raw(getattr(block.moe, name).grad, model.ep_group, 0)
                errors[f"block{i}.{name}"] = rel(full, getattr(rblock.moe, name).grad)
            continue
        for name, g in block.full_grads().items():
            errors[f"block{i}.{name}"] = rel(g, getattr(rblock, name).weight.grad)
    return errors, dict(log.calls)


LAYOUTS = [(4, 1, False), (1, 4, False), (2, 2, False), (2, 2, True), (1, 4, True), (1, 2, True)]


@pytest.mark.parametrize("dp,tp,sp", LAYOUTS, ids=[f"dp{d}-tp{t}{'-sp' if s else ''}" for d, t, s in LAYOUTS])
def test_sharded_model_matches_one_device(pools, dp, tp, sp):
    world = dp * tp
    for errors, calls in pools(world).run(parallel_vs_one_device, dp, tp, sp):
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
        if tp > 1 and not sp:
            assert calls["all_reduce"] >= 2 * 2 + 1            # 2 per block + the embedding (+ the CE's reductions)


CP_LAYOUTS = [  # (world, dp, tp, sp, ring, ulysses, layout)
    (4, 1, 1, False, 4, 1, "zigzag"), (4, 1, 1, False, 4, 1, "contiguous"), (4, 1, 1, False, 1, 4, "contiguous"),
    (4, 1, 1, False, 2, 2, "zigzag"), (4, 1, 2, True, 2, 1, "zigzag"), (4, 2, 1, False, 1, 2, "contiguous"),
    (8, 2, 2, True, 2, 1, "zigzag"), (8, 1, 2, False, 2, 2, "zigzag"),
]


@pytest.mark.parametrize("world,dp,tp,sp,ring,ulysses,layout", CP_LAYOUTS,
                         ids=[f"dp{d}-tp{t}{'-sp' if s else ''}-ring{r}-uly{u}-{lay}" for _, d, t, s, r, u, lay in CP_LAYOUTS])
def test_sharded_model_with_context_parallelism(pools, world, dp, tp, sp, ring, ulysses, layout):
    for errors, _ in pools(world).run(parallel_vs_one_device, dp, tp, sp, ring, ulysses, layout):
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}


EP_LAYOUTS = [  # (world, dp, tp, sp, ring, ulysses, experts); EP = every rank
    (4, 4, 1, False, 1, 1, 4), (4, 2, 1, False, 2, 1, 4), (4, 1, 1, False, 2, 2, 8), (8, 2, 1, False, 2, 2, 8),
    (4, 1, 2, False, 2, 1, 4), (4, 1, 2, True, 2, 1, 8), (8, 2, 2, True, 2, 1, 8), (8, 1, 2, False, 2, 2, 8),
]


@pytest.mark.parametrize("world,dp,tp,sp,ring,ulysses,experts", EP_LAYOUTS,
                         ids=[f"dp{d}-tp{t}{'-sp' if s else ''}-ring{r}-uly{u}-ep{w}-e{e}" for w, d, t, s, r, u, e in EP_LAYOUTS])
def test_sharded_moe_model_with_expert_parallelism(pools, world, dp, tp, sp, ring, ulysses, experts):
    for errors, calls in pools(world).run(parallel_vs_one_device, dp, tp, sp, ring, ulysses, "zigzag", experts):
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
        assert calls["all_to_all"] >= 2 * 3                    # counts, dispatch, combine in each of 2 layers


def one_clipped_step_vs_one_device(dp, tp, sp, ring, ulysses, experts):
    """Gradient norm, then one clipped AdamW step: the loss after the step equals one device's to 1e-10."""
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, moe_experts=experts)
    torch.manual_seed(1)
    ref = Llama(cfg, dtype=torch.float64)
    model = parallel(ref, dp, tp, ring, ulysses, sp)
    ids, targets = batch(corpus(), 7, 4, 16)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref.loss(ids, targets).backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
    opt_ref.step()
    my_ids, my_targets, ctx = model.shard_batch(ids, targets)
    model.loss(my_ids, my_targets, **ctx).backward()
    model.sync_gradients()
    norm = model.clip_grad_norm(0.5)
    opt.step()
    with torch.no_grad():
        after_ref = ref.loss(ids, targets).item()
        after = comm.all_reduce_raw(model.loss(my_ids, my_targets, **ctx).reshape(1), model.replica_group).item()
        after /= comm.group_size(model.replica_group)
    return abs(norm - norm_ref) / norm_ref, abs(after - after_ref) / after_ref, norm_ref


STEP_LAYOUTS = [(1, 2, True, 2, 1, 0), (2, 2, False, 1, 1, 0), (1, 4, False, 1, 1, 0), (2, 1, False, 1, 2, 4),
                (1, 2, False, 2, 1, 4)]


@pytest.mark.parametrize("dp,tp,sp,ring,ulysses,experts", STEP_LAYOUTS,
                         ids=[f"dp{d}-tp{t}{'-sp' if s else ''}-ring{r}-uly{u}-e{e}" for d, t, s, r, u, e in STEP_LAYOUTS])
def test_one_clipped_optimizer_step_equals_one_device(pools, dp, tp, sp, ring, ulysses, experts):
    for norm_err, loss_err, norm in pools(dp * tp * ring * ulysses).run(one_clipped_step_vs_one_device, dp, tp, sp,
                                                                         ring, ulysses, experts):
        assert norm > 0.5                     # the clip is active
        assert norm_err < 1e-10 and loss_err < 1e-10, (norm_err, loss_err)


def bad_layout():
    return parallel(Llama(ModelConfig(vocab=250)), 1, 4)


def test_indivisible_vocab_refused_on_every_rank(pools):
    outcome = pools(4).run_all(bad_layout, timeout_s=60)
    assert all(not ok and "vocabulary size (250) is not divisible" in msg for ok, msg in outcome), outcome


PACKED_LAYOUTS = [  # (world, dp, tp, sp, ring, ulysses, layout, experts)
    (2, 2, 1, False, 1, 1, "zigzag", 0), (2, 1, 1, False, 2, 1, "zigzag", 0), (4, 1, 1, False, 4, 1, "balanced", 0),
    (4, 1, 1, False, 1, 4, "contiguous", 0), (4, 1, 1, False, 2, 2, "balanced", 0), (4, 1, 2, True, 2, 1, "zigzag", 0),
    (4, 2, 2, False, 1, 1, "zigzag", 0), (8, 2, 1, False, 2, 2, "zigzag", 0), (4, 2, 1, False, 2, 1, "zigzag", 4),
    (8, 1, 2, True, 2, 2, "balanced", 8),
]


@pytest.mark.parametrize("world,dp,tp,sp,ring,ulysses,layout,experts", PACKED_LAYOUTS,
                         ids=[f"dp{d}-tp{t}{'-sp' if s else ''}-ring{r}-uly{u}-{lay}{f'-e{e}' if e else ''}"
                              for _, d, t, s, r, u, lay, e in PACKED_LAYOUTS])
def test_packed_documents_match_one_device(pools, world, dp, tp, sp, ring, ulysses, layout, experts):
    """Packed rows (documents of 1-8 tokens, RoPE restarting in each, the last token of each ignored): the loss
    is the mean over the global batch's non-ignored targets and every gradient is the one-device one, though
    each rank holds a different number of ignored targets."""
    for errors, _ in pools(world).run(parallel_vs_one_device, dp, tp, sp, ring, ulysses, layout, experts, True):
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}


ALLGATHER_LAYOUTS = [  # (world, dp, tp, sp, ring, layout, packed)
    (4, 1, 1, False, 4, "zigzag", False), (4, 1, 2, True, 2, "contiguous", False), (4, 1, 1, False, 4, "balanced", True),
    (2, 1, 1, False, 2, "contiguous", True),     # (the model tests' 16-token rows do not split over 3)
]


@pytest.mark.parametrize("world,dp,tp,sp,ring,layout,packed", ALLGATHER_LAYOUTS,
                         ids=[f"tp{t}{'-sp' if s else ''}-ring{r}-{lay}{'-packed' if p else ''}"
                              for _, d, t, s, r, lay, p in ALLGATHER_LAYOUTS])
def test_allgather_kv_in_the_model(pools, world, dp, tp, sp, ring, layout, packed):
    """``--cp-method allgather``: the model's attention is all-gather KV over the ring axis; loss and every
    gradient equal the one-device model's, plain and packed; it gathers K/V and never sends a ring hop."""
    for errors, calls in pools(world).run(parallel_vs_one_device, dp, tp, sp, ring, 1, layout, 0, packed, "allgather"):
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
        assert calls.get("allgather_kv", 0) > 0 and not any(k.startswith("ring") for k in calls), calls


def test_allgather_layout_refuses_ulysses():
    with pytest.raises(ValueError, match="--cp-method allgather gathers K/V over the whole CP axis"):
        Layout(4, ring=2, ulysses=2, cp_method="allgather")
    with pytest.raises(ValueError, match="--cp-method 'stripe'"):
        Layout(4, ring=4, cp_method="stripe")


def test_a_packed_row_is_its_documents_run_one_by_one():
    """What packing means: the logits of each document in a packed row equal the model run on that document
    alone (attention stays inside it, RoPE restarts at its first token)."""
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=2, ffn=96)
    torch.manual_seed(0)
    ref = Llama(cfg, dtype=torch.float64)
    ids = corpus()[:40][None]
    cu = torch.tensor([0, 1, 9, 9, 25, 40])
    packed = ref(ids, [cu])
    for a, b in zip(cu.tolist(), cu[1:].tolist()):
        if b > a:
            alone = ref(ids[:, a:b])
            assert rel(packed[:, a:b], alone) < 1e-12, (a, b)
    assert rel(ref(ids, [torch.tensor([0, 40])]), ref(ids)) < 1e-12    # one document: the plain model


def test_rope_positions_restart_in_every_document():
    from distlab.model.llama import document_positions

    got = document_positions([torch.tensor([0, 1, 4, 4, 7])], 7)[0].tolist()
    assert got == [0, 0, 1, 2, 0, 1, 2]
    shard = torch.tensor([5, 6, 0, 1])                      # a CP piece's global positions
    assert document_positions([torch.tensor([0, 3, 7])], 7, shard)[0].tolist() == [2, 3, 0, 1]
