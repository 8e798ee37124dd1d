"""The ring backward on FA4's kernels with its accumulators kept across steps (``distlab.kernels.fa4_ring_backward``).

On the CPU: the ring's bookkeeping (row sets, one dQ accumulator each, dK/dV scratch added into the travelling
accumulator by key ranges, the conversions at the end) on real gloo ranks, with FA4's five kernels replaced by
float64 stand-ins that keep FA4's contract (the preprocess writes delta and the base-2 LSE and zeroes dQ's
accumulator; the main kernel *adds* unscaled dQ/dK and dV into float32-layout accumulators ``(batch, heads,
keys * dim)``; the postprocess scales and converts). On a GPU with FA4: the real kernels against the float32
reference (``gpu`` marker)."""

from __future__ import annotations

import pytest
import torch

from distlab import comm
from distlab.cp.layout import gather_sequence, shard_sequence
from distlab.kernels.attention import attention_reference
from distlab.testing import ProcessGroupPool, fa4_pretended

LOG2E = 1.4426950408889634
PRE_CALLS = [0]   # the stand-in preprocess's runs in this process (a shared preprocess runs it once a ring)


def _heads_major(t):   # (b, s, h, d) -> (b, h, s * d), FA4's accumulator layout with no rounding
    return t.permute(0, 2, 1, 3).reshape(t.shape[0], t.shape[2], -1)


def _fake_record(batch, rows, cols, heads, kv_heads, dim, dtype, device, causal, scale):
    """FA4's preprocess, main kernel and postprocesses as float64 torch, with the argument lists the real
    recording yields. As FA4's, the per-row buffers are rounded up to the kernel's row tile (here 4 causal, 6
    not, as FA4's 64 and 80), the preprocess writes delta 0 and LSE +inf past the rows, and the main kernel
    reads the whole rounded rows (asserted: a shared preprocess must hand it the same)."""
    from distlab.kernels.attention import attention_backward

    padded = -(-rows // (4 if causal else 6)) * (4 if causal else 6)

    def pre(out, dout, dpsum, lse, lse_log2, dq_accum, *rest):
        assert dpsum.shape[-1] == lse_log2.shape[-1] == padded
        PRE_CALLS[0] += 1
        dpsum[..., :rows] = (out.double() * dout.double()).sum(-1).transpose(1, 2)
        lse_log2[..., :rows] = lse * LOG2E
        dpsum[..., rows:], lse_log2[..., rows:] = 0.0, float("inf")
        dq_accum.zero_()

    def main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_accum, dv_accum, sc, *rest):
        assert q.shape[1] == rows and lse_log2.shape[-1] == dpsum.shape[-1] == padded
        assert (dpsum[..., rows:] == 0).all() and (lse_log2[..., rows:] == float("inf")).all()
        lse, dpsum = lse_log2[..., :rows] / LOG2E, dpsum[..., :rows]
        # out enters a backward only through delta = rowsum(out·dO): rebuild an out with that row sum
        out = dout * (dpsum.transpose(1, 2) / (dout * dout).sum(-1)).unsqueeze(-1)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal, sc, backend="torch")
        dq_accum[..., :rows * dim] += _heads_major(dq) / sc
        if heads == kv_heads:   # MHA (a folded block): dK, dV written as they are, in q's dtype
            assert dk_accum.shape == dk.shape and dk_accum.dtype == q.dtype
            dk_accum.copy_(dk)
            dv_accum.copy_(dv)
            return
        dk_accum += _heads_major(dk) / sc
        dv_accum += _heads_major(dv)

    def post(accum, output, sc, *rest):
        b, s, h, d = output.shape
        output.copy_((accum[..., :s * d].reshape(b, h, s, d) * sc).transpose(1, 2))

    shapes = {"dpsum": (batch, heads, padded), "dq_accum": (batch, heads, padded * dim),
              "dkv_accum": (batch, kv_heads, cols * dim)}
    posts = [(post, (None, None, scale))] + ([] if heads == kv_heads else
                                             [(post, (None, None, scale)), (post, (None, None, 1.0))])
    return ((pre, (None,) * 6 + (None,) * 8), (main, (None,) * 9 + (scale, None)), posts, shapes)


def _ring_on_stand_ins(layout, causal, heads, kv_heads, seq, tile, steps_per_launch=1, cap="0", add_rows="0",
                       fold="1", route="ring", share="1", repeat=1, dq_fused="0", glue="0", dtype=torch.float64,
                       dkv_finish="0", fold_pre="0", pre_once="0", dq_early="0"):
    from distlab import knobs
    from distlab.cp.ring import _ring_backward, _ring_forward
    from distlab.kernels import fa4_ring_backward as frb

    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, seq, heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, seq, kv_heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    attention_reference(*full, causal=causal).backward(dout)
    local = [shard_sequence(t, None, layout).to(dtype) for t in (q, k, v, dout)]
    ring, scale = comm.RingExchanger(None), 8 ** -0.5
    saved = frb._record, frb.TILE, frb.FOLD_MIN_SHARD, frb.FOLD_MAX_ROWS
    frb._record, frb.TILE = _fake_record, tile
    frb._PREPARED.clear()   # what was worked out per ring shape came from the recorder swapped here
    if isinstance(fold, tuple):   # ("auto", the least shard that folds, the most rows a folded row set has)
        fold, frb.FOLD_MIN_SHARD, frb.FOLD_MAX_ROWS = fold
    made = []
    real = frb.FA4RingBackward
    frb.FA4RingBackward = lambda *a: made.append(real(*a)) or made[-1]
    PRE_CALLS[0] = 0
    try:
        with fa4_pretended(), knobs.override(RING_FUSE_MAX_KEYS=cap, RING_DKV_ADD_ROWS=add_rows, FA4_RING_FOLD=fold,
                                             FA4_RING_SHARE_PRE=share, FA4_RING_DQ_FUSED=dq_fused, FA4_RING_GLUE=glue,
                                             FA4_RING_DKV_FINISH=dkv_finish, FA4_RING_FOLD_PRE=fold_pre,
                                             FA4_RING_PRE_ONCE=pre_once, FA4_RING_DQ_EARLY=dq_early):
            out, lse = _ring_forward(*local[:3], ring, causal, layout, scale, "torch", steps_per_launch)
            runs = [_ring_backward(local[3], *local[:3], out, lse, ring, causal, layout, scale, "fa4",
                                   steps_per_launch, route) for _ in range(repeat)]
    finally:
        frb._record, frb.TILE, frb.FOLD_MIN_SHARD, frb.FOLD_MAX_ROWS = saved
        kept_plans = dict(frb._PREPARED)
        frb._PREPARED.clear()
        frb.FA4RingBackward = real
    errs, got = [0.0] * 3, None
    for grads in runs:   # a repeated backward on the same ring shape: its kept buffers zeroed again
        got = [gather_sequence(t, None, layout) for t in grads]
        errs = [max(e, ((a.double() - t.grad).abs().max() / t.grad.abs().max()).item())
                for e, a, t in zip(errs, got, full)]
    unfolded = [key for key, rs in made[0].sets.items() if not rs.fold] if made else []
    kept_bytes = 0
    if repeat > 1:   # what the shape kept, freed (the shared buffers: every unfolded set's accumulator and rows)
        frb._PREPARED.update(kept_plans)
        kept_bytes = frb.release_prepared()
    return {"errors": errs, "grads": got, "kept": len(made) // repeat, "row_sets": sorted(made[0].sets) if made else [],
            "folded": sorted(key for key, rs in made[0].sets.items() if rs.fold) if made else [],
            "preprocesses": PRE_CALLS[0] // repeat,
            "reused": all(made[0].sets[key].dq_accum.data_ptr() == made[-1].sets[key].dq_accum.data_ptr()
                          for key in unfolded),
            "kept_bytes": kept_bytes, "left": len(frb._PREPARED),
            "scratch": sum(len(views) for plan in kept_plans.values() for views in plan["scratch"].values()),
            "accum_bytes": sum(made[0].sets[k].dq_accum.numel() * 8 for k in unfolded) if made else 0}


