"""All-gather-KV context parallelism (Llama 3's): gather K/V, attend the local queries, reduce-scatter dK/dV.

    distlab run --nproc 4 -m distlab.cp.allgather --seq 8192 --check
    distlab run --nproc 4 -m distlab.cp.allgather --seq 8192 --docs lognormal:mean=1024,seed=0 --window 2048 --check

Each rank keeps its queries and receives every rank's K/V: one all-gather of K and V (under GQA a fraction
of q's size), then one attention of the local queries against all keys through a ``KeyMask`` built from
the layout's positions, so causality, documents and windows hold in any layout (zigzag balances causal
work; ``balanced`` balances documents). The backward computes dQ locally and the full dK/dV, then
reduce-scatters dK/dV back to their owners.

Overlap: the kv heads are cut into ``chunks`` groups (each with its q heads, GQA-aligned); the gather of
group c+1 is posted before group c is computed, and in the backward the reduce-scatter of group c's
dK/dV travels while group c+1 is computed. Bytes per rank: forward (W−1)/W of the full K+V; backward the
same for dK/dV (``distlab.cp.cost``). The gathered K/V are kept for the backward (small under GQA) rather
than gathered again, and so are FA4's copies of the keys that several of its sequences share (``keep=``).
Each group's out, LSE and dQ are written into the whole heads' tensors, and its dK/dV into the
reduce-scatter's buffer (``into=``; FA4 writes there itself, other kernels copy).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distlab import comm
from distlab.cp.documents import Documents, cached_plan, check_call_everywhere
from distlab.cp.layout import check_layout, shard_positions
from distlab.kernels.attention import attention_backward, attention_forward, check_qkv, resolve_backend
from distlab.kernels.masks import KeyMask
from distlab.profiling import phase


def _gather_fn():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _post_gather(k, v, group, world):
    """Async all-gather of (k, v) along the sequence; returns (work, buffer, finish) where ``finish()`` gives
    the gathered ``(k, v)`` in rank order along dim 1."""
    send = torch.stack([k, v]).movedim(2, 0).contiguous()          # (s, 2, b, h, d): gather along dim 0
    recv = send.new_empty((world * send.shape[0],) + tuple(send.shape[1:]))
    comm.record("allgather_kv", (world - 1) * send.numel() * send.element_size())
    work = _gather_fn()(recv, send, group=group, async_op=True)

    def finish():
        work.wait()
        full = recv.movedim(0, 2)                                    # (2, b, W*s, h, d)
        return full[0], full[1]

    return finish


def _scatter_buffer(kf):
    """The reduce-scatter's send buffer for the dK/dV of gathered keys like ``kf`` ``(b, W*s, h, d)``: memory
    ``(W*s, 2, b, h, d)``, so each rank's share is one block; returned with its (dK, dV) views, ``kf``-shaped."""
    send = kf.new_empty((kf.shape[1], 2, kf.shape[0]) + tuple(kf.shape[2:]))
    return send, send[:, 0].movedim(0, 1), send[:, 1].movedim(0, 1)


