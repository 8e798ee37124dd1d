"""Ring attention (contiguous and zigzag) on real gloo process groups against one-device attention.

The reference is whole-matrix float64 attention through autograd (``attention_reference``), a different
code path from the blockwise kernels the ring uses. The ring runs in float32, so its relative error
against float64 is ~1e-7; the bar of 1e-5 would catch any wrong mask (a block seen twice or not at all
moves the output by O(1/seq)), a lost LSE term, or a dK/dV accumulator that comes home short one hop.
"""

import time

import pytest
import torch

from distlab import comm
from distlab.cp.layout import gather_sequence, shard_sequence
from distlab.cp.ring import check_steps_per_launch, ring_attention
from distlab.cp.ring_dkv_direct import direct_bytes
from distlab.kernels.attention import attention_reference

WORLDS = [1, 2, 3, 4, 8]
SEQ = 48  # divisible by 2W for every W above, so zigzag runs everywhere


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _inputs(batch, seq, heads, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, heads, head_dim, generator=g, dtype=torch.float64)
    return q, k, v, dout


def ring_vs_one_device(heads, kv_heads, causal, layout, dtype=torch.float32, seq=SEQ, batch=2, head_dim=8,
                       backend="auto", steps_per_launch=None, seed=0, dkv_route="ring"):
    """Runs on every rank: ring attention on shards vs float64 attention on the full tensors."""
    q, k, v, dout = _inputs(batch, seq, heads, kv_heads, head_dim, seed)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want_out = attention_reference(*full, causal=causal)
    want_out.backward(dout)
    want = [want_out.detach()] + [t.grad for t in full]

    local = [shard_sequence(t.to(dtype), None, layout).requires_grad_(True) for t in (q, k, v)]
    with comm.CommLog() as log_fwd:
        out = ring_attention(*local, causal=causal, layout=layout, backend=backend, steps_per_launch=steps_per_launch,
                             dkv_route=dkv_route)
    with comm.CommLog() as log_bwd:
        out.backward(shard_sequence(dout.to(dtype), None, layout))
    got = [gather_sequence(t, None, layout) for t in (out.detach(), *(x.grad for x in local))]
    kv_bytes = 2 * local[1].numel() * local[1].element_size()
    return {"errors": {n: rel_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)},
            "dtypes": [str(t.dtype) for t in (out, *(x.grad for x in local))],
            "fwd_calls": dict(log_fwd.calls), "bwd_calls": dict(log_bwd.calls),
            "fwd_bytes": dict(log_fwd.bytes), "bwd_bytes": dict(log_bwd.bytes), "kv_bytes": kv_bytes}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_ring_matches_one_device(pools, world, layout, causal, heads, kv_heads):
    for rank, res in enumerate(pools(world).run(ring_vs_one_device, heads, kv_heads, causal, layout)):
        for name, err in res["errors"].items():
            assert err < 1e-5, f"rank {rank}: {name} rel err {err:.2e} (W={world} {layout} causal={causal})"
        assert res["dtypes"] == ["torch.float32"] * 4
        # the design's communication: W-1 K/V hops forward; W-1 K/V hops + W dK/dV hops backward
        hops = {} if world == 1 else {"ring_kv": world - 1}
        assert res["fwd_calls"] == hops
        assert res["bwd_calls"] == ({} if world == 1 else {"ring_kv": world - 1, "ring_dkv": world})
        assert res["fwd_bytes"] == ({} if world == 1 else {"ring_kv": (world - 1) * res["kv_bytes"]})


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_with_several_blocks_in_flight_matches_one_device(pools, world, layout, causal):
    """Steps in groups, the next groups' K/V forwarded as soon as they arrive: ``steps_per_launch=2``
    (W=4: 0 | 1 | 2 3, two exchanges in flight) and one group of every step (all W−1 exchanges posted
    before anything is computed). Same answer, same W−1 hops and bytes. Batch 1: each step's K/V received
    straight into the fused blocks' buffers (``ring_landing``); batch 2: concatenated (its chunks are not
    contiguous)."""
    for n, batch in ((2, 1), ((world,), 1), ((world,), 2)):
        for rank, res in enumerate(pools(world).run(ring_vs_one_device, 4, 2, causal, layout, steps_per_launch=n,
                                                    batch=batch)):
            for name, err in res["errors"].items():
                assert err < 1e-5, \
                    f"rank {rank}: {name} rel err {err:.2e} (W={world} {layout} causal={causal} {n} B{batch})"
            assert res["fwd_calls"] == {"ring_kv": world - 1}
            assert res["fwd_bytes"] == {"ring_kv": (world - 1) * res["kv_bytes"]}
            assert res["bwd_calls"] == {"ring_kv": world - 1, "ring_dkv": world}   # the backward by groups too


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_with_dkv_sent_straight_to_their_owners_matches_one_device(pools, world, layout, causal):
    """``dkv_route="direct"`` (``distlab.cp.ring_dkv_direct``): K/V still travel the ring, but each step's dK/dV
    share goes straight to the rank that owns those keys, in the shares' dtype, and the owner sums them once.
    Same answer; no ``ring_dkv`` hop; at most W − 1 sends a rank of at most one shard's K/V bytes each
    (a causal zigzag step's share is half a shard or a whole one). Groups of 2 and of every step, batch 1
    (the shares sent as they are) and 2 (strided shares, copied to send)."""
    for n, batch in ((2 if world > 2 else (world,), 1), ((world,), 2)):   # W=2: 0 | 1 would not be fused
        for rank, res in enumerate(pools(world).run(ring_vs_one_device, 4, 2, causal, layout, steps_per_launch=n,
                                                    batch=batch, backend="torch", dkv_route="direct")):
            for name, err in res["errors"].items():
                assert err < 1e-5, \
                    f"rank {rank}: {name} rel err {err:.2e} (W={world} {layout} causal={causal} {n} B{batch})"
            assert res["fwd_calls"] == {"ring_kv": world - 1}
            assert set(res["bwd_calls"]) == {"ring_kv", "ring_dkv_direct"}
            assert res["bwd_calls"]["ring_kv"] == world - 1
            assert 1 <= res["bwd_calls"]["ring_dkv_direct"] <= world - 1
            assert res["bwd_bytes"]["ring_dkv_direct"] <= (world - 1) * res["kv_bytes"]
            assert res["bwd_bytes"]["ring_dkv_direct"] == direct_bytes(   # the study's model, exact
                rank, world, SEQ // world, causal, layout, check_steps_per_launch(n, "torch", world), batch, 2, 8, 4)
            if layout == "zigzag" or not causal:   # every rank sends a share every step after the first
                assert res["bwd_calls"]["ring_dkv_direct"] == world - 1
                lo = (world - 1) * res["kv_bytes"] // (2 if causal else 1)
                assert res["bwd_bytes"]["ring_dkv_direct"] >= lo


def _direct_refused(backend, steps_per_launch, route="direct"):
    q = torch.zeros(1, 8, 2, 4)
    try:
        ring_attention(q, q, q, causal=True, backend=backend, steps_per_launch=steps_per_launch, dkv_route=route)
    except ValueError as e:
        return str(e)
    return None


def test_ring_dkv_route_is_checked_on_every_rank_before_any_exchange(pools):
    """A route name that does not exist, and ``direct`` where the backward is not the fused one (one step a
    launch; Triton's too), raise the same ValueError on every rank before the forward's first exchange."""
    for args, match in ((("torch", 2, "sideways"), "one of ring, direct"),
                        (("torch", 1), "needs the fused ring backward"),
                        (("torch", (1, 1)), "needs the fused ring backward")):
        for msg in pools(2).run(_direct_refused, *args):
            assert msg is not None and match in msg, msg


def test_ring_with_a_launch_group_of_more_than_four_steps_matches_one_device(pools):
    """A backend whose launch group is fused into one call (here ``torch``; FA4 and cuDNN on a GPU) takes groups
    of any size (W=6: 0 | 1 2 3 4 5, 0 | 1 | 2 3 4 5, every step in one group; on the GPU, W=8, 1|2|5 fills
    FA4's backward waves better than 1|3|4); Triton's launch takes at most four steps."""
    from distlab.cp.ring import check_steps_per_launch

    assert check_steps_per_launch("1,5", "torch", 6) == (1, 5)
    with pytest.raises(ValueError, match="at most 4 a group for triton"):
        check_steps_per_launch("1,5", "triton", 6)
    for layout, causal, n in (("zigzag", True, (1, 5)), ("contiguous", True, (1, 1, 4)), ("zigzag", False, (6,))):
        for rank, res in enumerate(pools(6).run(ring_vs_one_device, 4, 2, causal, layout, steps_per_launch=n,
                                                backend="torch")):
            for name, err in res["errors"].items():
                assert err < 1e-5, f"rank {rank}: {name} rel err {err:.2e} ({layout} causal={causal} {n})"
            assert res["bwd_calls"] == {"ring_kv": 5, "ring_dkv": 6}


def ring_passes_on_kept_landing_buffers(layout):
    """Runs on every rank: three ring passes (forward and backward) of one shape on other inputs each, K/V
    landing in the buffers kept for that shape (``ring_landing.kv_landing``): each pass's errors, the kept
    buffers' addresses after each, and what releasing them frees."""
    from distlab.cp import ring_landing

    ring_landing.release_landing_buffers()
    errors, kept = [], []
    for seed in (1, 2, 3):
        res = ring_vs_one_device(4, 2, True, layout, batch=1, steps_per_launch=2, seed=seed)
        errors.append(res["errors"])
        kept.append(sorted(b.data_ptr() for landing in ring_landing._KEPT.values() for b in landing.buffers))
    return {"errors": errors, "kept": kept, "freed": ring_landing.release_landing_buffers(),
            "left": len(ring_landing._KEPT)}


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_passes_reuse_their_landing_buffers(pools, world, layout):
    """A ring shape's landing buffers are made once and kept (``ring_landing.kv_landing``): the second and
    third passes of one shape, on other K/V, receive into the same memory as the first (forward and backward
    share them) and still match one device — nothing of an earlier pass is read; releasing them frees
    their bytes."""
    for rank, res in enumerate(pools(world).run(ring_passes_on_kept_landing_buffers, layout)):
        for i, errors in enumerate(res["errors"]):
            for name, err in errors.items():
                assert err < 1e-5, f"rank {rank}, pass {i}: {name} rel err {err:.2e} (W={world} {layout})"
        assert res["kept"][0] and res["kept"][0] == res["kept"][1] == res["kept"][2], (rank, res["kept"])
        assert res["freed"] > 0 and res["left"] == 0


def test_fuse_plan_joins_a_groups_blocks_over_one_row_range():
    """Backends with no in-kernel accumulation compute a launch group's blocks over the same rows as one block
    over their keys (``fuse_plan``): zigzag W=8 in groups of 4 is three calls on every rank (step 0; the steps
    whose keys come from earlier ranks; those from later ranks), the keys of each step in step order."""
    from distlab.cp.ring import group_plans

    for rank in range(8):
        plans = group_plans(rank, 8, 64, True, "zigzag", 4)
        calls = [(rows, causal, [(step, (c.start, c.stop)) for step, c in pieces])
                 for steps, plan in plans for rows, causal, pieces in plan]
        assert calls[0] == (slice(0, 64), True, [(0, (0, 64))])
        want = [(slice(0, 64), False, [(s, (0, 32))]) if (rank - s) % 8 < rank else
                (slice(32, 64), False, [(s, (0, 64))]) for s in range(1, 8)]
        fused = []
        for steps in ([1, 2, 3], [4, 5, 6, 7]):
            for rows, causal, pieces in [w for w in want if w[2][0][0] in steps]:
                if fused and fused[-1][0] == rows and fused[-1][2][-1][0] in steps:
                    fused[-1][2].extend(pieces)
                else:
                    fused.append((rows, causal, list(pieces)))
        assert calls[1:] == fused, (rank, calls)
        assert len(calls) <= 4 and (rank not in (0, 3, 7) or len(calls) == 3)
    # a cap on a fused block's keys (DISTLAB_RING_FUSE_MAX_KEYS) cuts the runs: rank 0's later steps in pairs
    from distlab import knobs
    from distlab.cp.ring import fuse_cap

    with knobs.override(RING_FUSE_MAX_KEYS="lots"), pytest.raises(ValueError, match="RING_FUSE_MAX_KEYS"):
        fuse_cap()
    plans = group_plans(0, 8, 64, True, "zigzag", 4, 128)
    assert [[s for s, _ in p] for _, plan in plans for _, _, p in plan] == [[0], [1, 2], [3], [4, 5], [6, 7]]
    # contiguous, causal: the last rank sees every earlier block whole; one group of all steps is two calls
    plans = group_plans(3, 4, 16, True, "contiguous", (4,))
    assert [[(s, (c.start, c.stop)) for s, c in p] for _, plan in plans for _, _, p in plan] == \
        [[(0, (0, 16))], [(1, (0, 16)), (2, (0, 16)), (3, (0, 16))]]


def test_ring_steps_per_launch_is_checked(monkeypatch):
    from distlab.cp.ring import check_steps_per_launch, launch_groups

    assert check_steps_per_launch(2) == 2 and check_steps_per_launch(1, "triton") == 1
    assert check_steps_per_launch(None, "triton") == 4 and check_steps_per_launch(None, "torch") == 1
    assert check_steps_per_launch("1,1,2,4", None, 8) == (1, 1, 2, 4) and check_steps_per_launch((3,), None, 3) == (3,)
    monkeypatch.setenv("DISTLAB_RING_STEPS_PER_LAUNCH", "1")   # the library never reads the knob: the studies do
    assert check_steps_per_launch(None, "triton") == 4
    for bad, world in ((5, None), (0, None), ("two", None), ((2, 2), 3), ((5, 3), 8), ((3,), 4)):
        with pytest.raises(ValueError, match="an integer from 1 to 4, or group sizes"):
            check_steps_per_launch(bad, None, world)
    # step 0 (local K/V) alone, then groups of n, the short one first
    assert [list(g) for g in launch_groups(8, 2)] == [[0], [1], [2, 3], [4, 5], [6, 7]]
    assert [list(g) for g in launch_groups(8, 4)] == [[0], [1, 2, 3], [4, 5, 6, 7]]
    assert [list(g) for g in launch_groups(3, 2)] == [[0], [1, 2]] and launch_groups(1, 4) == [range(1)]
    assert [list(g) for g in launch_groups(4, (2, 2))] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="do not add up"):   # never a ring that skips its last steps
        launch_groups(4, (3,))


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_float64_is_exact_to_rounding(pools, world, layout):
    """In float64 the only difference from the reference is summation order: ~1e-15, not 1e-7."""
    for res in pools(world).run(ring_vs_one_device, 4, 2, True, layout, torch.float64):
        assert max(res["errors"].values()) < 1e-12, res["errors"]


