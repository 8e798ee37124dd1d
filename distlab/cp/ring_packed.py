"""Ring attention over packed documents and sliding windows, in any layout (contiguous, zigzag, balanced).

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --docs lognormal:mean=1024,seed=0 --layout balanced --check

``ring_attention(q, k, v, group, causal, layout, cu_seqlens=..., window=...)`` runs here (and so does the
``balanced`` layout, which only documents make meaningful). It is the ring of ``distlab/cp/ring.py`` —
K/V travel from rank r to r+1 (W−1 exchanges forward), in the backward K/V again and a float32 dK/dV
accumulator that visits every rank and comes home (W exchanges) — with one difference: the block. At step
i this rank's queries, at global positions ``pos[me]``, meet the keys of rank ``src = me − i``, at
``pos[src]``, through a ``KeyMask`` (``distlab.cp.documents``). A step whose block has no visible pair
launches no kernel (its K/V still travel on: the next rank needs them), and a step computes and merges only
the runs of rows that see some of its keys (``step_blocks``): with documents most rows see nothing of most
other ranks, and merging the whole float32 output at every step cost more than the kernels on the H200
(docs/PERF.md). With the ``triton`` backend each block merges into the running (out, LSE) inside its kernel
(``_forward``), a row starting at its first block and written in q's dtype at its last, and the backward's
kernels add into float32 accumulators. Inside a block the kernel skips the keys the mask removes, so the
work follows the visible pairs, not T².

Every layout works because nothing here assumes where a position lives: the masks are computed from the
positions each layout assigns (``distlab.cp.layout.shard_positions``), the same on every rank.
"""

from __future__ import annotations

import torch

from distlab.kernels.lse_merge import lse_merge_, merge_into
from distlab.profiling import phase
from distlab.kernels.attention import attention_backward, attention_forward

ROW_GAP = 256   # rows that see nothing between two runs, below which the runs are computed as one


def row_runs(mask, gap: int = ROW_GAP) -> list[tuple[int, int]]:
    """The runs [a, b) of query rows that see some key of ``mask`` (runs closer than ``gap`` joined)."""
    k = mask.k_pos if mask.k_sorted else mask.k_pos.sort().values
    seen = ((torch.searchsorted(k, mask.q_hi) - torch.searchsorted(k, mask.q_lo)) > 0).nonzero().squeeze(1)
    if not seen.numel():
        return []
    cut = ((seen[1:] - seen[:-1]) > gap).nonzero().squeeze(1)    # a run ends where gap rows or more see nothing
    starts = torch.cat([seen[:1], seen[cut + 1]]).tolist()
    stops = (torch.cat([seen[cut], seen[-1:]]) + 1).tolist()
    return list(zip(starts, stops))


class StepBlocks(list):
    """``step_blocks``' result, a list: per ring step, its ``(a, b, mask)`` blocks. ``first``/``last``: per row of
    the shard, the number (in the order the forward runs them) of the first and the last block whose rows
    cover it, −1 for none (int32, on the device); ``untouched``: the rows no block covers (their output is
    0, their LSE −inf). The ``triton`` forward starts a row at its first block (no running result to read)
    and writes it in q's dtype at its last (no float32 copy to convert after)."""

    first: torch.Tensor
    last: torch.Tensor
    untouched: torch.Tensor


def step_blocks(docs, positions, rank, device, gap: int = ROW_GAP) -> StepBlocks:
    """Per ring step of rank ``rank``: the ``(a, b, mask)`` blocks of rows a..b that see that step's keys
    (an empty list: the step launches nothing)."""
    world = len(positions)
    steps = StepBlocks()
    rows = positions[rank].numel()
    first = torch.full((rows,), -1, dtype=torch.int32)
    last = torch.full((rows,), -1, dtype=torch.int32)
    number = 0
    for step in range(world):
        m = docs.mask(positions[rank], positions[(rank - step) % world])
        blocks = [(a, b, m.rows(a, b)) for a, b in row_runs(m, gap)]
        for a, b, blk in blocks:
            blk.seen_columns()   # found here, on the host: the kernels' key span needs no device sync
            first[a:b] = torch.where(first[a:b] < 0, number, first[a:b])
            last[a:b] = number
            number += 1
        steps.append([(a, b, blk.to(device)) for a, b, blk in blocks])
    steps.first, steps.last = first.to(device), last.to(device)
    steps.untouched = (first < 0).nonzero().squeeze(1).to(device)
    return steps


