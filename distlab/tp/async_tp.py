"""Async TP: the SP all-gather and reduce-scatter split into ring steps that overlap the GEMMs.

    distlab run --nproc 4 -m distlab.tp --hidden 256 --ffn 512 --heads 8 --kv-heads 4 --seq 256 --sp --async-tp --check

With sequence parallelism a column layer all-gathers its input along the sequence before one big GEMM,
and a row layer reduce-scatters after one. Both split by sequence chunk, so each can run as tp ring steps
(``distlab.comm.RingExchanger``: send to rank+1, receive from rank−1) with the next chunk in flight while
the current chunk's GEMM runs:

- ``all_gather_matmul(x_local, w)``: at step i rank r holds chunk (r−i) mod tp and computes that block of
  the output; the next chunk is already travelling. Backward: the same ring brings the chunks again for
  dW (the gathered input is not kept: SP's memory saving survives), and dX is reduce-scattered by a ring
  whose accumulator picks up each rank's partial GEMM on the way.
- ``matmul_reduce_scatter(x, w)``: at step i rank r computes the partial product for chunk (r−1−i) mod tp
  and adds it to the accumulator that arrived for that chunk before passing it on; after tp−1 hops every
  chunk's accumulator is home. Backward: a ring all-gather of dY feeds dX and dW chunk by chunk.

Each forward makes tp−1 exchanges; the numbers equal the plain path's up to summation order.
"""

from __future__ import annotations

import torch

from distlab import comm
from distlab.profiling import phase


def _chunk(x, c, n):
    size = x.shape[1] // n
    return x[:, c * size:(c + 1) * size]


def _ring_gather(ring, x_local, on_chunk, op):
    """Call ``on_chunk(c, x_c)`` for every rank's chunk c, passing chunks around the ring meanwhile."""
    cur = x_local
    for step in range(ring.size):
        pending = ring.exchange([cur], op) if step < ring.size - 1 else None
        with phase("tp.block"):
            on_chunk((ring.rank - step) % ring.size, cur)
        if pending is not None:
            with phase("tp.wait"):
                cur = pending.wait()[0]


def _ring_reduce_scatter(ring, partial, op):
    """Sum over ranks of ``partial(c)`` for this rank's chunk c; partials computed while accumulators travel."""
    acc, pending = None, None
    for step in range(ring.size):
        c = (ring.rank - 1 - step) % ring.size
        with phase("tp.block"):
            part = partial(c)                   # computed while the previous accumulator travels
        if pending is None:
            acc = part
        else:
            with phase("tp.wait"):
                acc = pending.wait()[0].add_(part)
        if step < ring.size - 1:
            with phase("tp.exchange"):
                pending = ring.exchange([acc], op)
    return acc


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, weight, group):
        ring = comm.RingExchanger(group)
        n = ring.size
        b, s, _ = x_local.shape
        out = x_local.new_empty(b, s * n, weight.shape[0])
        _ring_gather(ring, x_local, lambda c, xc: _chunk(out, c, n).copy_(xc @ weight.t()), "async_tp_ag")
        ctx.save_for_backward(x_local, weight)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dy):
        x_local, weight = ctx.saved_tensors
        ring, n = ctx.ring, ctx.ring.size
        dw = torch.zeros_like(weight)

        def add_dw(c, xc):
            dy_c = _chunk(dy, c, n)
            dw.addmm_(dy_c.reshape(-1, dy_c.shape[-1]).t(), xc.reshape(-1, xc.shape[-1]))

        _ring_gather(ring, x_local, add_dw, "async_tp_ag")
        dx = _ring_reduce_scatter(ring, lambda c: _chunk(dy, c, n) @ weight, "async_tp_rs")
        return dx, dw, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        ring = comm.RingExchanger(group)
        n = ring.size
        out = _ring_reduce_scatter(ring, lambda c: _chunk(x, c, n) @ weight.t(), "async_tp_rs")
        ctx.save_for_backward(x, weight)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dy_local):
        x, weight = ctx.saved_tensors
        ring, n = ctx.ring, ctx.ring.size
        dx = torch.empty_like(x)
        dw = torch.zeros_like(weight)

        def on_chunk(c, dy_c):
            _chunk(dx, c, n).copy_(dy_c @ weight)
            x_c = _chunk(x, c, n)
            dw.addmm_(dy_c.reshape(-1, dy_c.shape[-1]).t(), x_c.reshape(-1, x_c.shape[-1]))

        _ring_gather(ring, dy_local.contiguous(), on_chunk, "async_tp_ag")
        return dx, dw, None


def all_gather_matmul(x_local, weight, group=None):
    """``all_gather(x_local, seq) @ weight.T`` as overlapped ring steps; x_local ``(batch, seq/tp, in)``."""
    if comm.group_size(group) == 1:
        return x_local @ weight.t()
    return _AllGatherMatmul.apply(x_local.contiguous(), weight, group)


def matmul_reduce_scatter(x, weight, group=None):
    """``reduce_scatter(x @ weight.T, seq)`` as overlapped ring steps; x ``(batch, seq, in/tp)``."""
    n = comm.group_size(group)
    if n == 1:
        return x @ weight.t()
    if x.shape[1] % n:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {n}")
    return _MatmulReduceScatter.apply(x.contiguous(), weight, group)