def _ring_on_stand_ins_with(overrides, *args, **kwargs):
    """``_ring_on_stand_ins`` under knob ``overrides`` (a pool worker's process, where the caller's do not reach)."""
    from distlab import knobs

    with knobs.override(**overrides):
        return _ring_on_stand_ins(*args, **kwargs)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fa4_kept_accumulators_match_one_device_on_stand_in_kernels(world):
    """float64: dQ from one accumulator per row set (zigzag: all rows causal, all rows, the second half),
    dK/dV scratch added into the travelling accumulator by key range (zigzag's first-half keys), converted
    once at home: the one-device gradients to rounding, at W 1-4 (3: an odd ring). Also by launch groups
    (``distlab.cp.ring_fused``: a group's blocks over one row range fused, each step's dK/dV cut out of the
    fused scratch by key range): groups of 2, and one group of every step (step 0 fused with the others in the
    non-causal ring, so its accumulator starts as a slice), and with a cap of 16 keys a fused block (zigzag's
    8-key half blocks in pairs, the 16-key blocks alone); the shares added row by row (``RING_DKV_ADD_ROWS=1``)."""
    pool = ProcessGroupPool(world)
    try:
        cases = (("zigzag", True, 1, "0", "0"), ("contiguous", True, 1, "0", "0"), ("contiguous", False, 1, "0", "0"),
                 ("zigzag", True, 2, "0", "0"), ("contiguous", True, (world,), "0", "0"),
                 ("contiguous", False, (world,), "0", "0"), ("zigzag", False, (world,), "0", "0"),
                 ("zigzag", True, (world,), "16", "0"), ("zigzag", True, (world,), "0", "1"),
                 ("contiguous", True, (world,), "0", "1"))
        for (layout, causal, n, cap, rows), fold in [(c, "1") for c in cases] + [(c, "0") for c in cases[:8]]:
            results = pool.run(_ring_on_stand_ins, layout, causal, 4, 2, 16 * world, 4, n, cap, rows, fold)
            for res in results:
                assert res["kept"] == 1, "the fa4 ring backward did not take the kept-accumulator path"
                assert max(res["errors"]) < 1e-12, (layout, causal, n, fold, res)
                # folded: every row set of unmasked blocks (a causal ring's later steps; a non-causal ring's all)
                assert res["folded"] == (sorted(k for k in res["row_sets"] if not k[2]) if fold == "1" else []), res
                # one preprocess for the unfolded row sets (shared, FA4_RING_SHARE_PRE=1), one each folded set
                unfolded = len(res["row_sets"]) - len(res["folded"])
                assert res["preprocesses"] == len(res["folded"]) + min(unfolded, 1), res
            if layout == "zigzag" and causal and world > 2:   # a middle rank has all three row sets
                assert max(len(res["row_sets"]) for res in results) == 3, [r["row_sets"] for r in results]
            if fold == "1" and (world > 1 or not causal):
                assert any(res["folded"] for res in results), (layout, causal, n, results)
        # auto, at limits scaled to these shards (16 rows): the half-shard row sets folded, the whole-shard ones
        # not — in one ring, blocks of both kinds adding into the same (folded layout) accumulators
        for n, fold in ((1, ("auto", 16, 8)), (2, ("auto", 16, 8)), (2, "half")):   # half: auto's rule at any shard
            for res in pool.run(_ring_on_stand_ins, "zigzag", True, 4, 2, 16 * world, 4, n, "0", "0", fold):
                assert max(res["errors"]) < 1e-12, (n, res)
                assert res["folded"] == [k for k in res["row_sets"] if not k[2] and k[1] - k[0] <= 8], res
        # three backward passes on one ring shape: the shared preprocess's buffers made once, zeroed each time
        for res in pool.run(_ring_on_stand_ins, "zigzag", True, 4, 2, 16 * world, 4, 1, "0", "0", "0", repeat=3):
            assert max(res["errors"]) < 1e-12 and res["kept"] == 1, res
            assert res["preprocesses"] == 1 and (res["reused"] or len(res["row_sets"]) == 1), res
            if len(res["row_sets"]) > 1:   # released: at least the accumulators' bytes (float64 stand-ins), none left
                assert res["kept_bytes"] >= res["accum_bytes"] > 0 and res["left"] == 0, res
        # by launch groups: the later blocks' dK/dV scratch kept per ring shape and zeroed with the later
        # sets' dQ accumulators by one fill (the stand-in kernel adds into it: a stale buffer would show), three
        # backward passes; with the knob off none kept, the same gradients
        # folded too (the later folded blocks' dK/dV kept, written whole; the folded sets' preprocess buffers kept)
        for keep, fold in (("1", "0"), ("0", "0"), ("1", "1")):
            for res in pool.run(_ring_on_stand_ins_with, {"FA4_RING_KEEP_SCRATCH": keep}, "zigzag", True, 4, 2,
                                16 * world, 4, 2, "0", "0", fold, repeat=3):
                assert max(res["errors"]) < 1e-12 and res["kept"] == 1, res
                assert (res["scratch"] > 0) == (keep == "1" and world > 2), (keep, res)   # W 2: no fused group
        # the A/B knob: one preprocess a row set, the same gradients
        for layout, causal, n in (("zigzag", True, 1), ("contiguous", True, 2)):
            for res in pool.run(_ring_on_stand_ins, layout, causal, 4, 2, 16 * world, 4, n, "0", "0", "0",
                                share="0"):
                assert max(res["errors"]) < 1e-12 and res["preprocesses"] == len(res["row_sets"]), res
    finally:
        pool.close()


def test_fa4_kept_accumulators_in_a_launch_group_of_five_steps(pools):
    """float64 stand-ins, W=6: groups 0 | 1 2 3 4 5 (a fused group of five, as the GPU's W=8 1|2|5 has) and every
    step in one group: one-device gradients to rounding."""
    for layout, causal, n in (("zigzag", True, (1, 5)), ("contiguous", False, (1, 5)), ("zigzag", True, (6,))):
        for res in pools(6).run(_ring_on_stand_ins, layout, causal, 4, 2, 16 * 6, 4, n):
            assert res["kept"] == 1 and max(res["errors"]) < 1e-12, (layout, causal, n, res)


def _backward_error(steps_per_launch=1, record=None, knob=None):
    """The FA4 ring backward on stand-in shards (W = the pool's), FA4's recorder replaced by ``record`` (default:
    the stand-ins') and with ``knob`` = ``(name, value)`` in force: the RuntimeError or ValueError it raised (None)
    and what it posted."""
    from distlab import knobs
    from distlab.cp.ring import _ring_backward, _ring_forward
    from distlab.kernels import fa4_ring_backward as frb

    q, k = torch.randn(1, 16, 4, 8, dtype=torch.float64), torch.randn(1, 16, 2, 8, dtype=torch.float64)
    ring = comm.RingExchanger(None)
    out, lse = _ring_forward(q, k, k, ring, True, "zigzag", 0.3, "torch")
    saved = frb._record, frb.TILE
    frb._record, frb.TILE = record or _fake_record, 4
    frb._PREPARED.clear()
    try:
        with fa4_pretended(), knobs.override(**dict([knob] if knob else [])), comm.CommLog() as log:
            try:
                _ring_backward(q, q, k, k, out, lse, ring, True, "zigzag", 0.3, "fa4", steps_per_launch)
            except (RuntimeError, ValueError) as e:
                return str(e), dict(log.calls)
    finally:
        frb._record, frb.TILE = saved
        frb._PREPARED.clear()
    return None, dict(log.calls)


