"""Ring attention (contiguous or zigzag layout), forward and backward, and the ring study.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --check
    torchrun --nproc-per-node 8 -m distlab.cp.ring --seq 65536 --heads 32 --kv-heads 8 --head-dim 128 --check
    python -m distlab.cp.ring --seq 4096                     # one process: world size 1

Each of the W ranks holds a shard of q, k, v along the sequence. K/V blocks travel around the ring
(rank r sends to r+1, receives from r−1); at step i rank r holds the K/V of rank (r−i) mod W and merges
the block's (out, lse) into its running result through the log-sum-exp
(``distlab.kernels.lse_merge``). The next K/V exchange is posted before the current block is computed, so it overlaps the compute. The forward
makes W−1 K/V exchanges. With ``steps_per_launch=n`` > 1 (4 is the ``triton`` default; the studies'
knob ``DISTLAB_RING_STEPS_PER_LAUNCH`` sets it for every backend) step 0 runs alone (its K/V are local: the
first hop travels behind it) and the later steps go in groups of n, the short one first (``launch_groups``):
up to n K/V blocks beyond the current group are in flight, each forwarded as soon as it arrives
(``comm.RingExchanger.exchange_after``), and the ``triton`` backend computes a group in one kernel launch
(``distlab.kernels.triton_attention.flash_forward_blocks``, up to four steps): one accumulate epilogue per group and
a longer key loop, where the step kernels of a short shard lose most of their time. The other backends
(cuDNN, FA4: no accumulation in their kernels) join a group's blocks over one row range into one call over
their keys (``fuse_plan``; 4 a group is their default too, and the backward goes by the same groups:
``distlab.cp.ring_fused``; on a batch-1 ring each step's K/V are received straight into the fused block's
buffer, ``distlab.cp.ring_landing``, else concatenated), hold the results back and merge four at a time in
one Triton launch (``lse_merge_blocks_``): the float32 running result is read and written once per four blocks, not per
block, and the last merge writes q's dtype (no conversion after).

Backward: K/V travel the ring again, and so does a float32 (dK, dV) accumulator for the block being
visited; each rank adds its contribution to it (computed with the *global* out and lse, see
``distlab/kernels/attention.py``), and after W hops it is back home. That is W−1 K/V exchanges and W dK/dV
exchanges. With the ``triton`` backend dQ is added into a float32 accumulator inside the dQ kernel, and each
row's last block writes its final dQ in q's dtype (``backward_schedule``: no conversion launch at the end).
``dkv_route="direct"`` (the fused backward only): each rank's dK/dV share goes straight to the rank that owns
those keys, in the shares' dtype, and is summed there once (``distlab.cp.ring_dkv_direct``): no float32 add a
step, fewer bytes, every pair of ranks talking once.

Packed documents and sliding windows (``cu_seqlens=``, ``window=``), and the ``balanced`` layout, run the
same ring with a mask per block built from global positions: ``distlab/cp/ring_packed.py``.

Causal attention: with the contiguous layout, blocks from later ranks are fully masked and skipped (rank
W−1 does W times rank 0's work). With zigzag (rank r holds chunks r and 2W−1−r) every step after the
first is exactly half a block: keys from an earlier rank are seen by all queries through their first
chunk only; keys from a later rank are seen only by the second query chunk, but whole. Every rank then
does the same work.
"""

from __future__ import annotations

import functools
import math

import torch

from distlab import comm, knobs
from distlab.cp.documents import Documents, cached_plan, check_call_everywhere
from distlab.cp.layout import check_layout, shard_positions
from distlab.cp import ring_merge_early
from distlab.cp.ring_kept import kept_forward
from distlab.cp.ring_landing import kv_landing, use_landing
from distlab.kernels.lse_merge import MERGE_BLOCKS, lse_merge_, merge_attention, merge_into
from distlab.profiling import phase
from distlab.kernels.attention import (attention_backward, attention_forward, available_backends, check_qkv,
                                       resolve_backend, triton_runs_on)


def ring_blocks(step_src: int, rank: int, seq: int, causal: bool, layout: str):
    """The (query rows, key rows, causal) blocks rank ``rank`` computes against the K/V of rank ``step_src``."""
    everything = slice(0, seq)
    if not causal:
        return [(everything, everything, False)]
    if step_src == rank:
        return [(everything, everything, True)]
    if layout == "contiguous":
        return [(everything, everything, False)] if step_src < rank else []
    half = seq // 2
    if step_src < rank:                      # their chunk src < r is seen whole; their late chunk not at all
        return [(everything, slice(0, half), False)]
    return [(slice(half, seq), everything, False)]   # only my late chunk sees their (earlier) chunks


def final_range(schedule, after, lo, hi, later=None):
    """The rows of [lo, hi) that no block after ``after`` = (step, index) touches, as one range ``(a, b)``
    (``a == b``: none). ``schedule``: the ``ring_blocks`` of every step. The blocks of the ring layouts
    cover every row or a tail of the rows, so what is left final is the head of [lo, hi) below where the
    later blocks start. ``later``: ``later_blocks(schedule)``, computed once per ring pass (a scan of the
    whole schedule per step cost ~7 µs of host time)."""
    start, stops = (later if later is not None else later_blocks(schedule))[after]
    if stops - {hi}:
        raise ValueError("final_range: later blocks must end where these rows do")
    return lo, (hi if start is None else max(lo, min(hi, start)))