def _with_knobs(values, fn, *args, **kwargs):
    """``fn`` on a worker with these knobs in force (``knobs.override``: a worker reads its environment once,
    at its first knob, so setting ``os.environ`` between cases changed nothing), and what was in force
    checked from inside."""
    from distlab import knobs

    with knobs.override(**values):
        assert all(knobs.get(k) == v for k, v in values.items())
        return fn(*args, **kwargs)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_with_the_triton_kernels_matches_one_device(interpreted_pools, world):
    """The ``triton`` backend's ring path (in-kernel accumulation forward, dQ added and dK/dV written in
    float32 by the backward kernels, the backward rows computed once) on real gloo ranks, the kernels run
    by Triton's CPU interpreter (switched on in the workers before they define the kernels)."""
    pool = interpreted_pools(world)
    # dQ from its own kernel (added in place), or added by the dK/dV kernel's atomics into the ring's dQ
    # several ring steps per forward launch (with 64-row shards zigzag's half blocks start on a query
    # tile): all W steps in one launch (W blocks), or the first two (a pair, then single steps)
    # dK/dV per kv head (split 0) or summed from per-q-head partials straight into the received accumulator
    # (W=3, the odd world, runs the cases marked True: both layouts, a split, every step in one launch, a pair
    # of steps then single steps)
    cases = [(True, "zigzag", True, (4, 2), "kernel", "0", 1, 24),
             (False, "contiguous", True, (4, 4), "kernel", "0", 1, 24),
             (True, "contiguous", False, (4, 2), "kernel", "1", 1, 24),
             (False, "zigzag", True, (4, 2), "atomic", "1", 1, 24),
             (True, "zigzag", True, (4, 2), "kernel", "0", (world,), 64),
             (True, "contiguous", False, (2, 1), "kernel", "0", (2,) + (1,) * (world - 2), 32)]
    for layout, causal, (heads, kv_heads), dq_mode, split, n, shard in (c[1:] for c in cases if world == 2 or c[0]):
        case = f"W={world} {layout} causal={causal} dq {dq_mode} split {split} steps/launch {n}"
        # split partials summed by the dQ kernel's programs (the default; kernel_checks.py also checks the
        # separate summing launch, SPLIT_SUM=kernel, against the reference)
        values = {"TRITON_ATTN_DQ_MODE": dq_mode, "TRITON_ATTN_SPLIT_GROUPS": split}
        for rank, res in enumerate(pool.run(_with_knobs, values,
                                            ring_vs_one_device, heads, kv_heads, causal, layout, seq=shard * world,
                                            head_dim=16, backend="triton", steps_per_launch=n)):
            for name, err in res["errors"].items():
                assert err < 1e-5, f"rank {rank}: {name} rel err {err:.2e} ({case})"
            assert res["bwd_calls"] == {"ring_kv": world - 1, "ring_dkv": world}