def _refuse_recording(*args):
    raise RuntimeError("FA4's backward did not run the kernels FA4RingBackward expects")


def test_fa4_ring_knob_typo_raises_on_every_rank_before_any_exchange(pools):
    """``FA4_RING_DQ_EARLY`` and ``FA4_RING_ZERO_BESIDE`` with a value they do not take: a ValueError naming the
    knob on every rank, nothing posted."""
    for name in ("FA4_RING_DQ_EARLY", "FA4_RING_ZERO_BESIDE"):
        for msg, calls in pools(3).run(_backward_error, knob=(name, "yes")):
            assert msg is not None and name in msg and calls == {}, (name, msg, calls)


def test_fa4_recording_refused_raises_on_every_rank_before_any_exchange(pools):
    """FA4's kernels are recorded for every block shape before the ring's first exchange: a recording that
    does not match (another FA4 version) is a RuntimeError on every rank with nothing posted, not a hang."""
    for n in (1, 2):   # step by step, and by fused launch groups (distlab.cp.ring_fused)
        for msg, calls in pools(3).run(_backward_error, n, _refuse_recording):
            assert msg is not None and "FA4RingBackward" in msg
            assert calls == {}, (n, calls)


def test_fa4_kept_path_steps_aside_where_it_does_not_apply(monkeypatch):
    """MHA (FA4 writes dK/dV directly), rows off FA4's tiles, no FA4, or the knob: the per-block path."""
    from distlab import knobs
    from distlab.kernels import fa4, fa4_ring_backward as frb

    q, k = torch.zeros(1, 256, 4, 8), torch.zeros(1, 256, 2, 8)
    blocks = [(slice(0, 256), slice(0, 128))]
    assert not frb.usable(q, k, blocks, torch.bfloat16)   # no FA4 on this machine
    monkeypatch.setattr(fa4, "runs_on", lambda device, dtype: True)
    assert frb.usable(q, k, blocks, torch.bfloat16)
    assert not frb.usable(q, torch.zeros(1, 256, 4, 8), blocks, torch.bfloat16)         # MHA
    assert not frb.usable(q, k, [(slice(0, 192), slice(0, 128))], torch.bfloat16)      # rows off the tiles
    with knobs.override(FA4_RING_ACCUM="0"):
        assert not frb.usable(q, k, blocks, torch.bfloat16)


def test_fa4_kept_dkv_sent_straight_to_their_owners_on_stand_in_kernels(pools):
    """``dkv_route="direct"`` on the FA4 kept path (float64 stand-ins): each block's dK/dV shares sent to their
    owners and summed there — folded (``(2, B, keys, Hkv, D)``, the causal blocks' converted), in FA4's
    accumulator layout (not folded: a fused block's key range strided, copied to be sent, the owner's sum
    converted by the postprocess), and a ring mixing both (``auto`` at limits scaled to these shards): the
    one-device gradients to rounding at W 2-4."""
    for world in (2, 3, 4):
        n = 2 if world > 2 else (world,)
        for layout, causal, fold in (("zigzag", True, "1"), ("contiguous", False, "1"), ("zigzag", True, "0"),
                                     ("contiguous", True, "0"), ("zigzag", True, ("auto", 16, 8))):
            for res in pools(world).run(_ring_on_stand_ins, layout, causal, 4, 2, 16 * world, 4, n, "0", "0", fold,
                                        "direct"):
                assert res["kept"] == 1, res
                assert max(res["errors"]) < 1e-12, (world, layout, causal, fold, res)
        # these workers serve later tests: pretending FA4 is present must not outlive the test
        assert pools(world).run(_auto_on_cpu) == [("torch", "torch")] * world


def _auto_on_cpu():
    """What ``auto`` resolves to for CPU float64 attention, plain and masked (``torch`` on any CPU machine)."""
    from distlab.kernels.attention import resolve_backend

    return tuple(resolve_backend("auto", "cpu", torch.float64, masked) for masked in (False, True))


def _ring_rank_on_fa4(seq, world, heads, kv_heads, layout, batch=1, steps_per_launch=1):
    """One W-rank ring's rank 0 (resident K/V, as ``distlab.cp.emulate``) on FA4 blocks, bf16, against the
    float32 reference on the same rows."""
    from distlab.cp.emulate import ResidentRing, rank_rows
    from distlab.cp.ring import _ring_backward, _ring_forward

    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(batch, seq, heads, 128, generator=g) for _ in range(2))
    k, v = (torch.randn(batch, seq, kv_heads, 128, generator=g) for _ in range(2))
    full = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    out_ref = attention_reference(*full, causal=True)
    errs = []
    for rank in range(world):
        shard = {r: rank_rows(r, world, seq, layout).cuda() for r in range(world)}
        d = torch.zeros_like(out_ref)
        d[:, shard[rank]] = dout.cuda()[:, shard[rank]]
        for t in full:
            t.grad = None
        out_ref.backward(d, retain_graph=True)
        kv = [(full[1].detach()[:, shard[(rank - i) % world]].bfloat16().contiguous(),
               full[2].detach()[:, shard[(rank - i) % world]].bfloat16().contiguous()) for i in range(world)]
        q_r = full[0].detach()[:, shard[rank]].bfloat16().contiguous()
        scale = 128 ** -0.5
        ring = ResidentRing(world, rank, kv)
        out, lse = _ring_forward(q_r, *kv[0], ring, True, layout, scale, "fa4", steps_per_launch)
        dq, dk, dv = _ring_backward(d[:, shard[rank]].bfloat16().contiguous(), q_r, *kv[0], out.bfloat16(), lse,
                                    ring, True, layout, scale, "fa4", steps_per_launch)
        # this rank's dQ is whole; dK/dV here are the accumulator that came home after W steps of a resident
        # ring: every step's block, i.e. the contributions of rank `rank`'s queries to each rank's keys summed
        # into one buffer; check dQ, and dK/dV against the reference's by the same sum
        want_dq = full[0].grad[:, shard[rank]]
        want_dk = sum(full[1].grad[:, shard[(rank - i) % world]] for i in range(world))
        want_dv = sum(full[2].grad[:, shard[(rank - i) % world]] for i in range(world))
        errs.append([((a.float() - b).abs().max() / b.abs().max()).item()
                     for a, b in ((out, out_ref.detach()[:, shard[rank]]), (dq, want_dq), (dk, want_dk),
                                  (dv, want_dv))])
    return errs


