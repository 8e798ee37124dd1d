"""The ring forward on FA4 blocks with the blocks' outputs kept and the merges bound per ring shape
(``distlab.cp.ring_kept``), on real gloo ranks, against one-device float64 attention.

On the CPU FA4 is a stand-in (``distlab.testing.install_fa4_stand_in``: FA4's interface and compile cache,
its "compiled kernel" the ``torch`` backend), so what runs is distlab's own code: the recording of the compiled
kernel (``distlab.kernels.fa4``), its replay into the kept outputs, and the merges bound to them
(``lse_merge.bind_merge_blocks``, Triton's CPU interpreter). Several passes of one shape on new inputs each:
the first records, the later ones replay into the same tensors — a pass that read an earlier pass's block
results, or a merge bound to the wrong tensors, would be off by O(1). The real FA4 kernels: the GPU tests
(``tests/test_attention_kernels.py``, ``tests/test_fa4_ring_backward.py``), which go through this path."""

from __future__ import annotations

import pytest
import torch

from distlab import comm
from distlab.cp.layout import gather_sequence, shard_sequence
from distlab.kernels.attention import attention_forward, attention_reference

WORLDS = (3, 4)


def kept_ring_passes(layout, causal, steps_per_launch, keep, seq, heads=4, kv_heads=2, dim=16, passes=3):
    """Runs on every rank: ``passes`` forwards of one ring shape (new inputs each) on FA4's stand-in with the
    knob ``RING_KEEP_OUTPUTS=keep``: each pass's errors of out and LSE against float64 attention, the
    stand-in's interface and kernel calls, the replays, and the kept plan's block outputs (ids per pass). Each
    pass's out and LSE then go through the ring's backward (``torch`` blocks): dq/dk/dv against float64
    autograd, so what the kept forward hands the backward is checked too."""
    from distlab import knobs
    from distlab.cp import ring_kept
    from distlab.cp.ring import _ring_backward, _ring_forward
    from distlab.kernels import fa4
    from distlab.testing import install_fa4_stand_in, remove_fa4_stand_in

    ring_kept.release_kept_forward()
    counts = install_fa4_stand_in()
    ring, scale = comm.RingExchanger(None), dim ** -0.5
    errors, kept_ids, calls, replayed = [], [], [], fa4.REPLAYED[0]
    try:
        with knobs.override(RING_KEEP_OUTPUTS=keep):
            for p in range(passes):
                g = torch.Generator().manual_seed(10 + p)
                q = torch.randn(1, seq, heads, dim, generator=g, dtype=torch.float64)
                k, v = (torch.randn(1, seq, kv_heads, dim, generator=g, dtype=torch.float64) for _ in range(2))
                dout = torch.randn(1, seq, heads, dim, generator=g, dtype=torch.float64)
                full = [t.clone().requires_grad_(True) for t in (q, k, v)]
                want = attention_reference(*full, causal=causal)
                want.backward(dout)
                want = want.detach()
                _, want_lse = attention_forward(q, k, v, causal, scale, backend="torch")
                local = [shard_sequence(t.float(), None, layout) for t in (q, k, v)]
                out, lse = _ring_forward(*local, ring, causal, layout, scale, "fa4", steps_per_launch)
                got = gather_sequence(out, None, layout).double()
                got_lse = gather_sequence(lse.transpose(1, 2), None, layout).transpose(1, 2).double()
                grads = _ring_backward(shard_sequence(dout.float(), None, layout), *local, out, lse, ring, causal,
                                       layout, scale, "torch", steps_per_launch)
                grad_err = max(((gather_sequence(a, None, layout).double() - t.grad).abs().max() / t.grad.abs().max())
                               .item() for a, t in zip(grads, full))
                errors.append(((got - want).abs().max().item(), (got_lse - want_lse).abs().max().item(),
                               str(out.dtype), grad_err))
                plan = next(iter(ring_kept._KEPT.values()), None)
                kept_ids.append(sorted(plan.kept) if plan else [])
                calls.append(counts["calls"])
        plan = next(iter(ring_kept._KEPT.values()), None)
        return {"errors": errors, "calls": dict(counts), "interface_calls": calls, "replayed": fa4.REPLAYED[0] - replayed,
                "kept_ids": kept_ids, "merges": len(plan.merges) if plan else 0, "bound": plan.bound if plan else 0,
                "freed": ring_kept.release_kept_forward(), "left": len(ring_kept._KEPT)}
    finally:
        remove_fa4_stand_in()