def test_ring_merging_block_results_four_at_a_time_matches_one_device(interpreted_pools):
    """A backend that cannot accumulate (here ``torch``; cuDNN and FA4 on a GPU) holds its block results back
    and merges them four at a time in one Triton launch, the last merge writing q's dtype
    (``lse_merge_blocks_``, run by Triton's CPU interpreter): on W=5 real gloo ranks (five blocks: two
    merges), both layouts, causal and not, GQA, one and two steps a group."""
    world = 5
    pool = interpreted_pools(world)
    # merged 4 + 1 (the default), 3 + 2, or one lse_merge_ per block (0: the schedule before)
    for layout, causal, n, group in (("zigzag", True, 1, "4"), ("contiguous", True, 2, "4"),
                                     ("zigzag", False, 1, "4"), ("zigzag", True, 2, "3"), ("zigzag", True, 1, "0")):
        for rank, res in enumerate(pool.run(_with_knobs, {"RING_MERGE_BLOCKS": group}, ring_vs_one_device, 4, 2,
                                            causal, layout, seq=16 * world, head_dim=16, backend="torch",
                                            steps_per_launch=n)):
            for name, err in res["errors"].items():
                assert err < 1e-5, f"rank {rank}: {name} {err:.2e} ({layout} causal={causal} n={n} {group})"
            assert res["dtypes"] == ["torch.float32"] * 4