def later_blocks(schedule):
    """``{(step, index): (smallest start of the blocks after it, or None; the set of their stops)}``, in one
    pass from the end."""
    out, start, stops = {}, None, frozenset()
    for i in reversed(range(len(schedule))):
        for j in reversed(range(len(schedule[i]))):
            out[(i, j)] = (start, stops)
            rows = schedule[i][j][0]
            start = rows.start if start is None else min(start, rows.start)
            stops = stops | {rows.stop}
    return out


def final_rows(schedule, step, index):
    """The rows of block ``index`` of step ``step`` that no later block touches, relative to the block, as
    ``(lo, hi)`` (``lo == hi``: none)."""
    rows = schedule[step][index][0]
    a, b = final_range(schedule, (step, index), rows.start, rows.stop)
    return a - rows.start, b - rows.start


def _triton_blocks_into(out, lse, final, q, blocks, schedule, scale, later=None):
    """The ``triton`` backend's launch: the kernel merges its blocks (``[(step, index, rows, k, v, causal)]``,
    one, or two ring steps when ``blocks_fit_one_launch``) into the float32 running (out, lse) and writes
    the rows that no later block touches straight into ``final`` in q's dtype."""
    from distlab.kernels.triton_attention import blocks_fit_one_launch, flash_forward_blocks, tile_config

    launch = [(r.start, r.stop, k, v, c) for _, _, r, k, v, c in blocks]
    if len(blocks) > 1 and not blocks_fit_one_launch(q, launch):
        for blk in blocks:
            out, lse = _triton_blocks_into(out, lse, final, q, [blk], schedule, scale, later)
        return out, lse
    start = out is None
    if start:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    lo, hi = min(b[2].start for b in blocks), max(b[2].stop for b in blocks)
    f_lo, f_hi = final_range(schedule, blocks[-1][:2], lo, hi, later)
    q_, out_, lse_, final_ = q, out, lse, final   # absolute rows (no views: each costs host time)
    if len(blocks) == 1 and (hi != q.shape[1] or lo % tile_config("FWD", q.device, q.shape[-1])[0]):
        rows = slice(lo, hi)                        # a block starting off a query tile: views of its rows
        q_, out_, lse_, final_ = q[:, rows], out[:, rows], lse[:, :, rows], final[:, rows]
        launch, f_lo, f_hi = [(0, hi - lo, *launch[0][2:])], f_lo - lo, f_hi - lo
    with phase("ring.block"):
        flash_forward_blocks(q_, launch, scale, out_, lse_, accumulate=not start,
                             final_out=final_ if f_hi > f_lo else None, final_rows=(f_lo, f_hi))
    return out, lse


def _block_into(out, lse, q, k, v, rows, causal, scale, backend):
    """Attention of q[:, rows] against k, v merged into the float32 running (out, lse); creates them at
    step 0 (whose block covers every row). Backends on CUDA merge with one Triton kernel
    (``distlab.kernels.lse_merge``), on CPU with ``merge_into`` (the ``triton`` backend: ``_triton_blocks_into``)."""
    with phase("ring.block"):
        o, l = attention_forward(q[:, rows], k, v, causal, scale, backend)
    with phase("ring.merge"):
        if out is None:
            return merge_attention(None, None, o, l)
        d = q.shape[-1]
        if q.is_cuda and out.dtype == torch.float32 and o.stride(-1) == 1 and not d & (d - 1) \
                and triton_runs_on(q.device):
            lse_merge_(out[:, rows], lse[:, :, rows], o, l)
        else:
            merge_into(out, lse, o, l, rows)
    return out, lse


class _KVAhead:
    """The K/V of each ring step, received ahead: step i+1's are what this rank receives by forwarding
    step i's, so the exchanges can be posted any number of steps before their blocks are computed."""

    def __init__(self, ring, kv, landing=None):
        self.ring, self.kv, self.pending, self.posted, self.landing = ring, {0: kv}, {}, 0, landing

    def post_through(self, step):
        """Post the exchanges up to the one that brings step ``step``'s K/V (``ring.size − 1`` at most)."""
        while self.posted < min(step, self.ring.size - 1):
            s = self.posted
            recv = self.landing.recv(s + 1) if self.landing is not None else None
            if s in self.pending:   # forward a block still on its way (ordered after its arrival only)
                self.pending[s + 1] = self.ring.exchange_after(self.pending[s], "ring_kv", recv)
            else:
                sent = self.kv[s] if self.landing is None else self.landing.messages(self.kv[s])
                self.pending[s + 1] = self.ring.exchange(sent, "ring_kv", recv)
            self.posted = s + 1

    def get(self, step):
        """Step ``step``'s K/V, once arrived; forgets them (post their forwarding exchange first). With a
        ``ring_landing.KVLanding``: the step's whole (K, V) where they landed whole, else None (its keys are
        read from the fused block's buffer)."""
        if step in self.kv:
            return self.kv.pop(step)
        got = self.pending.pop(step).wait()
        return self.landing.step_kv(step) if self.landing is not None else tuple(got)


