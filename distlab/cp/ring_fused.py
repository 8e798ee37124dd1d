"""The ring's backward by launch groups, for block backends with no in-kernel accumulation (FA4, cuDNN, torch):
each group's runs of blocks over the same rows computed as one block over their keys, concatenated.

    python -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 --steps-per-launch 1 4 --wall   # H100/H200
    DISTLAB_RING_STEPS_PER_LAUNCH=2 distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --backend torch --check

Why: on a short shard a ring step's block is a small kernel whose launch (host time) and last partial wave
cost as much as its work. The forward already goes by launch groups (``distlab.cp.ring.launch_groups``: step
0 alone, its K/V local; then groups of n steps whose K/V travel while the group before computes) and, for
these backends, joins each group's blocks over one row range into one call (``ring.fuse_plan``: zigzag's
busiest rank runs W=8 in 3 calls with n=4, not 8). This is the same for the backward: the group's K/V are
received ahead (``ring._KVAhead``), its fused blocks run once each (dQ for the rows, dK/dV for all the
group's keys), and each step's share of dK/dV is cut out of the result and added, in step order, into the
travelling float32 accumulator of that step's K/V when it arrives from the previous rank — the same W dK/dV
hops and W−1 K/V hops as the step-by-step ring, so the answer and the traffic do not change (with
``dkv_route="direct"`` the shares go to their owners instead: ``distlab.cp.ring_dkv_direct``).

The chain, and why the adds go on a side stream: the dK/dV accumulators still go one hop a step, and the add
of a group's step s+1 waits for the previous rank's add of step s, done after *its* kernel of the same group:
a chain of up to n−1 hops after the group's kernels. Queued on the compute stream it would hold the next
group's kernel back by those hops (W=8, n=4, S32768: 5 hops of 32 MiB, ~0.45 ms on NVLink, in a 7 ms
backward); on CUDA the adds, their waits and the dK/dV sends go on a side stream that waits only for the
group's kernels, so the chain runs beside the next group's kernels, which take n steps of compute. The
emulator (no communication) times the adds there too; the real hops are not timed anywhere yet (no
multi-GPU machine lent). Up to 2n−1 K/V blocks are held at once, as in the forward.
With FA4 (``distlab.kernels.fa4_ring_backward``) dQ stays in its float32 accumulators and a fused block's
dK/dV come back in FA4's accumulator layout (a head's keys in order, in whole tiles of 128): a step's share is
a slice of the last dimension.
"""

from __future__ import annotations

import functools

import torch

from distlab import knobs
from distlab.cp.ring_dkv_direct import DirectDkv
from distlab.cp.ring_landing import kv_landing, use_landing
from distlab.cp.ring import (_KVAhead, _accumulate, _fa4_kept, _seq_part, fuse_cap, group_kv,
                             group_plans)
from distlab.kernels.attention import attention_backward
from distlab.profiling import phase