def _early_merges_counted(*args, **kwargs):
    """``ring_vs_one_device`` with ``RING_MERGE_EARLY=1``, counting the passes that ended with the early merge's
    last step (``distlab.cp.ring_merge_early.merge_last``)."""
    from distlab import knobs
    from distlab.cp import ring_merge_early

    real, ran = ring_merge_early.merge_last, [0]

    def counted(*a):
        ran[0] += 1
        return real(*a)
    ring_merge_early.merge_last = counted
    try:
        with knobs.override(RING_MERGE_EARLY="1"):
            return ring_vs_one_device(*args, **kwargs), ran[0]
    finally:
        ring_merge_early.merge_last = real


def test_ring_forward_merging_early_beside_the_last_block_matches_one_device(interpreted_pools):
    """``RING_MERGE_EARLY=1`` (``distlab.cp.ring_merge_early``): where a rank's last block covers its shard's second
    half, the earlier blocks are merged before it (first half final, second half into a float32 running
    result) and the last block after — on W=5 real gloo ranks (the Triton merge on the CPU's interpreter),
    zigzag causal step by step (ranks 0-3 take it: their last block is a later rank's, the second half's rows;
    rank 4's last covers every row) and by groups of two, GQA; contiguous never takes it."""
    pool = interpreted_pools(5)
    for layout, n, takes in (("zigzag", 1, [1, 1, 1, 1, 0]), ("zigzag", 2, None), ("contiguous", 1, [0] * 5)):
        for rank, (res, ran) in enumerate(pool.run(_early_merges_counted, 4, 2, True, layout, seq=16 * 5,
                                                   head_dim=16, backend="torch", steps_per_launch=n)):
            for name, err in res["errors"].items():
                assert err < 1e-5, f"rank {rank}: {name} {err:.2e} ({layout} n={n})"
            if takes is not None:
                assert ran == takes[rank], (layout, n, rank, ran)