def _ring_forward(q, k, v, ring, causal, layout, scale, backend, steps_per_launch=1):
    """The steps go in the groups of ``launch_groups(W, steps_per_launch)``, and the K/V of the steps up to
    n = the largest group beyond the current one travel while it computes; with the ``triton`` backend a
    group is one kernel launch (``distlab.kernels.triton_attention.flash_forward_blocks``)."""
    s = q.shape[1]
    out = lse = None  # step 0 (own K/V) always covers every query row, and starts the accumulators
    final = torch.empty_like(q) if backend == "triton" else None   # written by each row's last block
    schedule = later = None   # the triton launch's blocks per step (the others go by ``group_plans``)
    if final is not None:
        schedule = [ring_blocks((ring.rank - step) % ring.size, ring.rank, s, causal, layout)
                    for step in range(ring.size)]
        later = later_blocks(schedule)
    # other backends: block results held back and merged MERGE_BLOCKS at a time (one launch each)
    group = _merge_group(q, backend) if final is None else 0
    pending = [] if group else None
    shape = (ring.rank, ring.size, s, causal, layout, steps_per_launch, fuse_cap() if final is None else 0)
    groups = group_plans(*shape)
    landing = kv_landing(ring, k, shape) if ring.size > 1 and use_landing(k, v, backend, groups) else None
    kv = _KVAhead(ring, (k, v), landing)
    ahead = max(len(g) for g, _ in groups)
    block_forward = _block_forward(backend)
    kept = kept_forward(shape, q, k, scale) if backend == "fa4" and pending is not None else None   # ring_kept
    n_block = n_merge = n_pass = 0
    early = point = side = ready = None   # the earlier blocks merged beside the last one (``ring_merge_early``)
    if pending is not None and ring_merge_early.wanted(q):
        point = ring_merge_early.early_point(tuple((rows.start, rows.stop) for _, plan in groups
                                                   for rows, _, _ in plan), s, group)
    for g, (steps, plan) in enumerate(groups):
        with phase("ring.exchange"):
            kv.post_through(steps[-1] + ahead)   # the next groups' K/V, while this one computes
        with phase("ring.wait"):
            got = {step: kv.get(step) for step in steps}
        if final is not None:
            blocks = [(step, i, rows, _seq_part(got[step][0], cols), _seq_part(got[step][1], cols), blk_causal)
                      for step in steps for i, (rows, cols, blk_causal) in enumerate(schedule[step])]
            if blocks:
                out, lse = _triton_blocks_into(out, lse, final, q, blocks, schedule, scale, later)
            continue
        for i, (rows, blk_causal, pieces) in enumerate(plan):   # a group's runs over one row range: one call
            landed = landing.run_kv(g, i) if landing is not None else None   # (``fuse_plan``; ``ring_landing``)
            k_blk, v_blk = landed if landed is not None else group_kv(got, pieces)
            if pending is None:
                out, lse = _block_into(out, lse, q, k_blk, v_blk, rows, blk_causal, scale, backend)
                continue
            with phase("ring.block"):
                if kept is not None:
                    o, l = kept.block(n_block, _seq_part(q, rows), k_blk, v_blk, blk_causal, scale)
                    n_block += 1
                else:
                    o, l = block_forward(_seq_part(q, rows), k_blk, v_blk, blk_causal, scale)
            if len(pending) == group and point is None:   # a full group merges once another block follows it:
                # the last group merges writing q's dtype (H100: a W=8 rank's last 4 blocks merged, then converted
                # alone, 49 + 35 µs at S32768); an early merge's pass has a single group (``early_point``)
                if kept is not None:
                    out, lse = kept.merge(n_merge, out, lse, pending, q, last=False)
                    n_merge += 1
                else:
                    out, lse = _merge_pending(out, lse, pending, q, last=False)
            pending.append((o if o.stride(-1) == 1 else o.contiguous(), l if l.stride(-1) == 1 else l.contiguous(),
                            rows.start, rows.stop))
            if point is not None and n_pass == point[0]:   # the earlier blocks are queued: their end marked
                side = _merge_side_stream(q) if q.is_cuda else None
                ready = ring_merge_early.mark(side)
            elif point is not None and n_pass == point[0] + 1:   # after the last block's launch: its CTAs first
                last = pending.pop()
                early = ring_merge_early.merge_early(pending, q, point[1], side, ready)
                pending.append(last)
            n_pass += 1
    if early is not None:
        return ring_merge_early.merge_last(early, pending, q)
    if kept is not None:
        return kept.merge(n_merge, out, lse, pending, q, last=True)
    if pending is not None:
        return _merge_pending(out, lse, pending, q, last=True)
    return (final if final is not None else out.to(q.dtype)), lse


def fuse_plan(schedule, steps, max_keys=0):
    """A launch group's blocks as ``[(rows, causal, [(step, cols), ...])]``: runs of non-causal blocks over the
    same rows (in step order) joined into one block whose keys are their ``cols`` of each step's K/V,
    concatenated (keys have no order in a non-causal block). A backend with no in-kernel accumulation (FA4,
    cuDNN) then makes one call, one merge entry and one backward for the run instead of one per ring step:
    on zigzag's busiest rank (0) every later step has the same rows (the second chunk), so W=8 in groups of
    4 (0 | 1 2 3 | 4 5 6 7) is three calls, not eight. ``schedule``: per step, blocks starting
    ``(rows, cols, causal)``. ``max_keys`` (> 0): a run is cut before it would pass that many keys (knob
    ``DISTLAB_RING_FUSE_MAX_KEYS``, ``fuse_cap``)."""
    plan = []
    for step in steps:
        for rows, cols, causal, *_ in schedule[step]:
            if plan and not causal and not plan[-1][1] and plan[-1][0] == rows and (
                    max_keys <= 0 or sum(c.stop - c.start for _, c in plan[-1][2]) + cols.stop - cols.start
                    <= max_keys):
                plan[-1][2].append((step, cols))
            else:
                plan.append((rows, causal, [(step, cols)]))
    return plan


