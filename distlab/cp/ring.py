"""Ring attention (contiguous or zigzag layout), forward and backward, and the ring study.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --check
    torchrun --nproc-per-node 8 -m distlab.cp.ring --seq 65536 --heads 32 --kv-heads 8 --head-dim 128 --check
    python -m distlab.cp.ring --seq 4096                     # one process: world size 1

Each of the W ranks holds a shard of q, k, v along the sequence. K/V blocks travel around the ring
(rank r sends to r+1, receives from r−1); at step i rank r holds the K/V of rank (r−i) mod W and merges
the block's (out, lse) into its running result through the log-sum-exp (``distlab.cp.merge``). The next
K/V exchange is posted before the current block is computed, so it overlaps the compute. The forward
makes W−1 K/V exchanges.

Backward: K/V travel the ring again, and so does a float32 (dK, dV) accumulator for the block being
visited; each rank adds its contribution to it (computed with the *global* out and lse, see
``kernels/attention.py``), and after W hops it is back home. That is W−1 K/V exchanges and W dK/dV
exchanges.

Causal attention: with the contiguous layout, blocks from later ranks are fully masked and skipped (rank
W−1 does W times rank 0's work). With zigzag (rank r holds chunks r and 2W−1−r) every step after the
first is exactly half a block: keys from an earlier rank are seen by all queries through their first
chunk only; keys from a later rank are seen only by the second query chunk, but whole. Every rank then
does the same work.
"""

from __future__ import annotations

import math

import torch

from distlab import comm
from distlab.cp.layout import check_layout
from distlab.cp.merge import merge_attention, merge_into
from distlab.profiling import phase
from kernels.attention import attention_backward, attention_forward, check_qkv, resolve_backend, triton_runs_on


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


def final_rows(schedule, step, index):
    """The rows of block ``index`` of step ``step`` that no later block touches, relative to the block, as
    ``(lo, hi)`` (``lo == hi``: none). ``schedule``: the ``ring_blocks`` of every step. The blocks of the ring
    layouts cover every row or a tail of the rows, so what a block leaves final is one range."""
    rows = schedule[step][index][0]
    later = [r for i, blocks in enumerate(schedule) for j, (r, _, _) in enumerate(blocks) if (i, j) > (step, index)]
    stop = min((r.start for r in later), default=rows.stop)
    if any(r.stop != rows.stop for r in later):
        raise ValueError("final_rows: later blocks must end where this one does")
    return 0, max(0, min(rows.stop, stop) - rows.start)


def _triton_block_into(out, lse, final, q, k, v, rows, causal, scale, final_range):
    """The ``triton`` backend's step: the kernel merges the block into the float32 running (out, lse) and
    writes the rows that no later block touches (``final_range``) straight into ``final`` in q's dtype."""
    from kernels.triton_attention import flash_forward

    start = out is None
    if start:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    fin = final[:, rows] if final_range[1] > final_range[0] else None
    with phase("ring.block"):
        flash_forward(q[:, rows], k, v, causal, scale, out[:, rows], lse[:, :, rows], accumulate=not start,
                      final_out=fin, final_rows=final_range if fin is not None else None)
    return out, lse


def _block_into(out, lse, q, k, v, rows, causal, scale, backend):
    """Attention of q[:, rows] against k, v merged into the float32 running (out, lse); creates them at
    step 0 (whose block covers every row). Backends on CUDA merge with one Triton kernel
    (``kernels.lse_merge``), on CPU with ``merge_into`` (the ``triton`` backend: ``_triton_block_into``)."""
    with phase("ring.block"):
        o, l = attention_forward(q[:, rows], k, v, causal, scale, backend)
    with phase("ring.merge"):
        if out is None:
            return merge_attention(None, None, o, l)
        d = q.shape[-1]
        if q.is_cuda and out.dtype == torch.float32 and o.stride(-1) == 1 and not d & (d - 1) \
                and triton_runs_on(q.device):
            from kernels.lse_merge import lse_merge_

            lse_merge_(out[:, rows], lse[:, :, rows], o, l)
        else:
            merge_into(out, lse, o, l, rows)
    return out, lse


def _ring_forward(q, k, v, ring, causal, layout, scale, backend):
    s = q.shape[1]
    out = lse = None  # step 0 (own K/V) always covers every query row, and starts the accumulators
    schedule = [ring_blocks((ring.rank - step) % ring.size, ring.rank, s, causal, layout) for step in range(ring.size)]
    final = torch.empty_like(q) if backend == "triton" else None   # written by each row's last block
    kv = (k, v)
    for step in range(ring.size):
        with phase("ring.exchange"):
            pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        for i, (rows, cols, blk_causal) in enumerate(schedule[step]):
            k_blk, v_blk = kv[0][:, cols], kv[1][:, cols]
            if final is not None:
                out, lse = _triton_block_into(out, lse, final, q, k_blk, v_blk, rows, blk_causal, scale,
                                              final_rows(schedule, step, i))
            else:
                out, lse = _block_into(out, lse, q, k_blk, v_blk, rows, blk_causal, scale, backend)
        if pending is not None:
            with phase("ring.wait"):
                kv = tuple(pending.wait())
    return (final if final is not None else out.to(q.dtype)), lse