def post_and_compute_order(world_causal, steps_per_launch=1):
    """Record the order of K/V exchange posts and block computes inside one forward."""
    import distlab.cp.ring as ring_mod

    events = []
    real_forward, real_record = ring_mod.attention_forward, comm.record

    def forward(*a, **kw):
        events.append("compute")
        return real_forward(*a, **kw)

    def record(op, nbytes):
        events.append("post")
        real_record(op, nbytes)

    ring_mod.attention_forward, comm.record = forward, record
    try:
        q, k, v, _ = _inputs(1, 12, 2, 2, 4)
        local = [shard_sequence(t.float(), None, "contiguous") for t in (q, k, v)]
        ring_attention(*local, causal=world_causal, steps_per_launch=steps_per_launch)
    finally:
        ring_mod.attention_forward, comm.record = real_forward, real_record
    return events


def test_ring_posts_next_exchange_before_computing(pools):
    """Overlap by construction: each step posts the next K/V hop, then computes the block it holds."""
    events = pools(3).run(post_and_compute_order, False)
    assert all(e == ["post", "compute", "post", "compute", "compute"] for e in events), events
    # two blocks in flight: both hops are posted before the first pair of steps computes; the pair (same
    # rows, not causal) is one block over both steps' keys (``fuse_plan``: backends without in-kernel accumulation)
    events = pools(3).run(post_and_compute_order, False, 2)
    assert all(e == ["post", "post", "compute", "compute"] for e in events), events