def ring_backward_groups(dout, q, k, v, out, lse, ring, causal, layout, scale, backend, steps_per_launch,
                         dkv_route="ring"):
    """``distlab.cp.ring._ring_backward`` for a backend other than ``triton`` whose launch groups
    (``steps_per_launch``) hold several steps: returns (dq, dk, dv) of this rank's shard. ``dkv_route``:
    ``ring`` (the travelling accumulator) or ``direct`` (each share sent to its owner, ``ring_dkv_direct``)."""
    s = q.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    shape = (ring.rank, ring.size, s, causal, layout, steps_per_launch, fuse_cap())
    groups = group_plans(*shape)
    kept = None
    side = _side_stream(q.device) if q.is_cuda and knobs.get("RING_DKV_SIDE_STREAM") != "0" else None
    main = torch.cuda.current_stream(q.device) if side is not None else None
    direct = dkv_route == "direct" and ring.size > 1
    if backend == "fa4":   # every block shape recorded before the first exchange (a refusal raises everywhere)
        from distlab.kernels import fa4_ring_backward

        blocks = _fused_blocks(*shape, fa4_ring_backward.TILE)
        if blocks is not None:   # the later blocks' dK/dV scratch kept per ring shape (read by the adds on the
            # side stream, waited for at the end; the direct route's sends are not, so it keeps none), where step 0
            # runs alone (its one block, blocks[0], starts the travelling accumulator: fresh memory each backward)
            keep = not direct and list(groups[0][0]) == [0] and knobs.get("RING_ZERO_AHEAD") != "1"
            kept = _fa4_kept(dout, q, k, out, lse, scale, causal, blocks, layout, side, keep)
    if direct and kept is not None:   # the owners sum shares of one layout: every block's converted
        kept.raw_finish = False
    landing = kv_landing(ring, k, shape) if ring.size > 1 and use_landing(k, v, backend, groups) else None
    kv = _KVAhead(ring, (k, v), landing)
    ahead = max(len(steps) for steps, _ in groups)
    dq = dkv = dkv_pending = None
    skip_adds = knobs.get("RING_DKV_ADDS") == "0"   # a timing bound only: how much do the adds cost the rank?
    if skip_adds and not getattr(ring, "stand_in", False):
        raise ValueError("DISTLAB_RING_DKV_ADDS=0 is a timing probe of distlab.cp.emulate only: it leaves dK/dV wrong")
    if kept is not None and side is not None and knobs.get("RING_ZERO_AHEAD") == "1":   # the later groups' dK/dV
        # scratch zeroed beside step 0's kernels (off by default until timed on a GPU: gpu_host_check.sh fa4land2)
        kept.zero_ahead(blocks[1:], side)
    for g, (steps, plan) in enumerate(groups):
        with phase("ring.exchange"):
            kv.post_through(steps[-1] + ahead)   # the next groups' K/V, while this one computes
        with phase("ring.wait"):
            got = {step: kv.get(step) for step in steps}
        parts = {step: [] for step in steps}   # per step: (cols, dK, dV) of its keys
        results = []   # the fused blocks' dK/dV (the shares are views of them)
        for i, (rows, blk_causal, pieces) in enumerate(plan):
            landed = landing.run_kv(g, i) if landing is not None else None   # received in place (ring_landing)
            k_blk, v_blk = landed if landed is not None else group_kv(got, pieces)
            with phase("ring.block_backward"):
                if kept is not None:   # dQ into FA4's float32 accumulator; dK/dV in its layout, keys last, as one
                    dk_b, dv_b = kept.block(k_blk, v_blk, rows, slice(0, k_blk.shape[1]), blk_causal), None
                else:
                    dq_b, dk_b, dv_b = attention_backward(dout[:, rows], q[:, rows], k_blk, v_blk, out[:, rows],
                                                          lse[:, :, rows], blk_causal, scale, backend)
                    dq = _accumulate(dq, dq_b, rows, q, acc)
            results += (dk_b,) if dv_b is None else (dk_b, dv_b)
            start = 0
            for step, cols in pieces:
                n = cols.stop - cols.start
                if len(pieces) == 1:
                    share = (dk_b, dv_b)
                elif kept is not None:
                    share = (kept.share(dk_b, k_blk.shape[1], start, n), None)
                else:
                    share = (dk_b[:, start:start + n], dv_b[:, start:start + n])
                parts[step].append((cols, *share))
                start += n
        beside = side is not None and steps[0] > 0   # CUDA, a later group: after its kernels, beside the next's
        if beside:   # plain stream calls, not ``torch.cuda.stream`` (with step 0 kept on the compute stream: host
            # time a fused backward step 92.3 -> 67.5 µs, H100 2026-12-05, S8192's shapes, docs/PERF.md)
            side.wait_stream(main)
            for t in results:   # read on the side stream: not handed out again before it is done with them
                t.record_stream(side)
            torch.cuda.set_stream(side)
        try:
            for step in steps:
                if step == 0 and direct:   # my own K/V: its shares stay home, where the others' come
                    if kept is not None and (len(parts[0]) != 1 or parts[0][0][0] != slice(0, k.shape[1])):
                        raise RuntimeError("the ring's first backward step must be one block over every local key")
                    direct = DirectDkv(ring, shape, k, parts[0][0][1], own_slot=kept is not None)
                    # FA4's shares: step 0's one share of dK and dV, summed with the others once
                    dkv = (parts[0][0][1],) if kept is not None else _own_accumulator(parts[0], k, v, acc, kept)
                elif step == 0:   # my own K/V: its blocks start the accumulator that travels the ring
                    dkv = _own_accumulator(parts[0], k, v, acc, kept)
                elif direct:
                    direct.send(step, parts[step])
                else:           # the accumulator of this step's K/V, from the previous rank
                    dkv = dkv_pending.wait()
                    for cols, dk_b, dv_b in ([] if skip_adds else parts[step]):
                        if kept is not None:   # dK and dV in one add
                            kept.add_into(dkv[0], cols, dk_b)
                        else:
                            _seq_part(dkv[0], cols).add_(dk_b)
                            _seq_part(dkv[1], cols).add_(dv_b)
                if ring.size > 1 and not direct:
                    dkv_pending = ring.exchange(dkv, "ring_dkv")
        finally:
            if beside:
                torch.cuda.set_stream(main)
    # dQ's conversion first: on the compute stream, beside the last group's adds and the last hop home
    dq = kept.dq() if kept is not None else dq.to(q.dtype)
    if side is not None:   # the home accumulator is read on the compute stream
        main.wait_stream(side)
    if direct:
        total = direct.finish(dkv[0] if kept is not None else dkv, acc)
        return (dq, *(kept.finish_dkv(total, k, v) if kept is not None else (total[0].to(k.dtype),
                                                                            total[1].to(v.dtype))))
    if dkv_pending is not None:
        dkv = dkv_pending.wait()
    if side is not None:
        for t in dkv:
            t.record_stream(main)
    if kept is not None:
        return (dq, *kept.finish_dkv(dkv[0], k, v))
    return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)