@pytest.mark.gpu
def test_fa4_ring_backward_on_fa4_kernels_matches_the_float32_reference():
    """FA4's real kernels (sm90+, the fa4 extra): every rank of a W=4 zigzag ring (three row sets), a W=2
    contiguous ring and a W=2 zigzag ring of batch 2 (row views strided by the batch), bf16 against float32,
    with the kept accumulators (unmasked blocks folded into MHA, and not; one preprocess for the unfolded row
    sets, and one each; the later sets' accumulators zeroed on the side stream; dQ finished in one Triton
    kernel, folded and not; a folding ring's glue in Triton, ``FA4_RING_GLUE=1``, and its unfolded blocks'
    scratch finished in one pass, ``FA4_RING_DKV_FINISH=1``) and without (the knobs); and the W=4
    zigzag ring by launch groups of 3
    (``distlab.cp.ring_fused``: 0 | 1 2 3, the later steps fused into one FA4 call per row range), and every
    rank of a W=8 zigzag ring by groups 1|2|5 (a fused group of five)."""
    from distlab import knobs
    from distlab.kernels import fa4

    if not torch.cuda.is_available() or not fa4.runs_on(torch.device("cuda"), torch.bfloat16):
        pytest.skip("needs FA4 on an sm90+ GPU")
    for layout, world, batch, n in (("zigzag", 4, 1, 1), ("contiguous", 2, 1, 1), ("zigzag", 2, 2, 1),
                                    ("zigzag", 4, 1, 3), ("contiguous", 4, 2, 3), ("zigzag", 8, 1, (1, 2, 5))):
        for accum, fold, share, beside, fused, glue, finish, fold_pre in (
                "11100000", "10100000", "10110000", "10000000", "01100000", "10101000", "11101000", "11101100",
                "11101110"):
            with knobs.override(FA4_RING_ACCUM=accum, FA4_RING_FOLD=fold, FA4_RING_SHARE_PRE=share,
                                FA4_RING_ZERO_BESIDE=beside, FA4_RING_DQ_FUSED=fused, FA4_RING_GLUE=glue,
                                FA4_RING_DKV_FINISH=finish, FA4_RING_FOLD_PRE=fold_pre):
                for rank, errs in enumerate(_ring_rank_on_fa4(2048, world, 8, 2, layout, batch, n)):
                    assert max(errs) < 2e-2, (layout, world, batch, n, accum, fold, share, beside, fused, glue,
                                              finish, fold_pre, rank, errs)


def test_early_points_of_the_w8_s32768_ring():
    """Where the early dQ finish and the early forward merge apply by default (``auto``: shards of 4096 rows or
    more): at S32768, W=8 zigzag by groups 1|3|4, ranks 0-6 end on their second half's row set (rows 2048-4096)
    and rank 7 on all its rows (neither applies); a 2048-row shard (S16384) is left alone."""
    from distlab.cp import ring_merge_early
    from distlab.cp.ring import group_plans
    from distlab.cp.ring_fused import _fused_blocks
    from distlab.kernels import fa4_ring_backward as frb

    for rank in range(8):
        point = frb._early_point(_fused_blocks(rank, 8, 4096, True, "zigzag", (1, 3, 4), 0, 128))
        rows = tuple((r.start, r.stop) for _, plan in group_plans(rank, 8, 4096, True, "zigzag", (1, 3, 4))
                     for r, _, _ in plan)
        merge = ring_merge_early.early_point(rows, 4096, 4)
        if rank == 7:
            assert point is None and merge is None
        else:
            assert point[2] == (2048, 4096, False) and merge == (len(rows) - 2, 2048), (rank, point, merge)
    assert ring_merge_early.wanted(torch.empty(1, 4096, 1, 1)) and not ring_merge_early.wanted(
        torch.empty(1, 2048, 1, 1))
    assert frb.DQ_EARLY_MIN_SHARD == ring_merge_early.MIN_SHARD == 4096
    from distlab import knobs

    for name, fn in (("FA4_RING_DQ_EARLY", lambda: frb._choice("FA4_RING_DQ_EARLY", ("0", "1", "auto"))),
                     ("RING_MERGE_EARLY", lambda: ring_merge_early.wanted(torch.empty(1, 4096, 1, 1)))):
        with knobs.override(**{name: "yes"}), pytest.raises(ValueError, match=name):
            fn()


def test_fa4_ring_fold_auto_folds_by_shard_length():
    """``FA4_RING_FOLD=auto``: a causal zigzag ring's shard of 4096 rows (S32768, W=8) folds every unmasked row
    set, its half (2048 rows) and whole (4096) ones, a shard of 2048 (S16384) its 1024-row half sets and not its
    2048-row ones (H100: folding those lost); not causal blocks, MHA, shards of 1024 (S8192: host-bound) or 8192
    (half sets of 4096 rows), contiguous or non-causal rings; ``1`` folds every unmasked block of a GQA ring,
    ``0`` none."""
    from distlab import knobs
    from distlab.kernels import fa4_ring_backward as frb

    def kept(rows, heads=4, kv_heads=2, causal=True, layout="zigzag"):
        q, k = torch.zeros(1, rows, heads, 1), torch.zeros(1, rows, kv_heads, 1)
        return frb.FA4RingBackward(q, q, q, None, k, 1.0, causal, layout)

    with knobs.override(FA4_RING_FOLD="auto"):
        big, mid, small = kept(4096), kept(2048), kept(1024)
        assert big.fold and [big.folds(n, False) for n in (2048, 4096)] == [True, True]
        assert mid.fold and [mid.folds(n, False) for n in (1024, 2048)] == [True, False] and not mid.folds(1024, True)
        assert not big.folds(2048, True) and not small.fold and not small.folds(512, False)
        assert not kept(8192).fold and not kept(8192).folds(2048, False)
        assert not kept(4096, heads=2).fold   # MHA: nothing to fold
        # no half row sets to fold: a contiguous or a non-causal ring would only pay the conversions
        assert not kept(4096, layout="contiguous").fold and not kept(4096, causal=False).fold
    with knobs.override(FA4_RING_FOLD="1"):
        assert kept(1024).folds(1024, False) and kept(4096).folds(4096, False) and not kept(4096).folds(4096, True)
    with knobs.override(FA4_RING_FOLD="0"):
        assert not kept(4096).fold and not kept(4096).folds(2048, False)
    with knobs.override(FA4_RING_FOLD="half"):   # auto's rule at any shard: the causal zigzag's half row sets
        assert [kept(1024).folds(n, False) for n in (512, 1024)] == [True, False] and not kept(1024).folds(512, True)
        assert kept(8192).folds(4096, False) and not kept(8192).folds(8192, False)
        assert not kept(1024, layout="contiguous").fold and not kept(1024, causal=False).fold


def test_fa4_key_ranges_of_an_accumulator_are_its_tiles_in_order():
    """``add_into`` a key range that does not start at 0 (no ring layout has one today: zigzag's partial
    blocks take the first half of the keys) lands on those keys of every head."""
    from distlab.kernels import fa4_ring_backward as frb

    q, k = torch.zeros(1, 8, 4, 3), torch.zeros(1, 8, 2, 3)
    kept = frb.FA4RingBackward(q, q, q, None, k, 1.0, True)
    acc, part = torch.zeros(1, 2, 8 * 3), torch.arange(2 * 4 * 3, dtype=torch.float32).view(1, 2, 12)
    kept.add_into(acc, slice(4, 8), part)
    want = torch.zeros(1, 8, 2, 3)
    want[:, 4:8] = part.view(1, 2, 4, 3).transpose(1, 2)
    assert torch.equal(acc, _heads_major(want))