def test_causal_contiguous_skips_masked_blocks(pools):
    events = pools(3).run(post_and_compute_order, True)
    # rank r computes r+1 blocks (its own and the earlier ranks'); later ranks' blocks are skipped
    assert [e.count("compute") for e in events] == [1, 2, 3]
    assert all(e.count("post") == 2 for e in events)


# ------------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------------
def layout_roundtrip(layout):
    x = torch.arange(2 * 24 * 3, dtype=torch.float64).view(2, 24, 3)
    local = shard_sequence(x, None, layout)
    back = gather_sequence(local, None, layout)
    positions = local[0, :, 0].long().div(3, rounding_mode="floor").tolist()
    return torch.equal(back, x), positions


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layouts_shard_and_gather_back(pools, world):
    for layout in ("contiguous", "zigzag"):
        res = pools(world).run(layout_roundtrip, layout)
        for rank, (same, positions) in enumerate(res):
            assert same
            if layout == "contiguous":
                n = 24 // world
                assert positions == list(range(rank * n, (rank + 1) * n))
            else:
                c = 24 // (2 * world)
                late = 2 * world - 1 - rank
                assert positions == list(range(rank * c, (rank + 1) * c)) + list(range(late * c, (late + 1) * c))


# ------------------------------------------------------------------------------------------------------
# invalid input: refused on every rank, before any collective, in seconds
# ------------------------------------------------------------------------------------------------------
def bad_call(case):
    q, k, v, _ = _inputs(1, 24, 4, 2, 8)
    q, k, v = q.float(), k.float(), v.float()
    if case == "seq_not_divisible":
        return shard_sequence(q[:, :23], None, "contiguous")
    if case == "seq_not_divisible_zigzag":
        return shard_sequence(q[:, :18], None, "zigzag")
    if case == "heads_not_multiple":
        return ring_attention(q[:, :, :3], k, v)
    if case == "kv_shapes_differ":
        return ring_attention(q, k, v[:, :, :1])
    if case == "dtypes_differ":
        return ring_attention(q, k.double(), v)
    if case == "q_k_lengths_differ":
        return ring_attention(q, k[:, :12], v[:, :12])
    if case == "odd_zigzag_shard":
        return ring_attention(q[:, :5], k[:, :5], v[:, :5], layout="zigzag")
    if case == "unknown_backend":
        return ring_attention(q, k, v, backend="magic")
    if case == "unknown_layout":
        return ring_attention(q, k, v, layout="spiral")
    if case == "backend_missing_here":
        return ring_attention(q, k, v, backend="sdpa-cudnn")
    raise AssertionError(case)