@pytest.mark.parametrize("world", WORLDS)
def test_ring_forward_on_kept_fa4_outputs_matches_one_device(interpreted_pools, world):
    """Kept outputs and bound merges: every pass matches float64 attention to float32 rounding, the later
    passes replay every block (no interface call after the first pass) into the same kept tensors, and
    releasing frees them. Zigzag causal in launch groups of W−1 (1 | W−1: fused blocks), contiguous non-causal
    one step a launch (W blocks, one merge)."""
    pool = interpreted_pools(world)
    for layout, causal, n in (("zigzag", True, (1, world - 1)), ("contiguous", False, 1)):
        case = f"W={world} {layout} causal={causal} groups {n}"
        for rank, res in enumerate(pool.run(kept_ring_passes, layout, causal, n, "1", 4 * world)):
            for p, (err, err_lse, dtype, grad_err) in enumerate(res["errors"]):
                assert err < 1e-5 and err_lse < 1e-5, f"rank {rank} pass {p}: {err:.2e} {err_lse:.2e} ({case})"
                assert grad_err < 1e-5, f"rank {rank} pass {p}: gradients {grad_err:.2e} ({case})"
                assert dtype == "torch.float32"
            per_pass = res["calls"]["kernel"] // 3
            assert res["calls"]["kernel"] == 3 * per_pass and per_pass >= 1, (res, case)
            first = res["interface_calls"][0]
            assert 1 <= first <= per_pass and res["interface_calls"] == [first] * 3, \
                f"rank {rank}: the later passes went through FA4's interface ({res}, {case})"
            assert res["replayed"] == res["calls"]["kernel"] - first, (res, case)
            assert res["bound"] == 2 * res["merges"], f"rank {rank}: a later pass's merge was not the bound one ({case})"
            assert res["kept_ids"][0] == res["kept_ids"][1] == res["kept_ids"][2] and len(res["kept_ids"][0]) == \
                2 * per_pass, (res, case)
            assert res["merges"] >= 1 and res["freed"] > 0 and res["left"] == 0, (res, case)


def test_ring_forward_with_more_merges_than_one_and_the_knob_off(interpreted_pools):
    """W=3 zigzag non-causal, one step a launch, two blocks a merge: three blocks, two merges (2 + 1), so the
    float32 running result is kept too; and with ``DISTLAB_RING_KEEP_OUTPUTS=0`` the plain path (FA4's own
    replay, fresh outputs, merges keyed each pass; nothing kept) gives the same answers."""
    pool = interpreted_pools(3)
    for keep in ("1", "0"):
        for rank, res in enumerate(pool.run(_with_merge_blocks, "2", kept_ring_passes, "zigzag", False, 1, keep, 12)):
            for p, (err, err_lse, _, grad_err) in enumerate(res["errors"]):
                assert err < 1e-5 and err_lse < 1e-5 and grad_err < 1e-5, \
                    f"rank {rank} pass {p} keep={keep}: {err:.2e} {err_lse:.2e} {grad_err:.2e}"
            if keep == "1":
                assert res["interface_calls"] == [1] * 3 and res["merges"] == 2, res
            else:
                assert res["merges"] == 0 and res["freed"] == 0 and res["kept_ids"] == [[]] * 3, res


def _with_merge_blocks(n, fn, *args):
    from distlab import knobs

    with knobs.override(RING_MERGE_BLOCKS=n):
        return fn(*args)


@pytest.mark.gpu
def test_kept_fa4_outputs_give_the_bits_of_plain_calls_on_a_gpu():
    """FA4's real kernels (sm90+, the fa4 extra): an emulated W=8 zigzag rank (launch groups 1 | 3 | 4, fused
    blocks, one merge of three) and a W=5 contiguous rank 4 one step a launch (five blocks: two merges), three passes on new
    inputs each, with the kept outputs and bound merges and with the knob off: the same bits every pass."""
    from distlab import knobs
    from distlab.cp import ring_kept
    from distlab.cp.emulate import ResidentRing
    from distlab.cp.ring import _ring_forward
    from distlab.kernels import fa4

    if not torch.cuda.is_available() or not fa4.runs_on(torch.device("cuda"), torch.bfloat16):
        pytest.skip("needs FA4 on an sm90+ GPU")
    for world, layout, causal, n, rank in ((8, "zigzag", True, (1, 3, 4), 0), (5, "contiguous", True, 1, 4)):
        ring_kept.release_kept_forward()
        for p in range(3):
            g = torch.Generator().manual_seed(p)
            q = torch.randn(1, 1024, 16, 128, generator=g).cuda().bfloat16()
            kv = [tuple(torch.randn(1, 1024, 4, 128, generator=g).cuda().bfloat16() for _ in range(2))
                  for _ in range(world)]
            runs = {}
            for keep in ("1", "0"):
                with knobs.override(RING_KEEP_OUTPUTS=keep):
                    out, lse = _ring_forward(q, *kv[0], ResidentRing(world, rank, kv), causal, layout, 128 ** -0.5,
                                             "fa4", n)
                    runs[keep] = (out.clone(), lse.clone())
            assert torch.equal(runs["1"][0], runs["0"][0]) and torch.equal(runs["1"][1], runs["0"][1]), \
                (world, layout, p)
        plan = next(iter(ring_kept._KEPT.values()))
        assert plan.bound == 2 * len(plan.merges) and plan.merges and all(plan.again.values()), (world, plan.again)


def test_kept_cache_builds_once_and_drops_the_least_recently_used():
    """``distlab.lru.kept`` (the ring's kept plans and the packed-document plans): a key is built once, a use
    moves it to the back, and beyond ``size`` the least recently used goes."""
    import collections

    from distlab.lru import kept

    cache, built = collections.OrderedDict(), []
    make = lambda name: (lambda: built.append(name) or name.upper())   # noqa: E731
    assert [kept(cache, n, make(n), 2) for n in ("a", "b", "a", "c")] == ["A", "B", "A", "C"]
    assert built == ["a", "b", "c"] and list(cache) == ["a", "c"]   # b, the least recently used, went
