"""Ulysses attention (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards and back.

    distlab run --nproc 4 -m distlab.cp.ulysses --seq 8192 --check
    torchrun --nproc-per-node 8 -m distlab.cp.ulysses --seq 65536 --heads 32 --kv-heads 8 --head-dim 128

Each of the W ranks holds a contiguous shard of the sequence with all heads. One all-to-all per tensor
turns that into the whole sequence for H/W heads; the ordinary one-device kernel runs on it (no merge:
every rank sees every key of its heads); one all-to-all turns the output back into sequence shards.
Forward: 4 all-to-alls (q, k, v, out), backward: 4 (dout, dq, dk, dv), each sending (W−1)/W of the
local tensor. The degree is capped by the head count: W must divide the q heads.

GQA beyond the kv heads: when W does not divide the kv heads, each kv head is replicated f = W/gcd(kv, W)
times first (kv' = lcm(kv, W) heads, which W divides, and q head h still reads a copy of kv head
h // (H/kv)); autograd sums the copies' gradients. So the degree can go up to the q-head count.

Layouts: with the contiguous layout the gathered sequence is in order and the kernel's own causal flag
does; with zigzag or balanced shards, packed documents (``cu_seqlens=``) or a ``window``, the kernel gets a
``KeyMask`` built from every rank's global positions (``distlab.cp.documents``), which holds whatever order
the all-to-all gathered the sequence in.
"""

from __future__ import annotations

import math

import torch

from distlab import comm
from distlab.cp.documents import Documents, cached_plan, check_call_everywhere
from distlab.cp.layout import check_layout, shard_positions
from distlab.kernels.attention import attention, check_qkv, resolve_backend
from distlab.profiling import phase


def kv_replication(heads: int, kv_heads: int, degree: int) -> int:
    """How many times each kv head is repeated so ``degree`` divides the kv heads (1 when it already does).

    Raises ValueError when ``degree`` does not divide the q heads.
    """
    if heads % degree:
        raise ValueError(f"the Ulysses degree {degree} must divide the number of q heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    return degree // math.gcd(kv_heads, degree)


def check_ulysses_inputs(q, k, v, degree: int, backend: str, masked: bool = False) -> str:
    """Validate on this rank with no communication; return the concrete backend."""
    check_qkv(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"Ulysses needs q and k shards of one length; got {q.shape[1]} and {k.shape[1]}")
    kv_replication(q.shape[2], k.shape[2], degree)
    return resolve_backend(backend, q.device, q.dtype, masked=masked)


def to_head_shards(q, k, v, group):
    """(b, s/W, h, d) sequence shards -> (b, s, h/W, d) head shards; kv heads replicated when needed."""
    n = comm.group_size(group)
    f = kv_replication(q.shape[2], k.shape[2], n)
    if f > 1:
        k, v = k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)
    return tuple(comm.all_to_all(t, group, scatter_dim=2, gather_dim=1) for t in (q, k, v))


def to_sequence_shards(out, group):
    """(b, s, h/W, d) head shards -> (b, s/W, h, d) sequence shards."""
    return comm.all_to_all(out, group, scatter_dim=1, gather_dim=2)


def _sequence_mask(docs, world, layout, device):
    """(mask, order): the whole sequence's mask, and the permutation that puts the gathered sequence (every
    rank's positions, in rank order) in position order (None when it already is)."""
    pos = torch.cat([shard_positions(docs.total, world, r, layout, docs.cu_seqlens) for r in range(world)])
    order = torch.argsort(pos).to(device) if bool((pos[1:] < pos[:-1]).any()) else None
    return docs.mask(torch.arange(docs.total), torch.arange(docs.total), device), order


def ulysses_attention(q, k, v, group=None, causal=False, backend="auto", softmax_scale=None, layout="contiguous",
                      cu_seqlens=None, window=None):
    """Attention over the whole sequence, given this rank's shards (differentiable).

    q: ``(batch, seq/W, heads, head_dim)``; k, v: ``(batch, seq/W, kv_heads, head_dim)``. Returns this
    rank's ``(batch, seq/W, heads, head_dim)`` output shard. ``layout``: how the shards were cut
    (``distlab.cp.layout``); ``cu_seqlens`` / ``window``: packed documents (``distlab.cp.documents``).
    """
    check_call_everywhere("ulysses_attention", group, q, k, v, causal, layout, cu_seqlens, window)
    world = comm.group_size(group)
    check_layout(layout)
    docs = Documents.from_args(q.shape[1] * world, cu_seqlens, causal, window)
    masked = docs.masked or (causal and layout != "contiguous")
    backend = check_ulysses_inputs(q, k, v, world, backend, masked=masked)
    mask = order = None
    if masked:
        mask, order = cached_plan("ulysses", docs, world, layout, q.device,
                                  build=lambda: _sequence_mask(docs, world, layout, q.device))
    with phase("ulysses.all_to_all"):
        qh, kh, vh = to_head_shards(q, k, v, group)
    if order is not None:
        qh, kh, vh = (t.index_select(1, order) for t in (qh, kh, vh))
    with phase("ulysses.attention"):
        out = attention(qh, kh, vh, causal and mask is None, softmax_scale, backend, mask=mask)
    if order is not None:
        out = out.index_select(1, torch.argsort(order))
    with phase("ulysses.all_to_all"):
        return to_sequence_shards(out, group)


if __name__ == "__main__":   # the study is this method's command line; run, not imported (no cycle)
    import runpy

    runpy.run_module("distlab.cp.study", init_globals={"ALGORITHM": "ulysses"}, run_name="__main__")