BAD = {"seq_not_divisible": "not divisible by", "seq_not_divisible_zigzag": "not divisible by",
       "heads_not_multiple": "multiple of kv heads", "kv_shapes_differ": "same shape",
       "dtypes_differ": "share a dtype", "q_k_lengths_differ": "one length", "odd_zigzag_shard": "even",
       "unknown_backend": "unknown attention backend", "unknown_layout": "unknown sequence layout",
       "backend_missing_here": "cannot run"}


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_refused_on_every_rank(pools, world, case):
    if case == "seq_not_divisible_zigzag" and world == 3:
        pytest.skip("18 is divisible by 2*3")
    if case == "backend_missing_here" and torch.cuda.is_available():
        pytest.skip("cuDNN is present on this machine")
    pool = pools(world)
    start = time.monotonic()
    outcome = pool.run_all(bad_call, case, timeout_s=30)
    assert time.monotonic() - start < 10
    for rank, (ok, msg) in enumerate(outcome):
        assert not ok, f"rank {rank} accepted {case}"
        assert msg.startswith("ValueError") and BAD[case] in msg, msg
    # the group is still healthy afterwards: a collective completes on every rank
    assert pool.run(comm.group_size) == [world] * world


def test_final_rows_marks_each_rows_last_block():
    """The rows a ring block writes as final (in q's dtype) are those no later block of the rank's schedule
    touches: every row exactly once, at its last block (zigzag rank r: the first chunk at step r, the
    second at the last step). A row marked too early would lose later blocks' keys."""
    from distlab.cp.ring import final_rows, ring_blocks

    s = 8
    for layout in ("zigzag", "contiguous"):
        for world in (1, 3, 4):
            for rank in range(world):
                sched = [ring_blocks((rank - i) % world, rank, s, True, layout) for i in range(world)]
                done = []
                for i, blocks in enumerate(sched):
                    for j, (rows, _, _) in enumerate(blocks):
                        lo, hi = final_rows(sched, i, j)
                        mine = list(range(rows.start + lo, rows.start + hi))
                        later = {r for ii, bb in enumerate(sched) for jj, (rr, _, _) in enumerate(bb)
                                 if (ii, jj) > (i, j) for r in range(rr.start, rr.stop)}
                        assert not set(mine) & later, (layout, world, rank, i)
                        done += mine
                assert sorted(done) == list(range(s)), (layout, world, rank, done)