def _post_scatter(send, group, world):
    """Async reduce-scatter of a ``_scatter_buffer`` along dim 0; ``finish()`` gives this rank's (dK, dV)."""
    recv = send.new_empty((send.shape[0] // world,) + tuple(send.shape[1:]))
    comm.record("reduce_scatter_dkv", (world - 1) * send.numel() * send.element_size() // world)
    work = _scatter_fn()(recv, send, group=group, async_op=True)

    def finish():
        work.wait()
        part = recv.movedim(0, 2)
        return part[0], part[1]

    return finish


def default_chunks(kv_heads: int) -> int:
    """The kv-head groups all-gather CP uses unless told: two where the kv heads split evenly, else one."""
    return 2 if kv_heads % 2 == 0 else 1


def head_chunks(heads: int, kv_heads: int, chunks: int):
    """(q-head slice, kv-head slice) of each chunk: kv heads cut into ``chunks`` groups, q heads with them."""
    g, per = heads // kv_heads, kv_heads // chunks
    return [(slice(c * per * g, (c + 1) * per * g), slice(c * per, (c + 1) * per)) for c in range(chunks)]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, world, mask, scale, backend, chunks, order):
        parts = head_chunks(q.shape[2], k.shape[2], chunks)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        if len(parts) > 1:   # each group's results are copied in (one group's are the whole)
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=lse_dtype, device=q.device)
        gathered, keeps = [], [{} for _ in parts]   # per group, what the kernel's backward reuses (FA4's key copies)
        with phase("allgather.exchange"):
            pending = _post_gather(k[:, :, parts[0][1]], v[:, :, parts[0][1]], group, world) if world > 1 else None
        for c, (qh, kh) in enumerate(parts):
            if world > 1:
                with phase("allgather.wait"):
                    kf, vf = pending()
                if c + 1 < len(parts):   # the next group's K/V travel while this one computes
                    with phase("allgather.exchange"):
                        pending = _post_gather(k[:, :, parts[c + 1][1]], v[:, :, parts[c + 1][1]], group, world)
            else:
                kf, vf = k[:, :, kh], v[:, :, kh]
            if order is not None:    # rank order -> position order (the masked kernels want ascending keys)
                kf, vf = kf.index_select(1, order[0]), vf.index_select(1, order[0])
            with phase("allgather.block"):   # a group's out and LSE written into the whole heads' (FA4: in place)
                into = None if len(parts) == 1 else (out[:, :, qh], lse[:, qh])
                o, l = attention_forward(q[:, :, qh], kf, vf, False, scale, backend, mask=mask, into=into,
                                         keep=keeps[c])
            if len(parts) == 1:
                out, lse = o, l.to(lse_dtype)
            gathered.append((kf, vf))
        ctx.save_for_backward(q, out, lse, *[t for kv in gathered for t in kv])
        ctx.args = (group, world, mask, scale, backend, parts, order, keeps)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, *gathered = ctx.saved_tensors
        group, world, mask, scale, backend, parts, order, keeps = ctx.args
        dout = dout.contiguous()
        kv_heads = sum(kh.stop - kh.start for _, kh in parts)
        local = (q.shape[0], gathered[0].shape[1] // world, kv_heads, q.shape[3])
        if len(parts) > 1:   # as in the forward: one group's results are the whole
            dq = torch.empty_like(q)
        if len(parts) > 1 or world > 1:
            dk, dv = q.new_empty(local), q.new_empty(local)
        pending = []
        for c, (qh, kh) in enumerate(parts):
            kf, vf = gathered[2 * c], gathered[2 * c + 1]
            # where the group's gradients land: dQ in the whole heads'; dK/dV (keys in rank order) in the
            # reduce-scatter's buffer, or at world 1 in the whole heads' (FA4 writes there itself)
            if world > 1:
                send, *dkv_to = _scatter_buffer(kf)
            else:
                dkv_to = [dk[:, :, kh], dv[:, :, kh]] if len(parts) > 1 else [None, None]
            dq_to = dq[:, :, qh] if len(parts) > 1 else None
            into = (dq_to, *dkv_to) if order is None else (dq_to, None, None)
            with phase("allgather.block_backward"):
                dq_c, dk_c, dv_c = attention_backward(dout[:, :, qh], q[:, :, qh], kf, vf, out[:, :, qh], lse[:, qh],
                                                      False, scale, backend, mask=mask,
                                                      into=into if any(t is not None for t in into) else None,
                                                      kept=keeps[c])
            keeps[c] = {}   # freed now (a second backward, retain_graph, makes them again)
            if len(parts) == 1:
                dq = dq_c
            if order is not None:    # back to rank order, for the reduce-scatter
                dk_c, dv_c = dk_c.index_select(1, order[1]), dv_c.index_select(1, order[1])
                if dkv_to[0] is not None:
                    dkv_to[0].copy_(dk_c)
                    dkv_to[1].copy_(dv_c)
            if world > 1:   # this group's dK/dV go home while the next group computes
                with phase("allgather.exchange"):
                    pending.append((kh, _post_scatter(send, group, world)))
            elif len(parts) == 1:
                dk, dv = dk_c, dv_c
        for kh, finish in pending:
            with phase("allgather.wait"):
                dk[:, :, kh], dv[:, :, kh] = finish()
        return dq, dk, dv, None, None, None, None, None, None, None


def keys_as_gathered(q, mask, order, backend):
    """``(mask, order)`` for the kernel: on ``fa4``, the keys read where the all-gather left them, rank after
    rank (FA4's sequences read their keys through an index, ``fa4_varlen.varlen_spec``, that then points there;
    order None), instead of K and V permuted whole into position order and dK/dV back (H100, 64k, W=8: ~47 µs a
    tensor each way, a kv-head group); unchanged for other backends, or where FA4 cannot run the mask."""
    if order is None or backend != "fa4" or q.shape[0] != 1:
        return mask, order
    if "as_gathered" not in mask.memo:   # once per mask (the plan cache keeps it)
        from distlab.kernels.fa4_varlen import varlen_spec

        gathered = KeyMask(mask.q_lo, mask.q_hi, mask.k_pos[order[1]], k_sorted=False)
        mask.memo["as_gathered"] = gathered if varlen_spec(gathered) is not None else None
    return (mask, order) if mask.memo["as_gathered"] is None else (mask.memo["as_gathered"], None)


def _gathered_mask(docs, world, rank, layout, device):
    """(mask, order): this rank's queries against every key, and the permutation that puts the gathered keys
    (in rank order) in position order and back (None when they already are)."""
    positions = [shard_positions(docs.total, world, r, layout, docs.cu_seqlens) for r in range(world)]
    return gathered_mask(docs, positions, rank, device)


def gathered_mask(docs, positions, rank, device):
    """``_gathered_mask`` for any placement: ``positions``, each rank's (``distlab.cp.emulate_packed`` times the
    balanced layout's candidates with it)."""
    keys, order = torch.cat(list(positions)), None   # the gathered keys' positions, in rank order
    if bool((keys[1:] < keys[:-1]).any()):
        sort = torch.argsort(keys)
        order, keys = (sort.to(device), torch.argsort(sort).to(device)), keys[sort]
    return docs.mask(positions[rank], keys, device), order


def allgather_attention(q, k, v, group=None, causal=False, layout="contiguous", backend="auto", softmax_scale=None,
                        cu_seqlens=None, window=None, chunks=None, return_lse=False):
    """Attention over the whole sequence from this rank's shards (``distlab.cp.layout.shard_sequence`` with
    the same ``layout`` and ``cu_seqlens``), by all-gathering K/V.

    q: ``(batch, seq/W, heads, head_dim)``; k, v: ``(batch, seq/W, kv_heads, head_dim)``. ``chunks``: kv-head
    groups whose gathers overlap the previous group's compute (default: 2 when the kv heads split evenly, else
    1). ``cu_seqlens`` / ``window``: packed documents and a sliding window (``distlab.cp.documents``).
    """
    check_call_everywhere("allgather_attention", group, q, k, v, causal, layout, cu_seqlens, window)
    world, rank = comm.group_size(group), comm.group_rank(group)
    check_layout(layout)
    check_qkv(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"all-gather attention needs q and k shards of one length; got {q.shape[1]} and {k.shape[1]}")
    total = q.shape[1] * world
    docs = Documents.from_args(total, cu_seqlens, causal, window)
    chunks = chunks if chunks is not None else default_chunks(k.shape[2])
    if not isinstance(chunks, int) or chunks < 1 or k.shape[2] % chunks:
        raise ValueError(f"chunks={chunks!r} must be a positive divisor of the kv heads ({k.shape[2]})")
    # causal (local queries against all keys: the diagonal is offset) and documents need the positions' mask;
    # full attention does not care in which order the gathered keys come
    mask, order = None, None
    if causal or docs.masked:
        mask, order = cached_plan("allgather", docs, world, rank, layout, q.device,
                                  build=lambda: _gathered_mask(docs, world, rank, layout, q.device))
    backend = resolve_backend(backend, q.device, q.dtype, masked=mask is not None)
    mask, order = keys_as_gathered(q, mask, order, backend)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _AllGatherAttention.apply(q, k, v, group, world, mask, scale, backend, chunks, order)
    return (out, lse) if return_lse else out


if __name__ == "__main__":   # the study is this method's command line; run, not imported (no cycle)
    import runpy

    runpy.run_module("distlab.cp.study", init_globals={"ALGORITHM": "allgather"}, run_name="__main__")