@functools.lru_cache(maxsize=256)
def _fused_blocks(rank, world, seq, causal, layout, steps_per_launch, max_keys, tile):
    """The ``(rows, cols, causal)`` of every fused block (``cols`` over the joined keys), or None when some
    step's share of one is off FA4's tiles of ``tile`` keys (it is cut out by key range); once per ring shape."""
    groups = group_plans(rank, world, seq, causal, layout, steps_per_launch, max_keys)
    if any(c.start % tile or c.stop % tile for _, plan in groups for _, _, pieces in plan for _, c in pieces):
        return None
    return [(rows, slice(0, sum(c.stop - c.start for _, c in pieces)), blk_causal)
            for _, plan in groups for rows, blk_causal, pieces in plan]


_SIDE: dict = {}   # one side stream per CUDA device for the dK/dV adds and sends (a stream, not parallel state)


def _side_stream(device):
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _own_accumulator(parts, k, v, acc, kept):
    """Step 0's (dK, dV) accumulator from its blocks' shares (fresh memory: a share may be a view into a
    fused block's result, and the accumulator is added into and sent)."""
    if kept is not None:   # dK and dV in one tensor (FA4RingBackward.block)
        if len(parts) != 1 or parts[0][0] != slice(0, k.shape[1]):
            raise RuntimeError("the ring's first backward step must be one block over every local key")
        return (kept.own_accumulator(parts[0][1]),)
    dk = dv = None
    for cols, dk_b, dv_b in parts:
        whole = cols.start == 0 and cols.stop == k.shape[1]
        dk = _accumulate(dk, dk_b.clone() if whole and dk_b.dtype == acc else dk_b, cols, k, acc)
        dv = _accumulate(dv, dv_b.clone() if whole and dv_b.dtype == acc else dv_b, cols, v, acc)
    return dk, dv