def block_into(out, lse, q, k, v, a, b, mask, scale, backend):
    """Rows a..b of q against one step's K/V under ``mask``, merged into the running (out, lse) in place:
    ``backend`` (concrete, as ``ring_attention`` resolved it) computes the block, then ``merge_rows``."""
    o, l = attention_forward(q[:, a:b], k, v, False, scale, backend, mask=mask)
    merge_rows(out, lse, o, l, a, b)


def merge_rows(out, lse, o, l, a, b):
    """Merge a block of rows a..b into the float32 running (out, lse) in place (one Triton launch on CUDA)."""
    if out.is_cuda and not out.shape[-1] & (out.shape[-1] - 1):
        lse_merge_(out[:, a:b], lse[:, :, a:b], o, l)
    else:
        merge_into(out, lse, o, l, slice(a, b))


def _forward(q, k, v, ring, blocks, scale, backend):
    """The ``triton`` backend (float32 running results or below) merges each block inside its kernel
    (``masked_forward(accumulate=True)``: no merge launch, no block output in memory), starting a row at its
    first block and writing it in q's dtype at its last (``StepBlocks``: no zero fill, no conversion); the
    others compute each block, then ``merge_rows`` into zero-filled running results."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    fused = acc == torch.float32 and backend == "triton"
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    if fused:
        from distlab.kernels.triton_masked_attention import masked_forward

        out, final = torch.empty(q.shape, dtype=acc, device=q.device), torch.empty_like(q)
        lse = torch.empty(lse_shape, dtype=acc, device=q.device)
        if blocks.untouched.numel():   # rows no block covers: output 0, LSE -inf
            final.index_fill_(1, blocks.untouched, 0.0)
            lse.index_fill_(2, blocks.untouched, float("-inf"))
        block_scale = scale if scale is not None else q.shape[-1] ** -0.5
    else:
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(lse_shape, float("-inf"), dtype=acc, device=q.device)
    kv, number = (k, v), 0
    for step in range(ring.size):
        with phase("ring.exchange"):
            pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        for a, b, mask in blocks[step]:
            with phase("ring.block"):
                if fused:
                    masked_forward(q[:, a:b], kv[0], kv[1], mask, block_scale, out[:, a:b], lse[:, :, a:b],
                                   accumulate=True, order=(blocks.first[a:b], blocks.last[a:b], number),
                                   final_out=final[:, a:b])
                else:
                    block_into(out, lse, q, kv[0], kv[1], a, b, mask, scale, backend)
            number += 1
        if pending is not None:
            with phase("ring.wait"):
                kv = tuple(pending.wait())
    return (final if fused else out.to(q.dtype)), lse


def _backward(dout, q, k, v, out, lse, ring, blocks, scale, backend):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv, dkv_pending = (k, v), None
    # the triton backend adds each block's dQ and dK/dV into float32 accumulators inside its kernels, from
    # the backward rows (final LSE, rowsum(dO·O)) computed once for the shard
    fused = acc == torch.float32 and backend == "triton"   # backend: concrete (ring_attention resolved it)
    side = None
    if fused:
        from distlab.kernels.triton_masked_attention import masked_backward, masked_backward_rows

        back_rows = masked_backward_rows(dout, out, lse)
        block_scale = scale if scale is not None else q.shape[-1] ** -0.5
        side = dq_stream(q.device)
    for step in range(ring.size):
        with phase("ring.exchange"):
            kv_pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        part, span = None, slice(None)
        if fused and blocks[step]:   # this step's dK/dV, written or summed by the kernels in float32
            part = (torch.empty(k.shape, dtype=acc, device=k.device), torch.empty(v.shape, dtype=acc, device=v.device))
            # only the keys the step's blocks see are written and added on; step 0's part becomes the
            # accumulator of my K/V, so there every key (each row sees its own key: the span is all of them)
            seen = [c for c in (m.seen_columns() for _, _, m in blocks[step]) if c is not None]
            span = slice(min(c.start for c in seen), max(c.stop for c in seen)) if seen else slice(0, 0)
            whole = (span.start, span.stop) == (0, k.shape[1])
            only = len(blocks[step]) == 1 and (step > 0 or whole)   # a step's only block writes its keys: no fill
            if step == 0:
                span = slice(None)
            if not only:
                for t in part:
                    t[:, span].zero_()
            for a, b, mask in blocks[step]:
                with phase("ring.block_backward"):
                    masked_backward(dout[:, a:b], q[:, a:b], kv[0], kv[1], None, None, mask, block_scale,
                                    rows=(back_rows[0][:, :, a:b], back_rows[1][:, :, a:b]), dq_acc=dq[:, a:b],
                                    dk_acc=part[0], dv_acc=part[1], dkv_add=not only, dq_stream=side)
            if side is not None:   # this step's K/V are read there too: not reused before its dQ kernels ran
                for t in kv:
                    t.record_stream(side)
        elif not fused:
            for a, b, mask in blocks[step]:
                with phase("ring.block_backward"):
                    dq_b, dk_b, dv_b = attention_backward(dout[:, a:b], q[:, a:b], kv[0], kv[1], out[:, a:b],
                                                          lse[:, :, a:b], False, scale, backend, mask=mask)
                dq[:, a:b] += dq_b
                part = (dk_b.to(acc), dv_b.to(acc)) if part is None else (part[0].add_(dk_b), part[1].add_(dv_b))
        if step == 0:      # the accumulator of my own K/V starts here
            dkv = part if part is not None else tuple(torch.zeros(k.shape, dtype=acc, device=k.device)
                                                      for _ in range(2))
        else:              # the accumulator of rank src's K/V, from the previous rank: add mine
            dkv = tuple(dkv_pending.wait())
            if part is not None:
                dkv[0][:, span].add_(part[0][:, span])
                dkv[1][:, span].add_(part[1][:, span])
        if ring.size > 1:
            dkv_pending = ring.exchange(dkv, "ring_dkv")
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    if dkv_pending is not None:
        dkv = tuple(dkv_pending.wait())
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


_DQ_STREAMS: dict = {}


def dq_stream(device):
    """The CUDA stream a packed ring's backward runs its dQ kernels on, beside the dK/dV kernels of the same
    and later steps (knob ``DISTLAB_PACKED_DQ_STREAM``, default 1; None on the CPU or with 0). dQ stays on the
    rank; dK/dV travel on to the next rank: only they are on the ring's critical path, and the two kernels'
    partial last waves overlap instead of leaving SMs idle at each launch's end (docs/PERF.md)."""
    from distlab import knobs

    flag = knobs.get("PACKED_DQ_STREAM")
    if flag not in ("0", "1"):
        raise ValueError(f"DISTLAB_PACKED_DQ_STREAM={flag!r}: use 1 (dQ on a second stream) or 0")
    if device.type != "cuda" or flag == "0":
        return None
    if device not in _DQ_STREAMS:
        _DQ_STREAMS[device] = torch.cuda.Stream(device)
    return _DQ_STREAMS[device]


class PackedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, blocks, scale, backend):
        out, lse = _forward(q, k, v, ring, blocks, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, blocks, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None
