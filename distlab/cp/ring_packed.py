"""Ring attention over packed documents and sliding windows, in any layout (contiguous, zigzag, balanced).

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --docs lognormal:mean=1024,seed=0 --layout balanced --check

``ring_attention(q, k, v, group, causal, layout, cu_seqlens=..., window=...)`` runs here (and so does the
``balanced`` layout, which only documents make meaningful). It is the ring of ``distlab/cp/ring.py`` —
K/V travel from rank r to r+1 (W−1 exchanges forward), in the backward K/V again and a float32 dK/dV
accumulator that visits every rank and comes home (W exchanges) — with one difference: the block. At step
i this rank's queries, at global positions ``pos[me]``, meet the keys of rank ``src = me − i``, at
``pos[src]``, through a ``KeyMask`` (``distlab.cp.documents``). A step whose block has no visible pair
launches no kernel (its K/V still travel on: the next rank needs them); inside a block the kernel skips the
rows and keys the mask removes, so the work follows the visible pairs, not T².

Every layout works because nothing here assumes where a position lives: the masks are computed from the
positions each layout assigns (``distlab.cp.layout.shard_positions``), the same on every rank.
"""

from __future__ import annotations

import torch

from distlab.cp.merge import merge_attention
from distlab.profiling import phase
from distlab.kernels.attention import attention_backward, attention_forward


def step_masks(docs, positions, rank, device):
    """The KeyMask of each ring step of rank ``rank`` (None where the block has no visible pair)."""
    world = len(positions)
    masks = []
    for step in range(world):
        m = docs.mask(positions[rank], positions[(rank - step) % world])
        masks.append(m.to(device) if m.visible_pairs() else None)
    return masks


def _forward(q, k, v, ring, masks, scale, backend):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    kv = (k, v)
    for step in range(ring.size):
        with phase("ring.exchange"):
            pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        if masks[step] is not None:
            with phase("ring.block"):
                o, l = attention_forward(q, kv[0], kv[1], False, scale, backend, mask=masks[step])
            with phase("ring.merge"):
                out, lse = merge_attention(out, lse, o, l)
        if pending is not None:
            with phase("ring.wait"):
                kv = tuple(pending.wait())
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, ring, masks, scale, backend):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv, dkv_pending = (k, v), None
    for step in range(ring.size):
        with phase("ring.exchange"):
            kv_pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        part = None
        if masks[step] is not None:
            with phase("ring.block_backward"):
                dq_b, dk_b, dv_b = attention_backward(dout, q, kv[0], kv[1], out, lse, False, scale, backend,
                                                      mask=masks[step])
            dq += dq_b
            part = (dk_b.to(acc), dv_b.to(acc))
        if step == 0:      # the accumulator of my own K/V starts here
            dkv = part if part is not None else tuple(torch.zeros(k.shape, dtype=acc, device=k.device)
                                                      for _ in range(2))
        else:              # the accumulator of rank src's K/V, from the previous rank: add mine
            dkv = tuple(dkv_pending.wait())
            if part is not None:
                dkv = (dkv[0].add_(part[0]), dkv[1].add_(part[1]))
        if ring.size > 1:
            dkv_pending = ring.exchange(dkv, "ring_dkv")
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    if dkv_pending is not None:
        dkv = tuple(dkv_pending.wait())
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class PackedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, masks, scale, backend):
        out, lse = _forward(q, k, v, ring, masks, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, masks, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None