def _tile_post(m, dim, perm):
    """A stand-in postprocess whose accumulator keeps each tile of ``m`` rows in the order ``perm`` (as FA4's
    keep the order of the MMA's registers): output (b, s, h, d) = scale × accum read through it."""
    def post(accum, output, sc, *rest):
        b, s, h, d = output.shape
        rows, dims = torch.arange(s)[:, None], torch.arange(d)[None, :]
        off = (rows // m) * m * d + perm[(rows % m) * d + dims]
        output.copy_((accum.view(b, h, -1)[:, :, off] * sc).permute(0, 2, 1, 3).to(output.dtype))
    return post


def _dq_finish_on_the_interpreter():
    """Three row sets (all rows in tiles of 4, all rows in tiles of 6, the second half folded two q heads a kv
    head in tiles of 6), each tile's values shuffled: their orders measured through the stand-in postprocess,
    then dQ finished in one kernel against the sum of the parts."""
    from distlab.kernels import triton_dq_finish as fin
    from distlab.kernels.fa4_ring_backward import fold_heads

    g = torch.Generator().manual_seed(0)
    b, s, h, kvh, d, scale = 2, 24, 4, 2, 8, 0.3
    sets, want, order_errors = [], torch.zeros(b, s, h, d), []
    for m, start, group in ((4, 0, 1), (6, 0, 1), (6, 12, 2)):
        rows = s - start
        perm = torch.randperm(m * d, generator=g)
        order = fin.window_order((_tile_post(m, d, perm), (None, None, 1.0)), d, torch.float32, torch.device("cpu"))
        r, dims = torch.arange(fin.WINDOW)[:, None], torch.arange(d)[None, :]
        order_errors.append(int((order.view(fin.WINDOW, d) != (r // m) * m * d + perm[(r % m) * d + dims]).sum()))
        part = torch.randn(b, rows, h, d, generator=g)
        want[:, start:] += scale * part
        held = fold_heads(part, kvh) if group > 1 else part   # (b, accumulator rows, accumulator heads, d)
        arows, aheads = held.shape[1], held.shape[2]
        accum = torch.zeros(b, aheads, -(-arows // m) * m * d)
        r = torch.arange(arows)[:, None]
        accum[:, :, ((r // m) * m * d + perm[(r % m) * d + dims]).flatten()] = held.permute(0, 2, 1, 3).reshape(b, aheads, -1)
        sets.append((accum, order, start, rows, group))
    got = fin.dq_finish(torch.full((b, s, h, d), float("nan")), sets, scale)
    try:
        fin.window_order((lambda accum, out, sc, *rest: out.zero_(), (None, None, 1.0)), d, torch.float32,
                         torch.device("cpu"))
        refused = False
    except fin.TileOrderUnknown:
        refused = True
    return order_errors, (got - want).abs().max().item(), refused


def test_dq_finish_reads_each_sets_tile_order_on_the_interpreter(interpreted_pools):
    """``triton_dq_finish`` (knob ``FA4_RING_DQ_FUSED=1``): each set's tile order is measured exactly through its
    postprocess, a postprocess that is not a permutation is refused, and the one-kernel dQ equals the scaled
    sum of the sets' parts, a folded set's heads unfolded."""
    (order_errors, err, refused), = interpreted_pools(1).run(_dq_finish_on_the_interpreter)
    assert order_errors == [0, 0, 0] and refused
    assert err < 1e-5, err


def _dq_early_on_the_interpreter():
    """Folding and unfolded rings on the float32 stand-ins (W=2 zigzag: rank 0's last block is its second half's
    row set) with the one-kernel dQ finish, the other sets' part finished early (``FA4_RING_DQ_EARLY=1``) and not;
    each ring twice on its shape (the early pass's float32 buffer kept). Returns the rings and how many times
    ``dq()`` took the early pass's rest."""
    from distlab.kernels import fa4_ring_backward as frb

    real, ran = frb.FA4RingBackward._dq_after_early, [0]

    def counted(self):
        ran[0] += 1
        return real(self)
    frb.FA4RingBackward._dq_after_early = counted
    try:
        rings = {(n, fold, early): _ring_on_stand_ins("zigzag", True, 4, 2, 32, 4, n, fold=fold, glue="1",
                                                      dtype=torch.float32, dkv_finish="1", repeat=2, fold_pre="1",
                                                      pre_once="1", dq_fused="1", dq_early=early)
                 for n, fold in ((1, "1"), ((2,), "1"), (1, "0")) for early in ("0", "1")}
    finally:
        frb.FA4RingBackward._dq_after_early = real
    return rings, ran[0]


def test_dq_early_finish_is_the_same_dq_bit_for_bit_on_the_interpreter(interpreted_pools):
    """``FA4_RING_DQ_EARLY=1`` (``FA4RingBackward._dq_early``): on rank 0 of a W=2 zigzag ring, whose last block
    is its second half's row set, dQ of the rows only the causal set holds is written early and the rest is the
    float32 sum of the same parts in the same order — the same dQ bit for bit as the one-kernel finish after the
    last block, folded and not, step by step and as one launch group; rank 1 (its last set all rows) never takes
    it; both match one device."""
    results = interpreted_pools(2).run(_dq_early_on_the_interpreter, timeout_s=300)
    for rank, (rings, ran) in enumerate(results):
        assert ran == (6 if rank == 0 else 0), (rank, ran)   # 3 rings x 2 backwards on rank 0
        for (n, fold, early), res in rings.items():
            assert max(res["errors"]) < 1e-5, (rank, n, fold, early, res["errors"])
            other = rings[n, fold, "0" if early == "1" else "1"]
            assert all(torch.equal(a, b) for a, b in zip(res["grads"], other["grads"])), (rank, n, fold)


def _glue_on_the_interpreter():
    """``triton_ring_glue`` against torch, bit for bit: Q, out and dO folded in one launch (row slices of a
    longer shard, as a row set's are), and float32 += fp16 / float32 over a key range of the folded dK/dV
    layout (batch 1 and 2); a layout it does not take refused. Then a folding ring on the float32 stand-ins with
    ``FA4_RING_GLUE=1`` (each glue call counted), against the float64 reference."""
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.kernels import triton_ring_glue as glue

    g = torch.Generator().manual_seed(1)
    mismatches = []
    for b, rows, n in ((1, slice(3, 9), 3), (2, slice(0, 10), 1)):
        full = [torch.randn(b, 10, 4, 8, generator=g) for _ in range(n)]
        got = glue.fold_heads_([t[:, rows] for t in full], 2)
        mismatches += [not torch.equal(x, frb.fold_heads(t[:, rows], 2)) for x, t in zip(got, full)]
    for b, part_dtype, cut in ((1, torch.float16, True), (2, torch.float32, True), (1, torch.float32, False),
                               (2, torch.float16, False)):   # a share cut out of a fused block's result, or not
        acc = torch.randn(2, b, 12, 2, 8, generator=g)
        part = torch.randn(2, b, 7, 2, 8, generator=g).to(part_dtype)
        part = part[:, :, 1:6] if cut else part[:, :, 1:6].contiguous()
        want = acc.clone()
        want[:, :, 4:9].add_(part)
        glue.add_into_(acc[:, :, 4:9], part)
        mismatches.append(not torch.equal(acc, want))
    refused = not glue.add_takes(torch.zeros(4, 6).t(), torch.zeros(6, 4)) and not glue.fold_takes(
        [torch.zeros(1, 4, 2, 6)], 2)   # a transposed accumulator; head_dim 6
    # an unfolded block's scratch finished into a key range of the folded accumulator: tiles of 4 keys, each
    # tile's values shuffled (dK's and dV's differently), as FA4's postprocesses would read them
    b, kvh, d, keys, m, scale = 2, 2, 8, 12, 4, 0.3
    perms = [torch.randperm(m * d, generator=g) for _ in range(2)]
    orders = glue.dkv_orders([(_tile_post(m, d, p), (None, None, 1.0)) for p in perms], d, torch.float32,
                             torch.device("cpu"))
    val = torch.randn(2, b, keys, kvh, d, generator=g)
    r, dims = torch.arange(keys)[:, None], torch.arange(d)[None, :]
    scratch = torch.zeros(2, b, kvh, keys * d)
    for i, p in enumerate(perms):
        scratch[i][:, :, ((r // m) * m * d + p[(r % m) * d + dims]).flatten()] = val[i].permute(0, 2, 1, 3).reshape(
            b, kvh, -1)
    acc = torch.randn(2, b, 12, kvh, d, generator=g)
    want = acc.clone()
    want[:, :, 2:10] += val[:, :, 4:12] * torch.tensor([scale, 1.0]).view(2, 1, 1, 1, 1)
    glue.dkv_finish_(acc[:, :, 2:10], scratch[..., 4 * d:], orders, scale, 1.0, add=True)
    fresh = glue.dkv_finish_(torch.full((2, b, keys, kvh, d), float("nan")), scratch, orders, scale, 1.0, add=False)
    finish_errors = [(acc - want).abs().max().item(),
                     (fresh - val * torch.tensor([scale, 1.0]).view(2, 1, 1, 1, 1)).abs().max().item()]
    calls = {"fold": 0, "add": 0, "finish": 0}
    real = glue.fold_heads_, glue.try_add_into_, glue.dkv_finish_

    def counted(name, fn):
        def call(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return call
    glue.fold_heads_, glue.try_add_into_, glue.dkv_finish_ = (counted(name, fn) for name, fn in
                                                          zip(("fold", "add", "finish"), real))
    try:
        ring = [_ring_on_stand_ins("zigzag", True, 4, 2, 32, 4, n, fold="1", glue="1", dtype=torch.float32,
                                   dkv_finish=finish) for n in (1, (2,)) for finish in ("0", "1")]
    finally:
        glue.fold_heads_, glue.try_add_into_, glue.dkv_finish_ = real
    return mismatches, refused, finish_errors, calls, ring


def test_pre_once_with_two_unfolded_sets_and_no_shared_preprocess_on_the_interpreter(interpreted_pools):
    """``FA4_RING_PRE_ONCE=1`` with ``FA4_RING_SHARE_PRE=0`` where a rank has two unfolded row sets of all its rows
    (causal and not) and a folded half set (W=3 zigzag, the whole shard too long to fold, its half not): the one
    pass writes a single unfolded set's buffers, so it steps aside and each set runs its own — every rank matches
    one device (it once marked both unfolded sets written: rank 1's non-causal set read unwritten buffers)."""
    for res in interpreted_pools(3).run(_ring_on_stand_ins, "zigzag", True, 4, 2, 48, 4, 1, fold=("auto", 8, 8),
                                        glue="1", dtype=torch.float32, dkv_finish="1", share="0", fold_pre="1",
                                        pre_once="1", timeout_s=300):
        assert max(res["errors"]) < 1e-5, res


def test_ring_glue_kernels_match_torch_on_the_interpreter(interpreted_pools):
    """``FA4_RING_GLUE`` (``distlab.kernels.triton_ring_glue``): the fold and the float32 add equal torch's bit for
    bit and refuse what they do not take; ``FA4_RING_DKV_FINISH``'s pass reads a shuffled tile order into a key
    range (added, and written fresh); a folding ring taking them (each called) matches one device, on both ranks
    of a W=2 ring, step by step and as one launch group."""
    for mismatches, refused, finish_errors, calls, ring in interpreted_pools(2).run(_glue_on_the_interpreter,
                                                                                    timeout_s=300):
        assert not any(mismatches) and refused, (mismatches, refused)
        assert max(finish_errors) < 1e-6, finish_errors
        assert calls["fold"] >= 4 and calls["add"] >= 1 and calls["finish"] >= 2, calls
        for res in ring:
            assert res["folded"] and max(res["errors"]) < 1e-5, res


def _fold_pre_on_the_interpreter():
    """``triton_fold_preprocess`` against torch's fold and FA4's preprocess as ``_fake_record`` states it: the
    folded Q and dO bit for bit, delta and the log2 LSE of the folded rows (a row with LSE -inf: 0), the padding
    rows (delta 0, LSE +inf) and dQ's accumulator zeroed, over NaN-filled buffers; batch 1 and 2, row slices of a
    longer shard. Then a folding ring on the float32 stand-ins with ``FA4_RING_FOLD_PRE=1``, twice on one ring
    shape (the kept accumulators zeroed again), against the float64 reference."""
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.kernels import triton_fold_preprocess as fp

    g = torch.Generator().manual_seed(2)
    errors, mismatches = [], []
    for b, rows, pad in ((1, slice(0, 10), 4), (2, slice(3, 9), 5)):
        q, out, dout = (torch.randn(b, 10, 4, 8, generator=g)[:, rows] for _ in range(3))
        lse = torch.randn(b, 4, 10, generator=g)[:, :, rows]
        lse[0, 1, 2] = float("-inf")
        n = (rows.stop - rows.start) * 2
        bufs = (torch.full((b, 2, n + pad), float("nan")), torch.full((b, 2, n + pad), float("nan")),
                torch.full((b, 2, (n + pad) * 8), float("nan")))
        got = fp.fold_preprocess_((q, out, dout), lse, 2, bufs)
        mismatches += [not torch.equal(x, frb.fold_heads(t, 2)) for x, t in zip(got, (q, dout))]
        delta = (frb.fold_heads(out, 2) * frb.fold_heads(dout, 2)).sum(-1).transpose(1, 2)
        want = lse.reshape(b, 2, n) * 1.4426950408889634
        want[want == float("-inf")] = 0.0
        errors += [(bufs[0][..., :n] - delta).abs().max().item(), (bufs[1][..., :n] - want).abs().max().item()]
        mismatches += [bool((bufs[0][..., n:] != 0).any()), bool((bufs[1][..., n:] != float("inf")).any()),
                       bool((bufs[2] != 0).any())]
    # several row sets in one pass (``preprocess_sets_``): every row and the last 6 folded, the rows unfolded
    b, log2e = 2, 1.4426950408889634
    q, out, dout = (torch.randn(b, 10, 4, 8, generator=g) for _ in range(3))
    lse = torch.randn(b, 4, 10, generator=g)
    lse[1, 3, 7] = float("-inf")
    sets = [(0, 10, 3), (4, 6, 7)]   # (start, rows, padding rows past the folded ones)
    bufs = [tuple(torch.full((b, 2, shape), float("nan")) for shape in (2 * n + pad, 2 * n + pad, (2 * n + pad) * 8))
            for _, n, pad in sets]
    plain = tuple(torch.full((b, 4, shape), float("nan")) for shape in (13, 13, 13 * 8))
    outs = fp.preprocess_sets_((q, out, dout), lse, 2, [(st, n, bf) for (st, n, _), bf in zip(sets, bufs)], plain)
    for (st, n, _), bf, got in zip(sets, bufs, outs):
        rows = slice(st, st + n)
        mismatches += [not torch.equal(x, frb.fold_heads(t[:, rows], 2)) for x, t in zip(got, (q, dout))]
        delta = (frb.fold_heads(out[:, rows], 2) * frb.fold_heads(dout[:, rows], 2)).sum(-1).transpose(1, 2)
        want = lse[:, :, rows].reshape(b, 2, 2 * n) * log2e
        want[want == float("-inf")] = 0.0
        errors += [(bf[0][..., :2 * n] - delta).abs().max().item(), (bf[1][..., :2 * n] - want).abs().max().item()]
        mismatches += [bool((bf[0][..., 2 * n:] != 0).any()), bool((bf[1][..., 2 * n:] != float("inf")).any()),
                       bool((bf[2] != 0).any())]
    want = lse * log2e
    want[want == float("-inf")] = 0.0
    errors += [(plain[0][..., :10] - (out * dout).sum(-1).transpose(1, 2)).abs().max().item(),
               (plain[1][..., :10] - want).abs().max().item()]
    mismatches += [bool((plain[0][..., 10:] != 0).any()), bool((plain[1][..., 10:] != float("inf")).any()),
                   bool((plain[2] != 0).any())]
    # zero_folded=False: the folded sets' dQ accumulators left to the caller (FA4_RING_ZERO_BESIDE), the rest written
    bufs2 = [tuple(torch.full_like(t, float("nan")) for t in bf) for bf in bufs]
    plain2 = tuple(torch.full_like(t, float("nan")) for t in plain)
    fp.preprocess_sets_((q, out, dout), lse, 2, [(st, n, bf) for (st, n, _), bf in zip(sets, bufs2)], plain2,
                        zero_folded=False)
    mismatches += [not bool(bf[2].isnan().all()) or not torch.equal(bf[0], want_bf[0]) for bf, want_bf in
                   zip(bufs2, bufs)] + [not all(torch.equal(x, y) for x, y in zip(plain2, plain))]
    too_long = (torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2 * 8))   # 2 rows of 4 fold to 4 > 2
    refused = not fp.fold_pre_takes([torch.zeros(1, 2, 4, 8)] * 3, torch.zeros(1, 4, 2), 2, too_long) and not \
        fp.sets_take([q, out, dout], lse, 2, [(6, 6, bufs[1])]) and not fp.sets_take([q, out, dout], lse, 2, [])
    calls = []   # the number of row sets of each pass
    real = fp.preprocess_sets_

    def counted(tensors, lse, kv_heads, folded, unfolded=None, *rest):
        calls.append(len(folded) + (unfolded is not None))
        return real(tensors, lse, kv_heads, folded, unfolded, *rest)
    fp.preprocess_sets_ = counted
    try:
        ring = [_ring_on_stand_ins("zigzag", True, 4, 2, 32, 4, n, fold="1", glue="1", dtype=torch.float32,
                                   dkv_finish="1", repeat=2, fold_pre="1", pre_once=once)
                for n in (1, (2,)) for once in ("0", "1")]
    finally:
        fp.preprocess_sets_ = real
    return mismatches, errors, refused, calls, ring


def test_fold_pre_kernel_matches_the_fold_and_fa4s_preprocess_on_the_interpreter(interpreted_pools):
    """``FA4_RING_FOLD_PRE`` (``distlab.kernels.triton_fold_preprocess``): one pass gives the fold of Q and dO and
    every buffer FA4's preprocess writes, padding included — for one folded set, and for two folded sets of one
    shard's rows with the rows' unfolded set (``preprocess_sets_``); a folding ring taking it (called on both
    ranks of a W=2 ring, step by step and as one launch group, twice on each ring shape), with each set's own
    pass and with every set's in one (``FA4_RING_PRE_ONCE=1``: a pass of two sets runs), matches one device."""
    for mismatches, errors, refused, calls, ring in interpreted_pools(2).run(_fold_pre_on_the_interpreter,
                                                                             timeout_s=300):
        assert not any(mismatches) and refused, mismatches
        assert max(errors) < 1e-6, errors
        assert calls.count(1) >= 2 and 2 in calls, calls
        for res in ring:
            assert res["folded"] and max(res["errors"]) < 1e-5, res


def test_ring_glue_benchmark_refuses_without_a_gpu_before_any_work():
    """``python -m distlab.kernels.triton_ring_glue`` times GPU kernels: on a machine without CUDA it stops with
    one line pointing at its CPU check (a ValueError), before timing anything."""
    from distlab.kernels import triton_ring_glue as glue

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        glue.main([])


def test_fold_pre_benchmark_refuses_without_a_gpu_before_any_work():
    """``python -m distlab.kernels.triton_fold_preprocess`` times GPU kernels: without CUDA, one line pointing at
    its CPU check (a ValueError), before timing anything."""
    from distlab.kernels import triton_fold_preprocess as fp

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fp.main([])


@pytest.mark.gpu
def test_ring_glue_kernels_match_torch_on_the_gpu():
    """The glue at a W=8 S32768 rank's shapes in bf16 on the GPU: the fold and the float32 += bf16 share equal
    torch's bit for bit."""
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.kernels import triton_ring_glue as glue

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(1, 4096, 32, 128, device="cuda", generator=g).bfloat16() for _ in range(3)]
    for got, t in zip(glue.fold_heads_([t[:, 2048:] for t in full], 8), full):
        assert torch.equal(got, frb.fold_heads(t[:, 2048:], 8))
    acc = torch.randn(2, 1, 4096, 8, 128, device="cuda", generator=g)
    block = torch.randn(2, 1, 12288, 8, 128, device="cuda", generator=g).bfloat16()
    for keys in (4096, 2048):
        want = acc.clone()
        want[:, :, 4096 - keys:].add_(block[:, :, 4096:4096 + keys])
        glue.add_into_(acc[:, :, 4096 - keys:], block[:, :, 4096:4096 + keys])
        assert torch.equal(acc, want), keys


@pytest.mark.gpu
def test_fa4_ring_backward_with_fold_pre_matches_the_float32_reference():
    """``FA4_RING_FOLD_PRE=1`` on FA4's real kernels: the rings of the test above with every unmasked set folded,
    its fold and preprocess one Triton pass, dQ finished in one kernel or by FA4's postprocesses."""
    from distlab import knobs
    from distlab.kernels import fa4

    from distlab.kernels import triton_fold_preprocess as fp

    if not torch.cuda.is_available() or not fa4.runs_on(torch.device("cuda"), torch.bfloat16):
        pytest.skip("needs FA4 on an sm90+ GPU")
    calls, real = [0], fp.preprocess_sets_
    fp.preprocess_sets_ = lambda *a, **kw: calls.__setitem__(0, calls[0] + 1) or real(*a, **kw)
    try:
        for layout, world, batch, n in (("zigzag", 4, 1, 1), ("zigzag", 2, 2, 1), ("contiguous", 4, 2, 3),
                                        ("zigzag", 8, 1, (1, 2, 5))):
            for fused, finish, once in (("1", "1", "0"), ("0", "0", "0"), ("1", "1", "1")):
                with knobs.override(FA4_RING_ACCUM="1", FA4_RING_FOLD="1", FA4_RING_DQ_FUSED=fused,
                                    FA4_RING_GLUE="1", FA4_RING_DKV_FINISH=finish, FA4_RING_FOLD_PRE="1",
                                    FA4_RING_PRE_ONCE=once):
                    before = calls[0]
                    for rank, errs in enumerate(_ring_rank_on_fa4(2048, world, 8, 2, layout, batch, n)):
                        assert max(errs) < 2e-2, (layout, world, batch, n, fused, finish, once, rank, errs)
                    assert calls[0] > before, (layout, world, batch, n, "the fold's preprocess never ran")
    finally:
        fp.preprocess_sets_ = real


@pytest.mark.gpu
def test_fa4_ring_backward_with_dq_early_matches_the_float32_reference():
    """``FA4_RING_DQ_EARLY=1`` and ``RING_MERGE_EARLY=1`` on FA4's real kernels, the early passes on the side
    stream: every rank of a W=8 zigzag ring by groups 1|3|4 (as the S32768 study runs it) and of a W=4 one step
    by step, folded (the S32768 defaults: every unmasked set, its fold and preprocess one pass, every set's in
    one, the folded sets' dQ accumulators zeroed by the pass or beside step 0, ``FA4_RING_ZERO_BESIDE=1``) and
    not. Ranks whose last blocks are a second half's rows take both (W=8: ranks 0-6; W=4: 0-2)."""
    from distlab import knobs
    from distlab.cp import ring_merge_early
    from distlab.kernels import fa4
    from distlab.kernels import fa4_ring_backward as frb

    if not torch.cuda.is_available() or not fa4.runs_on(torch.device("cuda"), torch.bfloat16):
        pytest.skip("needs FA4 on an sm90+ GPU")
    real, ran = frb.FA4RingBackward._dq_after_early, [0]
    frb.FA4RingBackward._dq_after_early = lambda self: ran.__setitem__(0, ran[0] + 1) or real(self)
    real_merge, merged = ring_merge_early.merge_last, [0]
    ring_merge_early.merge_last = lambda *a: merged.__setitem__(0, merged[0] + 1) or real_merge(*a)
    try:
        for world, n in ((8, (1, 3, 4)), (4, 1)):
            for fold, beside in (("1", "0"), ("1", "1"), ("0", "0")):
                with knobs.override(FA4_RING_ACCUM="1", FA4_RING_FOLD=fold, FA4_RING_DQ_FUSED="1", FA4_RING_GLUE="1",
                                    FA4_RING_DKV_FINISH="1", FA4_RING_FOLD_PRE="1", FA4_RING_PRE_ONCE="1",
                                    FA4_RING_DQ_EARLY="1", RING_MERGE_EARLY="1", FA4_RING_ZERO_BESIDE=beside):
                    before = ran[0], merged[0]
                    for rank, errs in enumerate(_ring_rank_on_fa4(2048, world, 8, 2, "zigzag", 1, n)):
                        assert max(errs) < 2e-2, (world, n, fold, rank, errs)
                    assert (ran[0] - before[0], merged[0] - before[1]) == (world - 1,) * 2, (world, n, fold, ran,
                                                                                             merged, before)
    finally:
        frb.FA4RingBackward._dq_after_early = real
        ring_merge_early.merge_last = real_merge


@pytest.mark.gpu
def test_fold_pre_kernel_matches_fa4s_preprocess_on_the_gpu():
    """``triton_fold_preprocess`` at a W=8 S32768 rank's half row set (2048 of 4096 rows, 32 q / 8 kv heads, bf16)
    against FA4's own preprocess on the folded tensors: the fold bit for bit, the log2 LSE (padding +inf) and the
    zeroed dQ accumulator equal, delta (a float32 row sum in another order) within 1e-5."""
    from distlab.kernels import fa4
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.kernels import triton_fold_preprocess as fp

    if not torch.cuda.is_available() or not fa4.runs_on(torch.device("cuda"), torch.bfloat16):
        pytest.skip("needs FA4 on an sm90+ GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, out, dout = (torch.randn(1, 4096, 32, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    lse = torch.randn(1, 32, 4096, device="cuda", generator=g) + 5
    rows = slice(2048, 4096)
    rec = frb._record(1, 4 * 2048, 2048, 8, 8, 128, torch.bfloat16, q.device, False, 128 ** -0.5)
    (pre_fn, pre_args) = rec[0]
    want = frb.preprocess_buffers(rec, q)
    folded = [frb.fold_heads(t[:, rows], 8) for t in (q, out, dout)]
    pre_fn(folded[1], folded[2], want[0], lse[:, :, rows].reshape(1, 8, -1), want[1], want[2], *pre_args[6:])
    got = tuple(torch.full_like(t, float("nan")) for t in want)
    fq, fdo = fp.fold_preprocess_((q[:, rows], out[:, rows], dout[:, rows]), lse[:, :, rows], 8, got)
    assert torch.equal(fq, folded[0]) and torch.equal(fdo, folded[2])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]) and not got[2].any()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_preprocess_sets_match_fa4s_preprocess_on_the_gpu():
    """``preprocess_sets_`` at a W=8 S32768 middle rank's row sets (32 q / 8 kv heads, bf16): the 4096 rows and the
    last 2048 folded, the 4096 rows unfolded for the causal block, in one pass — each against FA4's own
    preprocess for its recorded kernel: the folds bit for bit, LSE and the zeroed dQ accumulators equal, delta
    within 1e-5."""
    from distlab.kernels import fa4
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.kernels import triton_fold_preprocess as fp

    if not torch.cuda.is_available() or not fa4.runs_on(torch.device("cuda"), torch.bfloat16):
        pytest.skip("needs FA4 on an sm90+ GPU")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, out, dout = (torch.randn(1, 4096, 32, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    lse = torch.randn(1, 32, 4096, device="cuda", generator=g) + 5
    wants, gots, targets = [], [], []
    for start, fold in ((0, True), (2048, True), (0, False)):
        rows, group = slice(start, 4096), 4 if fold else 1
        rec = frb._record(1, group * (4096 - start), 4096, 32 // group, 8, 128, torch.bfloat16, q.device,
                          not fold, 128 ** -0.5)
        (pre_fn, pre_args) = rec[0]
        want = frb.preprocess_buffers(rec, q)
        t = [frb.fold_heads(x[:, rows], 8) if fold else x for x in (q, out, dout)]
        lse_t = lse[:, :, rows].reshape(1, 8, -1) if fold else lse
        pre_fn(t[1], t[2], want[0], lse_t, want[1], want[2], *pre_args[6:])
        wants.append((want, t))
        gots.append(tuple(torch.full_like(x, float("nan")) for x in want))
        targets.append((start, 4096 - start, gots[-1]))
    outs = fp.preprocess_sets_((q, out, dout), lse, 8, targets[:2], gots[2])
    for (want, t), got, folded in zip(wants, gots, outs + [None]):
        if folded is not None:
            assert torch.equal(folded[0], t[0]) and torch.equal(folded[1], t[2])
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]) and not got[2].any()
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_dq_fused_knob_falls_back_where_the_kernel_does_not_apply(pools):
    """``FA4_RING_DQ_FUSED=1`` on the CPU's float64 stand-ins (no float32 accumulators, no Triton device): the ring
    backward takes FA4's postprocesses and its gradients still match one device, on every rank (no rank raises
    at the backward's end while others wait)."""
    for res in pools(3).run(_ring_on_stand_ins, "zigzag", True, 4, 2, 48, 4, 1, "0", "0", "0", dq_fused="1"):
        assert max(res["errors"]) < 1e-12 and len(res["row_sets"]) >= 2, res


def test_dq_finish_sweep_refuses_without_fa4_before_any_work():
    """``python -m distlab.kernels.triton_dq_finish`` reads FA4's real accumulators: without FA4 on an sm90+ GPU
    it stops with one line naming the package (a UsageError), before timing anything."""
    from distlab.bench import UsageError
    from distlab.kernels import triton_dq_finish as fin

    with pytest.raises(UsageError, match="flash-attn-4"):
        fin.main(["--device", "cpu"])