@functools.lru_cache(maxsize=256)
def group_plans(rank: int, world: int, seq: int, causal: bool, layout: str, steps_per_launch, max_keys=0) -> tuple:
    """``((steps, fuse_plan), ...)`` per launch group of rank ``rank``'s ring (forward and backward), worked out
    once per ring shape."""
    schedule = [ring_blocks((rank - step) % world, rank, seq, causal, layout) for step in range(world)]
    return tuple((steps, fuse_plan(schedule, steps, max_keys)) for steps in launch_groups(world, steps_per_launch))


# No cap by default (H100, 2026-12-05, W=8 zigzag 32 q / 8 kv, `gpu_host_check.sh OUT fa4cap`, docs/PERF.md): at
# S32768 FA4's backward kernel over a fused block of 3 or 4 steps (12288 / 16384 keys against 2048 rows) ran 586 /
# 578 µs a step against 550 for one step's 4096 keys (more key tiles adding into the same rows' dQ), but a cap of
# 8192 (pairs) made the rank slower, not faster: f+b GPU 7.03 ms capped, 6.91 uncapped, 6.97 / 7.03 one step a
# launch (the forward's fused blocks are what pays: 1.62 ms uncapped against 1.72 capped).
def fuse_cap() -> int:
    """The knob ``DISTLAB_RING_FUSE_MAX_KEYS``, checked: keys at most in one fused block (0: no cap)."""
    n = knobs.get("RING_FUSE_MAX_KEYS")
    if not n.isdigit():
        raise ValueError(f"DISTLAB_RING_FUSE_MAX_KEYS={n!r}: a number of keys (0: no cap)")
    return int(n)


def group_kv(got, pieces):
    """The K and V of a ``fuse_plan`` block: each piece's ``cols`` of its step's K/V (``got[step]``), joined
    along the sequence when there are several."""
    ks = [_seq_part(got[step][0], cols) for step, cols in pieces]
    vs = [_seq_part(got[step][1], cols) for step, cols in pieces]
    if len(pieces) == 1:
        return ks[0], vs[0]
    return torch.cat(ks, 1), torch.cat(vs, 1)


def _block_forward(backend):
    """What a ring step calls for a block's (out, LSE): FA4's wrapper itself for ``fa4`` (the ring checked its
    inputs and resolved the backend once; ``attention_forward``'s checks and resolution cost ~7 µs of host a
    step, #24), ``attention_forward`` for the others."""
    if backend == "fa4":
        from distlab.kernels.fa4 import fa4_forward

        return fa4_forward
    return lambda q, k, v, causal, scale: attention_forward(q, k, v, causal, scale, backend)


def _merge_group(q, backend) -> int:
    """How many block results a backend that cannot accumulate (cuDNN, FA4, ...) merges per Triton launch
    (``lse_merge_blocks_``, the last merge writing q's dtype): knob ``DISTLAB_RING_MERGE_BLOCKS`` (default
    ``MERGE_BLOCKS`` = 4), given float32 running results, a power-of-two head_dim and Triton running on q's
    device (CUDA, or the CPU's interpreter); 0: merge each block as it comes (``_block_into``)."""
    d = q.shape[-1]
    if backend == "triton" or q.dtype == torch.float64 or d & (d - 1) or not triton_runs_on(q.device):
        return 0
    n = knobs.get("RING_MERGE_BLOCKS")
    if not n.isdigit() or int(n) > MERGE_BLOCKS:
        raise ValueError(f"DISTLAB_RING_MERGE_BLOCKS={n!r}: use 0 to {MERGE_BLOCKS}")
    return int(n)


def _merge_side_stream(q):
    """The side stream of the ring's dK/dV adds (``distlab.cp.ring_fused``), for the forward's early merges."""
    from distlab.cp.ring_fused import _side_stream

    return _side_stream(q.device)


def _merge_pending(out, lse, pending, q, last):
    """Merge the block results held back (``[(o, lse, lo, hi)]``) into the running (out, lse) in one launch,
    creating them at the first merge; the last merge writes the output in q's dtype. Empties ``pending``."""
    from distlab.kernels.lse_merge import lse_merge_blocks_

    has_acc = out is not None
    final = torch.empty_like(q) if last else None
    if not has_acc:
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
        out = final if last else torch.empty(q.shape, dtype=torch.float32, device=q.device)
    with phase("ring.merge"):
        out, lse = lse_merge_blocks_(out, lse, pending, has_acc=has_acc, final=final)
    pending.clear()
    return out, lse


def _seq_part(t, index: slice):
    """``t[:, index]``, or ``t`` itself when the slice takes every row (a view costs a microsecond or two of host
    time on every ring step)."""
    return t if index.start == 0 and index.stop == t.shape[1] else t[:, index]


def _accumulate(acc, part, index, like, dtype):
    """``acc[:, index] += part`` in ``dtype``, creating ``acc`` on first use (no zero-fill when it's whole)."""
    if acc is None:
        if index.start == 0 and index.stop == like.shape[1]:
            return part.to(dtype)
        acc = torch.zeros(like.shape, dtype=dtype, device=like.device)
    acc[:, index] += part
    return acc