def test_auto_picks_the_ring_block_backend_by_shard_length():
    """``auto`` in a ring: FA4 (the fastest single call) for long shards, the Triton kernel for shards of at
    most RING_TRITON_MAX_SHARD tokens (host-bound there, docs/PERF.md); an explicit choice is kept."""
    from distlab.cp.ring import RING_TRITON_MAX_SHARD, pick_ring_backend

    present = ["fa4", "sdpa-cudnn", "triton", "torch"]
    assert pick_ring_backend("auto", "fa4", RING_TRITON_MAX_SHARD, present) == "triton"
    assert pick_ring_backend("auto", "fa4", RING_TRITON_MAX_SHARD + 2, present) == "fa4"
    assert pick_ring_backend("auto", "fa4", 2048, present) == "fa4"   # H100: fa4 2.12 vs triton 2.77 ms f+b
    assert pick_ring_backend("fa4", "fa4", 512, present) == "fa4"
    assert pick_ring_backend("auto", "fa4", 512, ["fa4", "torch"]) == "fa4"
    assert pick_ring_backend("auto", "sdpa-cudnn", 512, present) == "sdpa-cudnn"
    assert pick_ring_backend("auto", "torch", 512, ["torch"]) == "torch"


def test_auto_under_a_mask_picks_fa4_and_the_packed_ring_keeps_triton_for_balanced():
    """``auto`` with documents or a window: FA4's varlen path where present (H200: 3.3x the masked Triton
    kernel on a 64k pack), else the masked Triton kernel on CUDA, else torch's loop; a packed ring in the
    balanced layout keeps the Triton kernel (faster there, docs/PERF.md); an explicit choice is kept."""
    from distlab.cp.ring import pick_packed_ring_backend
    from distlab.kernels.attention import masked_auto

    assert masked_auto(["fa4", "triton", "torch"], "cuda") == "fa4"
    assert masked_auto(["triton", "torch"], "cuda") == "triton"
    assert masked_auto(["triton", "torch"], "cpu") == "torch"
    present = ["fa4", "triton", "torch"]
    assert pick_packed_ring_backend("auto", "fa4", "balanced", present) == "triton"
    assert pick_packed_ring_backend("auto", "fa4", "zigzag", present) == "fa4"
    assert pick_packed_ring_backend("fa4", "fa4", "balanced", present) == "fa4"
    assert pick_packed_ring_backend("auto", "fa4", "balanced", ["fa4", "torch"]) == "fa4"


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("zigzag", False)])
def test_every_row_is_final_in_exactly_one_backward_block(layout, causal):
    """``backward_schedule``: the rows whose final dQ a block's dQ kernel writes in q's dtype (none of the later
    blocks touch them) cover each row of every rank's shard exactly once, at W = 1, 3, 4 and 8."""
    from distlab.cp.ring import backward_schedule

    seq = 16
    for world in (1, 3, 4, 8):
        for rank in range(world):
            seen = torch.zeros(seq, dtype=torch.int64)
            last = {}
            for step, blocks in enumerate(backward_schedule(rank, world, seq, causal, layout)):
                for rows, _, _, (lo, hi) in blocks:
                    assert 0 <= lo <= hi <= rows.stop - rows.start
                    seen[rows.start + lo:rows.start + hi] += 1
                    for r in range(rows.start, rows.stop):
                        last[r] = (step, r - rows.start < hi and r - rows.start >= lo)
            assert seen.tolist() == [1] * seq, (world, rank, seen.tolist())
            assert all(final for _, final in last.values()), (world, rank)   # final in the last block touching it