def _accumulate(acc, part, index, like, dtype):
    """``acc[:, index] += part`` in ``dtype``, creating ``acc`` on first use (no zero-fill when it's whole)."""
    if acc is None:
        if index.start == 0 and index.stop == like.shape[1]:
            return part.to(dtype)
        acc = torch.zeros(like.shape, dtype=dtype, device=like.device)
    acc[:, index] += part
    return acc


def _triton_block_backward(dq, dout, q, k, v, back_rows, rows, cols, causal, scale):
    """The ``triton`` backend's block backward: dQ added into the float32 ``dq`` inside its kernel, dK/dV
    written in float32 straight into new step accumulators (zeros where the block has no keys; a step has
    at most one block), the backward rows (delta, exp2 LSE) computed once per ring backward — no per-step
    conversions or adds."""
    from kernels.triton_attention_backward import flash_backward

    new = torch.empty if cols.start == 0 and cols.stop == k.shape[1] else torch.zeros
    dk_blk, dv_blk = (new(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
    with phase("ring.block_backward"):
        flash_backward(dout[:, rows], q[:, rows], k[:, cols], v[:, cols], None, None, causal, scale,
                       rows=(back_rows[0][:, :, rows], back_rows[1][:, :, rows]), dq_acc=dq[:, rows],
                       dk_out=dk_blk[:, cols], dv_out=dv_blk[:, cols])
    return dk_blk, dv_blk


def _ring_backward(dout, q, k, v, out, lse, ring, causal, layout, scale, backend):
    s = q.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq, kv, dkv_pending, back_rows = None, (k, v), None, None
    if backend == "triton":
        from kernels.triton_attention_backward import backward_rows

        back_rows = backward_rows(dout, out, lse)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for step in range(ring.size):
        with phase("ring.exchange"):
            kv_pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        src = (ring.rank - step) % ring.size
        dk_blk = dv_blk = None
        for rows, cols, blk_causal in ring_blocks(src, ring.rank, s, causal, layout):
            if back_rows is not None:
                dk_blk, dv_blk = _triton_block_backward(dq, dout, q, *kv, back_rows, rows, cols, blk_causal, scale)
                continue
            with phase("ring.block_backward"):
                dq_b, dk_b, dv_b = attention_backward(dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols],
                                                      out[:, rows], lse[:, :, rows], blk_causal, scale, backend)
            dq = _accumulate(dq, dq_b, rows, q, acc)
            dk_blk = _accumulate(dk_blk, dk_b, cols, k, acc)
            dv_blk = _accumulate(dv_blk, dv_b, cols, v, acc)
        if dkv_pending is None:              # step 0: my own block, always computed
            dkv = (dk_blk, dv_blk)
        else:                                # the accumulator for block src, from the previous rank
            dkv = dkv_pending.wait()
            if dk_blk is not None:
                dkv = (dkv[0].add_(dk_blk), dkv[1].add_(dv_blk))
        if ring.size > 1:
            dkv_pending = ring.exchange(dkv, "ring_dkv")
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    if dkv_pending is not None:
        dkv = dkv_pending.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, layout, scale, backend):
        out, lse = _ring_forward(q, k, v, ring, causal, layout, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, causal, layout, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def check_ring_inputs(q, k, v, world: int, causal: bool, layout: str, backend: str) -> str:
    """Validate on this rank, with no communication; return the concrete backend. Same answer on every rank."""
    check_layout(layout)
    check_qkv(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention needs q and k shards of one length; got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks, so its length must be even; got {q.shape[1]}")
    if world < 1:
        raise ValueError(f"world size must be >= 1; got {world}")
    return resolve_backend(backend, q.device, q.dtype)


def ring_attention(q, k, v, group=None, causal=False, layout="contiguous", backend="auto", softmax_scale=None,
                   return_lse=False):
    """Attention over the whole sequence, given this rank's shards (``distlab.cp.layout.shard_sequence``).

    q: ``(batch, seq/W, heads, head_dim)``; k, v: ``(batch, seq/W, kv_heads, head_dim)``. Returns this
    rank's shard of the output (and, with ``return_lse``, its float32 ``(batch, heads, seq/W)`` LSE).
    """
    ring = comm.RingExchanger(group)
    backend = check_ring_inputs(q, k, v, ring.size, causal, layout, backend)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _RingAttention.apply(q, k, v, ring, causal, layout, scale, backend)
    return (out, lse) if return_lse else out


if __name__ == "__main__":
    from distlab.cp.study import main

    main(algorithm="ring")