def _triton_block_backward(dq, dout, q, k, v, back_rows, rows, cols, causal, scale, received=None, row_views=None,
                           steps=None, final=None):
    """The ``triton`` backend's block backward: dQ added into the float32 ``dq`` inside its kernel (written at
    step 0, whose block covers every row, so ``dq`` starts unfilled), the backward rows (delta, exp2 LSE)
    computed once per ring backward — no per-step conversions. dK/dV: at step 0 written in float32 into new
    step accumulators (zeros where the block has no keys; a step has at
    most one block); at a later step added into the accumulator ``received`` from the previous rank, whose
    wait comes after this step's dK/dV kernel is launched (the dQ kernel's programs then add the step's dK/dV,
    or the sum of its split partials, into it: ``flash_backward``'s ``dkv_into``).
    ``row_views``: a dict kept for one ring backward, holding the row views of a row range once made (the
    zigzag steps after the first share one range); ``steps``: the ``BackwardSteps`` of one ring backward (the
    query side's plan key once, the later steps' dK/dV buffers lent). ``final = (dq_final, lo, hi)``: the
    block's rows [lo, hi) (relative to it) see no later block, so the dQ kernel writes their final dQ into
    ``dq_final`` (the shard's, q's dtype) instead of ``dq``. Returns the step's (dK, dV)."""
    from distlab.kernels.triton_attention_backward import flash_backward

    all_rows, all_cols = rows == slice(0, q.shape[1]), cols == slice(0, k.shape[1])
    dq_final = None if final is None or final[1] == final[2] else final[0]
    if all_rows:   # no views where a block takes every row or key (each view is a microsecond or two of host)
        common = dict(rows=back_rows, dq_acc=dq)
    else:
        views = row_views.get((rows.start, rows.stop)) if row_views is not None else None
        if views is None:
            views = (back_rows[0][:, :, rows], back_rows[1][:, :, rows], dq[:, rows], dout[:, rows], q[:, rows],
                     final[0][:, rows] if final is not None else None)
            if row_views is not None:
                row_views[(rows.start, rows.stop)] = views
        common = dict(rows=views[:2], dq_acc=views[2])
        dout, q = views[3], views[4]
        dq_final = views[5] if dq_final is not None else None
    if dq_final is not None:
        common["dq_final"] = (dq_final, final[1], final[2])
    k_shape = k.shape
    if not all_cols:
        k, v = k[:, cols], v[:, cols]
    if received is None:
        if not all_rows:
            raise RuntimeError("the ring's first backward block must cover every query row (it writes dQ)")
        new = torch.empty if all_cols else torch.zeros
        dk_blk, dv_blk = (new(k_shape, dtype=torch.float32, device=k.device) for _ in range(2))
        with phase("ring.block_backward"):
            flash_backward(dout, q, k, v, None, None, causal, scale, dk_out=dk_blk if all_cols else dk_blk[:, cols],
                           dv_out=dv_blk if all_cols else dv_blk[:, cols], dq_add=False, steps=steps, **common)
        return dk_blk, dv_blk
    got = []

    def into():
        with phase("ring.wait"):
            got.extend(received.wait())
        return (got[0], got[1]) if all_cols else (got[0][:, cols], got[1][:, cols])

    with phase("ring.block_backward"):
        flash_backward(dout, q, k, v, None, None, causal, scale, dkv_into=into, steps=steps, **common)
    return got[0], got[1]


@functools.lru_cache(maxsize=256)
def backward_schedule(rank: int, world: int, seq: int, causal: bool, layout: str) -> tuple:
    """Per step, rank ``rank``'s blocks ``(rows, cols, causal, (lo, hi))``: ``ring_blocks`` with the rows of
    each block that no later block touches (``final_range``, relative to the block), worked out once per
    ring shape (host time, #24)."""
    schedule = [ring_blocks((rank - step) % world, rank, seq, causal, layout) for step in range(world)]
    later = later_blocks(schedule)
    return tuple(tuple((rows, cols, blk_causal, tuple(x - rows.start for x in final_range(
        schedule, (step, i), rows.start, rows.stop, later))) for i, (rows, cols, blk_causal) in enumerate(blocks))
        for step, blocks in enumerate(schedule))


def _fa4_kept(dout, q, k, out, lse, scale, causal, blocks, layout=None, beside=None, keep_scratch=False):
    """``FA4RingBackward`` (``distlab.kernels.fa4_ring_backward``: FA4's kernels one by one, dQ's float32
    accumulator kept across the steps, dK/dV travelling in FA4's accumulator layout) where it applies, else
    None (the per-block ``attention_backward``). ``blocks``: every ``(rows, cols, causal)`` the ring will run;
    ``keep_scratch``: ``FA4RingBackward.prepare``'s."""
    from distlab.kernels import fa4_ring_backward

    if not fa4_ring_backward.usable(q, k, blocks, q.dtype):
        return None
    kept = fa4_ring_backward.FA4RingBackward(dout, q, out, lse, k, scale, causal, layout)
    kept.prepare(blocks, beside, keep_scratch)
    return kept


def _ring_backward(dout, q, k, v, out, lse, ring, causal, layout, scale, backend, steps_per_launch=1,
                   dkv_route="ring"):
    """(dq, dk, dv) of this rank's shard. ``steps_per_launch``: as the forward's; for a backend other than
    ``triton`` launch groups of several steps run by ``distlab.cp.ring_fused`` (fused blocks), else step by
    step. ``dkv_route``: ``ring`` or ``direct`` (fused only, ``distlab.cp.ring_dkv_direct``)."""
    if fused_backward(backend, ring.size, steps_per_launch):
        from distlab.cp.ring_fused import ring_backward_groups

        return ring_backward_groups(dout, q, k, v, out, lse, ring, causal, layout, scale, backend, steps_per_launch,
                                    dkv_route)
    if dkv_route != "ring" and ring.size > 1:
        raise ValueError(f"dkv_route={dkv_route!r} needs the fused ring backward ({FUSED_HELP})")
    s = q.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq, kv, dkv_pending, back_rows, row_views, steps = None, (k, v), None, None, {}, None
    schedule = backward_schedule(ring.rank, ring.size, s, causal, layout)
    dq_final = None
    if backend == "triton":
        from distlab.kernels.triton_attention_backward import BackwardSteps, backward_rows, dq_kernel_mode

        back_rows, steps = backward_rows(dout, out, lse), BackwardSteps()
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)   # written by step 0's dQ kernel
        if dq_kernel_mode():   # each row's final dQ written in q's dtype by its last block's dQ kernel
            dq_final = torch.empty_like(q, memory_format=torch.contiguous_format)
    kept = _fa4_kept(dout, q, k, out, lse, scale, causal, [blk[:3] for step in schedule for blk in step], layout) \
        if backend == "fa4" else None
    for step in range(ring.size):
        with phase("ring.exchange"):
            kv_pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        dk_blk = dv_blk = None
        parts = []   # other backends, a later step: the block's (cols, dK, dV), added once the accumulator is here
        for rows, cols, blk_causal, (lo, hi) in schedule[step]:
            if back_rows is not None:   # a later step adds into the received accumulator (then no wait below)
                dk_blk, dv_blk = _triton_block_backward(dq, dout, q, *kv, back_rows, rows, cols, blk_causal, scale,
                                                        received=dkv_pending, row_views=row_views, steps=steps,
                                                        final=(dq_final, lo, hi) if dq_final is not None else None)
                dkv_pending = None
                continue
            if kept is not None:   # FA4's kernels, dQ kept in float32 across steps, dK/dV as FA4 accumulates them
                with phase("ring.block_backward"):   # (dK and dV in one float32 tensor, leading dimension 2)
                    dkv_b = kept.block(*kv, rows, cols, blk_causal)
                if step > 0:
                    parts.append((cols, dkv_b, None))
                elif dk_blk is None and cols == slice(0, k.shape[1]):   # my own block starts the accumulator
                    dk_blk = kept.own_accumulator(dkv_b)
                else:
                    raise RuntimeError("the ring's first backward step must be one block over every local key")
                continue
            with phase("ring.block_backward"):
                dq_b, dk_b, dv_b = attention_backward(dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols],
                                                      out[:, rows], lse[:, :, rows], blk_causal, scale, backend)
            dq = _accumulate(dq, dq_b, rows, q, acc)
            if step == 0:   # my own block starts its accumulator
                dk_blk = _accumulate(dk_blk, dk_b, cols, k, acc)
                dv_blk = _accumulate(dv_blk, dv_b, cols, v, acc)
            else:
                parts.append((cols, dk_b, dv_b))
        if step == 0 or back_rows is not None and dk_blk is not None:   # my own block; or triton added it
            dkv = (dk_blk,) if kept is not None else (dk_blk, dv_blk)
        else:                                # the accumulator for block src, from the previous rank
            dkv = dkv_pending.wait()
            for cols, dk_b, dv_b in parts:   # added in its dtype: one launch each, no float32 copy first
                if kept is not None:   # dK and dV in one add
                    kept.add_into(dkv[0], cols, dk_b)
                    continue
                _seq_part(dkv[0], cols).add_(dk_b)
                _seq_part(dkv[1], cols).add_(dv_b)
        if ring.size > 1:
            dkv_pending = ring.exchange(dkv, "ring_dkv")
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    if dkv_pending is not None:
        dkv = dkv_pending.wait()
    if kept is not None:
        return (kept.dq(), *kept.finish_dkv(dkv[0], k, v))
    return (dq_final if dq_final is not None else dq.to(q.dtype)), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


FUSED_HELP = "a backend other than triton, launch groups of several steps: steps_per_launch > 1"


def fused_backward(backend, world, steps_per_launch) -> bool:
    """The ring backward goes by fused launch groups (``distlab.cp.ring_fused``)."""
    return backend != "triton" and any(len(g) > 1 for g in launch_groups(world, steps_per_launch))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, layout, scale, backend, steps_per_launch, dkv_route="ring"):
        out, lse = _ring_forward(q, k, v, ring, causal, layout, scale, backend, steps_per_launch)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, causal, layout, scale, backend, steps_per_launch, dkv_route)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


# Steps per launch where it was measured to pay (docs/PERF-archive.md, ring16: the triton forward of one W8 rank,
# 0 | 1 | 2 ... 7 one step a launch against 0 | 1 2 3 | 4 5 6 7: 116.0% -> 127.4% of the fused H/W call at
# S8192, 89.1% -> 91.5% at S32768); it keeps up to 2n - 1 K/V blocks (W=8: every block) where the classic
# ring keeps two.
# FA4 and cuDNN: a group's blocks over one row range fused into one call, forward and backward (``fuse_plan``,
# ``distlab.cp.ring_fused``); H100 2026-12-05, W=8 zigzag 32 q / 8 kv, f+b wall against FA4's H/W call, groups of 1
# vs 4 (docs/PERF.md): fa4 S16384 64.9 / 72.6 / 73.6% -> 75.2 / 73.2 / 74.5% (three runs), S32768 84.0 / 82.1 /
# 85.1% -> 85.4 / 83.6 / 85.6%, GPU clock 83.3 -> 86.4%; sdpa-cudnn S32768 63.4 -> 66.9%.
STEPS_PER_LAUNCH = {"triton": 4, "fa4": 4, "sdpa-cudnn": 4}
# A packed ring's launch groups (``distlab.cp.packed_groups``) are opt-in: on the H100 (2026-12-05, 64k pack, W=8,
# masked Triton, docs/PERF.md) 0 | 1 2 3 | 4 5 6 7 was slower than one launch a step on both packs timed —
# balanced f+b 76.0% against 80.1% of one call (GPU clock; wall 59.7 against 75.0), units deal 68.1 against 73.4.
PACKED_STEPS_PER_LAUNCH: dict = {}
MAX_STEPS_PER_LAUNCH = 4   # distlab.kernels.triton_attention.MAX_BLOCKS


def launch_groups(world: int, steps_per_launch=1) -> list[range]:
    """The forward's ring steps grouped per launch. ``n`` (an int): step 0 alone — its K/V are local, so the
    first hop travels behind its compute, as in the classic ring — then the other W−1 steps in groups of n,
    the short group first (W=8: n=2 0 | 1 | 2 3 | 4 5 | 6 7; n=4 0 | 1 2 3 | 4 5 6 7), each group's K/V
    travelling while the groups before it compute. A sequence of sizes adding up to W: exactly those groups."""
    if isinstance(steps_per_launch, int):
        rest = world - 1
        sizes = [1] + ([rest % steps_per_launch] if rest % steps_per_launch else []) + \
            [steps_per_launch] * (rest // steps_per_launch)
    else:
        sizes = list(steps_per_launch)
        if sum(sizes) != world:
            raise ValueError(f"launch groups {steps_per_launch} do not add up to the ring size {world}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def check_steps_per_launch(steps_per_launch=None, backend=None, world=None, packed=False):
    """n in 1..4 (an int), or group sizes adding up to ``world`` (a tuple, or a string such as ``1,1,2,4``):
    from the argument, else ``STEPS_PER_LAUNCH[backend]`` (``PACKED_STEPS_PER_LAUNCH`` for a ring over packed
    documents; 1 for backends not listed). The studies pass the knob ``RING_STEPS_PER_LAUNCH``
    (``distlab.knobs``) here; the library never reads it."""
    defaults = PACKED_STEPS_PER_LAUNCH if packed else STEPS_PER_LAUNCH
    value = steps_per_launch if steps_per_launch is not None else defaults.get(backend, 1)
    sizes = str(value).split(",") if isinstance(value, (int, str)) else [str(x) for x in value]
    # Triton's launch takes at most MAX_STEPS_PER_LAUNCH blocks; a backend whose group is fused into one call
    # (FA4, cuDNN, torch: ``fuse_plan``) takes a group of any size
    cap = MAX_STEPS_PER_LAUNCH if packed or backend in (None, "triton") or world is None else max(world, 1)
    if not all(x.strip().isdigit() and 1 <= int(x) <= cap for x in sizes) \
            or (len(sizes) > 1 or not isinstance(value, (int, str))) and world is not None \
            and sum(map(int, sizes)) != world:   # a tuple of one size too: (3,) on W=4 would drop step 3
        raise ValueError(f"ring steps per launch: an integer from 1 to {cap}, or group sizes adding up to the "
                         f"ring size{f' ({world})' if world is not None else ''}"
                         f"{', at most 4 a group for triton' if cap == MAX_STEPS_PER_LAUNCH else ''}; got {value!r}")
    return int(sizes[0]) if len(sizes) == 1 and isinstance(value, (int, str)) else tuple(map(int, sizes))


def check_ring_inputs(q, k, v, world: int, causal: bool, layout: str, backend: str, masked: bool = False) -> str:
    """Validate on this rank, with no communication; return the concrete backend. Same answer on every rank."""
    check_layout(layout)
    check_qkv(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention needs q and k shards of one length; got {q.shape[1]} and {k.shape[1]}")
    if layout != "contiguous" and q.shape[1] % 2:
        raise ValueError(f"a {layout} shard holds two or more equal chunks, so its length must be even; "
                         f"got {q.shape[1]}")
    if world < 1:
        raise ValueError(f"world size must be >= 1; got {world}")
    resolved = resolve_backend(backend, q.device, q.dtype, masked=masked)
    if masked:
        return pick_packed_ring_backend(backend, resolved, layout, available_backends(q.device, q.dtype))
    return pick_ring_backend(backend, resolved, q.shape[1], available_backends(q.device, q.dtype))


# ``auto`` for a ring: FA4 blocks on long shards, the Triton kernel (in-kernel accumulation, several steps a
# launch, less host time a step) on short ones. W=8 zigzag, 32 q / 8 kv, f+b wall ms (docs/PERF.md): H100
# 2026-12-05, FA4's backward accumulators kept: shard 1024 tokens triton 1.09 vs fa4 1.19, shard 2048 fa4 2.12 vs
# triton 2.77, shard 4096 fa4 7.22 vs triton 9.97 (H200 2026-12-04, before: shard 1024 triton 99 vs fa4 38 TFLOP/s).
# With FA4's launch groups fused (H100, 2026-12-05, 14th session): shard 1024 fa4 0.83 vs triton 1.04 ms wall (one
# process, `h100_2026-12-05d/final/`), GPU clock 0.73 vs 0.97 ms: FA4 from shard 1024; shards of 512 unmeasured.
RING_TRITON_MAX_SHARD = 512


def pick_ring_backend(backend: str, resolved: str, shard: int, present) -> str:
    """The ring's block backend: what ``auto`` resolved to (the fastest single call), except ``triton`` for
    shards of at most ``RING_TRITON_MAX_SHARD`` tokens when FA4 was picked and Triton is present."""
    if backend == "auto" and resolved == "fa4" and "triton" in present and shard <= RING_TRITON_MAX_SHARD:
        return "triton"
    return resolved


def pick_packed_ring_backend(backend: str, resolved: str, layout: str, present) -> str:
    """A packed ring's block backend: what ``auto`` resolved to under a mask (FA4 where importable), except
    the masked Triton kernel for the ``balanced`` layout, whose ranks run many small blocks, each an FA4
    varlen call through its interface (H200, 64k pack, W=8, f+b: balanced on FA4 7.26 ms a rank against 6.24
    on Triton; zigzag on FA4 2.98 against 7.27, docs/PERF.md). An explicit choice is kept."""
    if backend == "auto" and resolved == "fa4" and layout == "balanced" and "triton" in present:
        return "triton"
    return resolved


def ring_attention(q, k, v, group=None, causal=False, layout="contiguous", backend="auto", softmax_scale=None,
                   return_lse=False, steps_per_launch=None, cu_seqlens=None, window=None, dkv_route="ring"):
    """Attention over the whole sequence, given this rank's shards (``distlab.cp.layout.shard_sequence``).

    q: ``(batch, seq/W, heads, head_dim)``; k, v: ``(batch, seq/W, kv_heads, head_dim)``. Returns this
    rank's shard of the output (and, with ``return_lse``, its float32 ``(batch, heads, seq/W)`` LSE).
    ``steps_per_launch`` (1 to 4, or group sizes adding up to W, at most 4 a group for ``triton``): the
    forward's steps per group (``launch_groups``) — with ``triton`` one kernel launch each; with FA4, cuDNN and
    torch each run of blocks over one row range one call, forward and backward (``fuse_plan``) — and the K/V
    blocks in flight; default 4 for ``triton``, ``fa4`` and ``sdpa-cudnn``, 1 for the others. With documents
    (default 1 for every backend: groups measured slower, ``PACKED_STEPS_PER_LAUNCH``) each group's seen keys
    are gathered and computed as one block, whatever the backend (``distlab.cp.packed_groups``).
    ``cu_seqlens`` (global document boundaries, the same on every rank) and ``window`` (keys at most that
    many positions back; causal only): packed documents, see ``distlab.cp.documents``. ``dkv_route``: how the
    backward's dK/dV reach their owner — ``ring`` (a float32 accumulator one hop a step) or ``direct`` (each
    rank's share sent straight to the owner and summed there: ``distlab.cp.ring_dkv_direct``; fused backward
    only, no documents).
    """
    from distlab.cp.ring_dkv_direct import check_route

    check_route(dkv_route)
    check_call_everywhere("ring_attention", group, q, k, v, causal, layout, cu_seqlens, window)
    ring = comm.RingExchanger(group)
    total = q.shape[1] * ring.size
    docs = Documents.from_args(total, cu_seqlens, causal, window)
    if docs.masked or layout == "balanced":
        if dkv_route != "ring":
            raise ValueError(f"dkv_route={dkv_route!r}: a packed or balanced ring sends dK/dV by the ring only")
        backend = check_ring_inputs(q, k, v, ring.size, causal, layout, backend, masked=True)
        steps_per_launch = check_steps_per_launch(steps_per_launch, backend, ring.size, packed=True)
        from distlab.cp.ring_packed import PackedRingAttention, step_blocks

        def build():
            positions = [shard_positions(total, ring.size, r, layout, docs.cu_seqlens) for r in range(ring.size)]
            return step_blocks(docs, positions, ring.rank, q.device, steps_per_launch=steps_per_launch)

        blocks = cached_plan("ring", docs, ring.size, ring.rank, layout, q.device, steps_per_launch, build=build)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out, lse = PackedRingAttention.apply(q, k, v, ring, blocks, scale, backend)
        return (out, lse) if return_lse else out
    backend = check_ring_inputs(q, k, v, ring.size, causal, layout, backend)
    steps_per_launch = check_steps_per_launch(steps_per_launch, backend, ring.size)
    if dkv_route != "ring" and ring.size > 1 and not fused_backward(backend, ring.size, steps_per_launch):
        raise ValueError(f"dkv_route={dkv_route!r} needs the fused ring backward ({FUSED_HELP}; backend "
                         f"{backend!r}, steps_per_launch {steps_per_launch})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _RingAttention.apply(q, k, v, ring, causal, layout, scale, backend, steps_per_launch, dkv_route)
    return (out, lse) if return_lse else out


if __name__ == "__main__":   # the study is this method's command line; run, not imported (no cycle)
    import runpy

    runpy.run_module("distlab.cp.study", init_globals={"ALGORITHM": "ring"}, run_name="__main__")
