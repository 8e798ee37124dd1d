"""Flash attention in Triton under a ``KeyMask``: packed documents, sliding windows, any block of positions.

    TRITON_INTERPRET=1 python tests/kernel_checks.py masked --dtype float32       # CPU check
    python -m distlab.cp.emulate_packed --world 8 --seq 65536                    # GPU: a ring rank on packs

The FA2 loop of ``distlab.kernels.triton_attention`` with a mask made of intervals (``distlab.kernels.masks``):
query row i sees the keys whose global position lies in ``[lo[i], hi[i])``, and keys carry their positions
``k_pos`` (ascending, as every layout's shard is). So a tile of BLOCK_M query rows needs only the keys in
``[min lo, max hi)`` of its rows: the host finds that key range per query tile (``searchsorted``) and the
kernel loops over it alone, less the whole key tiles inside the widest run of keys none of the tile's rows
sees (``key_gaps``: a tile straddling two far documents, as all-gather's rows of a balanced rank are) —
tiles outside every document and window are never loaded, and the work follows the visible pairs. Inside
the range a score is kept iff ``lo <= k_pos < hi``; key tiles that every row of the query tile sees whole
(``full_key_ranges``: most of a causal or document block) skip the mask, its loads and its guards, as
FlashAttention's full blocks do; dK/dV likewise for the query tiles that see a key tile whole
(``full_query_ranges``). Knob ``DISTLAB_TRITON_MASKED_FULL_TILES=0`` turns it off. A ring block starts its
tiles longest range first, forward and backward, as does a rank's rows against more keys than it holds
(all-gather CP's; ``DISTLAB_TRITON_MASKED_ORDER``).

Backward (FA2): ``delta = rowsum(dO·O)``; dK/dV per (key tile, kv head) over the q heads of its group and
the query tiles that can see the key tile (rows' ``lo``/``hi`` ascend with the row, so they are one range;
when they do not, every query tile is visited); dQ per (query tile, q head) over its key range. A row that
sees no key has LSE −inf and output 0, and adds nothing to any gradient. fp16/bf16 on a GPU; fp32/fp16
under ``TRITON_INTERPRET=1``; head_dim a power of two.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from distlab.kernels.launch import CachedLaunch, cdiv, launch_keyed
from distlab.kernels.masks import (full_key_ranges, full_query_ranges, key_gaps, key_ranges, key_tiles, masked_tiles,
                                   query_ranges, seen_keys)

LOG2E = 1.4426950408889634


@triton.jit
def _key_tile(K, V, KPOS, base, cols, end, sks, dims, lo, hi):
    """A tile of keys (rows ``cols`` below ``end``) of one kv head, and which of them each query row sees."""
    in_k = cols < end
    kpos = tl.load(KPOS + cols, mask=in_k, other=0)
    k = tl.load(K + base + cols[:, None] * sks + dims[None, :], mask=in_k[:, None], other=0.0)
    v = tl.load(V + base + cols[:, None] * sks + dims[None, :], mask=in_k[:, None], other=0.0)
    seen = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] < hi[:, None]) & in_k[None, :]
    return k, v, seen


@triton.jit
def _fwd_keys(acc, m, l, q, K, V, KPOS, base, first, stop, ke, fb, fe, sks, dims, lo, hi, qk_scale,
              BLOCK_N: tl.constexpr, FULL: tl.constexpr):
    """The forward's online softmax over the key tiles starting in [first, stop) (keys below ``ke``)."""
    for start in range(first, stop, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if FULL and (start >= fb) & (start + BLOCK_N <= fe):   # every row sees every key: no mask, no guards
            k = tl.load(K + base + cols[:, None] * sks + dims[None, :])
            v = tl.load(V + base + cols[:, None] * sks + dims[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
        else:
            k, v, seen = _key_tile(K, V, KPOS, base, cols, ke, sks, dims, lo, hi)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return acc, m, l


@triton.jit(do_not_specialize=["number"])   # a block's number: no recompiles for 1 or multiples of 16
def _fwd(Q, K, V, O, LSE, LO, HI, KPOS, KB, KE, GB, GE, FB, FE, FO, FIRST, LAST, TILES, scale,
         sqb, sqs, sqh, skb, sks, skh, sob, sos, soh, slb, slh, sfb, sfs, sfh, seq_q, heads, groups, number,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, FULL: tl.constexpr,
         ACCUMULATE: tl.constexpr, ORDERED: tl.constexpr, LPT: tl.constexpr):
    """ORDERED (a packed ring's block ``number``): a row whose FIRST block this is reads no running result
    (it starts there), one whose LAST block this is is written to FO in FO's dtype instead of to O.
    LPT: the grid is (batch · heads, query tiles) and program (x, y) takes query tile TILES[y] — the tiles
    sorted by their key range, longest first — so the GPU, which starts programs x fastest, starts the
    longest tile of every head first and fills the end with short ones (longest processing time first)."""
    if LPT:
        bh, tile = tl.program_id(0), tl.load(TILES + tl.program_id(1))
    else:
        tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    hk = h // groups
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    in_q = rows < seq_q
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_q[:, None], other=0.0)
    lo = tl.load(LO + rows, mask=in_q, other=0)
    hi = tl.load(HI + rows, mask=in_q, other=0)
    kb = tl.load(KB + tile)
    ke = tl.load(KE + tile)
    fb = tl.load(FB + tile)
    fe = tl.load(FE + tile)
    gb = tl.load(GB + tile)
    ge = tl.load(GE + tile)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    base = b * skb + hk * skh
    # the keys before the tile's gap (``key_gaps``: none seen by any row), then those after it
    acc, m, l = _fwd_keys(acc, m, l, q, K, V, KPOS, base, kb, gb, ke, fb, fe, sks, dims, lo, hi, qk_scale,
                          BLOCK_N, FULL)
    acc, m, l = _fwd_keys(acc, m, l, q, K, V, KPOS, base, ge, ke, ke, fb, fe, sks, dims, lo, hi, qk_scale,
                          BLOCK_N, FULL)
    seen_any = l > 0
    out = acc / tl.where(seen_any, l, 1.0)[:, None]
    lse = tl.where(seen_any, (m + tl.log2(tl.where(seen_any, l, 1.0))) / 1.4426950408889634, float("-inf"))
    o_ptrs = O + b * sob + h * soh + rows[:, None] * sos + dims[None, :]
    l_ptrs = LSE + b * slb + h * slh + rows
    if ACCUMULATE:   # merge into the running float32 (out, lse); either side may be empty (LSE -inf)
        held = in_q
        if ORDERED:   # a row's first block: nothing held yet (the buffers are not filled)
            held = in_q & (tl.load(FIRST + rows, mask=in_q, other=number) != number)
        prev = tl.load(l_ptrs, mask=held, other=float("-inf"))
        o_prev = tl.load(o_ptrs, mask=held[:, None], other=0.0)
        top = tl.maximum(prev, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_prev, w_blk = tl.exp(prev - top), tl.exp(lse - top)
        total = w_prev + w_blk
        denom = tl.where(total > 0, total, 1.0)
        out = o_prev * (w_prev / denom)[:, None] + out * (w_blk / denom)[:, None]
        lse = tl.where(total > 0, top + tl.log(denom), float("-inf"))
    if ORDERED:   # a row's last block: its result, in FO's dtype (no float32 copy converted after)
        done = tl.load(LAST + rows, mask=in_q, other=-1) == number
        fo_ptrs = FO + b * sfb + h * sfh + rows[:, None] * sfs + dims[None, :]
        tl.store(fo_ptrs, out.to(FO.dtype.element_ty), mask=(in_q & done)[:, None])
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(in_q & ~done)[:, None])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_q[:, None])
    tl.store(l_ptrs, lse, mask=in_q)


@triton.jit
def _bwd_dkv(Q, K, V, DO, LSE, DELTA, DK, DV, LO, HI, KPOS, QB, QE, FB, FE, TILES, scale,
             sqb, sqs, sqh, skb, sks, skh, srb, srh, sdb, sds, sdh, seq_q, seq_k, heads, kv_heads, groups,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, FULL: tl.constexpr,
             ADD: tl.constexpr, LPT: tl.constexpr):
    """LPT: program (x, y) takes key tile TILES[y] of (batch, kv head) x — the key tiles sorted by their query
    range, longest first, as the forward's."""
    if LPT:
        bhk, tile = tl.program_id(0), tl.load(TILES + tl.program_id(1))
    else:
        tile, bhk = tl.program_id(0), tl.program_id(1)
    b, hk = bhk // kv_heads, bhk % kv_heads
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    in_k = cols < seq_k
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + dims[None, :], mask=in_k[:, None], other=0.0)
    v = tl.load(V + b * skb + hk * skh + cols[:, None] * sks + dims[None, :], mask=in_k[:, None], other=0.0)
    kpos = tl.load(KPOS + cols, mask=in_k, other=0)
    qb = tl.load(QB + tile)
    qe = tl.load(QE + tile)
    fb = tl.load(FB + tile)
    fe = tl.load(FE + tile)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    for g in range(groups):
        h = hk * groups + g
        for start in range(qb, qe, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            # rows that see the whole key tile: no mask (key columns past seq_k only touch dK/dV rows not stored)
            if FULL and (start >= fb) & (start + BLOCK_M <= fe):
                q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :])
                do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :])
                lse = tl.load(LSE + b * srb + h * srh + rows) * 1.4426950408889634
                delta = tl.load(DELTA + b * srb + h * srh + rows)
                s = tl.dot(q, tl.trans(k)) * qk_scale
                p = tl.exp2(s - lse[:, None])
            else:
                in_q = rows < qe
                q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_q[:, None], other=0.0)
                do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_q[:, None],
                             other=0.0)
                lse = tl.load(LSE + b * srb + h * srh + rows, mask=in_q, other=float("inf"))
                lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
                delta = tl.load(DELTA + b * srb + h * srh + rows, mask=in_q, other=0.0)
                lo = tl.load(LO + rows, mask=in_q, other=0)
                hi = tl.load(HI + rows, mask=in_q, other=0)
                s = tl.dot(q, tl.trans(k)) * qk_scale
                seen = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] < hi[:, None]) & in_q[:, None] & in_k[None, :]
                p = tl.where(seen, tl.exp2(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    dk_ptrs = DK + b * sdb + hk * sdh + cols[:, None] * sds + dims[None, :]
    dv_ptrs = DV + b * sdb + hk * sdh + cols[:, None] * sds + dims[None, :]
    dk = dk * scale
    if ADD:   # a ring step: added into float32 accumulators
        dk += tl.load(dk_ptrs, mask=in_k[:, None], other=0.0)
        dv += tl.load(dv_ptrs, mask=in_k[:, None], other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=in_k[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=in_k[:, None])


@triton.jit
def _dq_keys(dq, q, do, lse, delta, K, V, KPOS, base, first, stop, ke, fb, fe, sks, dims, lo, hi, qk_scale,
             BLOCK_N: tl.constexpr, FULL: tl.constexpr):
    """dQ over the key tiles starting in [first, stop) (keys below ``ke``)."""
    for start in range(first, stop, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if FULL and (start >= fb) & (start + BLOCK_N <= fe):   # the whole tile seen by every row
            k = tl.load(K + base + cols[:, None] * sks + dims[None, :])
            v = tl.load(V + base + cols[:, None] * sks + dims[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            p = tl.exp2(s - lse[:, None])
        else:
            k, v, seen = _key_tile(K, V, KPOS, base, cols, ke, sks, dims, lo, hi)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            p = tl.where(seen, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit(do_not_specialize=["number"])   # as the forward's
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, LO, HI, KPOS, KB, KE, GB, GE, FB, FE, TILES, DQF, FIRST, LAST, scale,
            sqb, sqs, sqh, skb, sks, skh, srb, srh, sdb, sds, sdh, seq_q, heads, groups, number,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, FULL: tl.constexpr,
            ADD: tl.constexpr, LPT: tl.constexpr, ORDERED: tl.constexpr):
    """ORDERED (a packed ring's block ``number``, with ADD): a row whose FIRST block this is reads no dQ (it
    starts there: the accumulator needs no zero fill), one whose LAST block this is is written to DQF (q's
    dtype, DQ's strides) instead of to DQ (no conversion launch after the ring)."""
    if LPT:   # as the forward's: query tile TILES[y] of (batch, head) x, longest key range first
        bh, tile = tl.program_id(0), tl.load(TILES + tl.program_id(1))
    else:
        tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    hk = h // groups
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    in_q = rows < seq_q
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_q[:, None], other=0.0)
    do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_q[:, None], other=0.0)
    lse = tl.load(LSE + b * srb + h * srh + rows, mask=in_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + b * srb + h * srh + rows, mask=in_q, other=0.0)
    lo = tl.load(LO + rows, mask=in_q, other=0)
    hi = tl.load(HI + rows, mask=in_q, other=0)
    kb = tl.load(KB + tile)
    ke = tl.load(KE + tile)
    fb = tl.load(FB + tile)
    fe = tl.load(FE + tile)
    gb = tl.load(GB + tile)
    ge = tl.load(GE + tile)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    base = b * skb + hk * skh
    # the keys before the tile's gap, then those after it (as the forward)
    dq = _dq_keys(dq, q, do, lse, delta, K, V, KPOS, base, kb, gb, ke, fb, fe, sks, dims, lo, hi, qk_scale,
                  BLOCK_N, FULL)
    dq = _dq_keys(dq, q, do, lse, delta, K, V, KPOS, base, ge, ke, ke, fb, fe, sks, dims, lo, hi, qk_scale,
                  BLOCK_N, FULL)
    dq_ptrs = DQ + b * sdb + h * sdh + rows[:, None] * sds + dims[None, :]
    dq = dq * scale
    if ORDERED:   # a packed ring: per row, its first block writes, its last writes the final dQ
        held = in_q & (tl.load(FIRST + rows, mask=in_q, other=number) != number)
        dq += tl.load(dq_ptrs, mask=held[:, None], other=0.0)
        done = tl.load(LAST + rows, mask=in_q, other=-1) == number
        tl.store(DQF + b * sdb + h * sdh + rows[:, None] * sds + dims[None, :], dq.to(DQF.dtype.element_ty),
                 mask=(in_q & done)[:, None])
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(in_q & ~done)[:, None])
    else:
        if ADD:   # a ring step: added into the float32 dQ of the shard
            dq += tl.load(dq_ptrs, mask=in_q[:, None], other=0.0)
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_q[:, None])


def _gaps(mask, block_m, block_n, end):
    """``key_gaps`` (knob ``DISTLAB_TRITON_MASKED_GAPS``: 1, the default), or none (0: every key tile of a query
    tile's range, for an A/B of the skip; the same results bit for bit)."""
    from distlab import knobs

    flag = knobs.get("TRITON_MASKED_GAPS")
    if flag not in ("0", "1"):
        raise ValueError(f"DISTLAB_TRITON_MASKED_GAPS={flag!r}: use 1 (skip each query tile's gap) or 0")
    return key_gaps(mask, block_m, block_n) if flag == "1" else (end, end)


def _full_tiles() -> bool:
    from distlab import knobs

    return knobs.get("TRITON_MASKED_FULL_TILES") != "0"


def _longest_first(accumulate: bool, mask=None) -> bool:
    """Knob ``DISTLAB_TRITON_MASKED_ORDER``: ``rows`` (tiles in row order, head by head), ``lpt`` (longest
    first, every head's: the forward's and dQ's query tiles by key range, dK/dV's key tiles by query range) or
    ``auto`` (the default: lpt for a block accumulated into a running result, i.e. a ring step's, and for a
    rank's rows against more keys than it holds, i.e. all-gather CP's, forward and backward; rows for a whole
    call). H200, 64k pack, W=8 (docs/PERF.md): the forward's lpt cut the ring ranks' forward 4–10% (balanced's
    slowest 1.26 → 1.15 ms) and slowed the one call 6% (6.21 → 6.59 ms: its many waves already fill the GPU, and
    every head's tile at once shares less K/V in L2). A rank's share of a call is a few waves, as a ring step's
    (``distlab.cp.waves``, 64k, W=8: the last wave is where all-gather's rank loses)."""
    from distlab import knobs

    order = knobs.get("TRITON_MASKED_ORDER")
    if order not in ("rows", "lpt", "auto"):
        raise ValueError(f"DISTLAB_TRITON_MASKED_ORDER={order!r}: use rows, lpt or auto")
    part = mask is not None and mask.q_lo.shape[0] < mask.k_pos.shape[0]
    return order == "lpt" or (order == "auto" and (accumulate or part))


def longest_first(mask, block_m: int, block_n: int) -> torch.Tensor:
    """The query tiles of ``mask`` ordered by the key tiles they visit (``key_tiles``), longest first (int32,
    on the mask's device; kept in the mask's memo)."""
    return _by_length(mask, ("longest_first", block_m, block_n), lambda: key_tiles(mask, block_m, block_n))


def longest_query_range_first(mask, seq_k: int, block_n: int) -> torch.Tensor:
    """The key tiles of ``mask`` ordered by the length of their query range, longest first (the dK/dV grid's
    order; as ``longest_first``)."""
    return _by_length(mask, ("longest_query_range_first", seq_k, block_n),
                      lambda: _length(query_ranges(mask, seq_k, block_n)))


def _length(ranges):
    begin, end = ranges
    return end - begin


def _by_length(mask, key, lengths):
    if key not in mask.memo:
        mask.memo[key] = torch.argsort(lengths(), descending=True, stable=True).to(torch.int32)
    return mask.memo[key]


def _check(q, k, v, mask):
    if not mask.k_sorted:
        raise ValueError("the triton masked kernel needs ascending key positions (sort the keys first)")
    d = q.shape[-1]
    if d & (d - 1) or d < 16:
        raise ValueError(f"the triton masked kernel needs head_dim a power of two >= 16; got {d}")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("the triton masked kernel needs the last dim contiguous")


def masked_forward(q, k, v, mask, scale, out=None, lse=None, accumulate=False, order=None, final_out=None):
    """(out, lse) of attention under ``mask`` (a ``KeyMask`` on q's device). With ``out``/``lse`` given
    (float32 running results, e.g. views of some rows of a ring's accumulators, last dims contiguous) and
    ``accumulate=True`` the block is merged into them inside the kernel — a packed ring step then needs no
    separate merge launch (a row this block leaves empty keeps what it held).

    ``order = (first, last, number)`` with ``final_out`` (a packed ring, ``distlab.cp.ring_packed.StepBlocks``):
    this is block ``number``; ``first``/``last`` (int32, one per query row) number each row's first and last
    block. A row starts at its first block (``out``/``lse`` need no fill) and its merged result goes to
    ``final_out`` (q's shape, any float dtype) at its last, instead of to ``out``; returns ``(final_out, lse)``."""
    _check(q, k, v, mask)
    if k.stride() != v.stride():   # the kernel walks K and V with one set of strides (a fused QKV's views differ)
        k, v = k.contiguous(), v.contiguous()
    b, sq, h, d = q.shape
    bm, bn, warps, stages = masked_tiles(q.device, d)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs the running out and lse")
        out = torch.empty_like(q)
        lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    elif out.shape != q.shape or lse.shape != (b, h, sq) or lse.dtype != torch.float32 or out.stride(-1) != 1 \
            or lse.stride(-1) != 1 or (accumulate and out.dtype != torch.float32):
        raise ValueError(f"out must be {tuple(q.shape)} (float32 to accumulate) and lse float32 {(b, h, sq)}, last "
                         f"dims contiguous; got {tuple(out.shape)} {out.dtype} and {tuple(lse.shape)} {lse.dtype}")
    first = last = None
    number, fo_strides = 0, (0, 0, 0)
    if order is not None:
        first, last, number = order
        if not accumulate or final_out is None or final_out.shape != q.shape or final_out.stride(-1) != 1 \
                or any(t.shape != (sq,) or t.dtype != torch.int32 or t.stride(0) != 1 for t in (first, last)):
            raise ValueError(f"order=(first, last, number) needs accumulate=True, final_out {tuple(q.shape)} with a "
                             f"contiguous last dim, and first/last contiguous int32 ({sq},)")
        fo_strides = final_out.stride()[:3]
    kb, ke = key_ranges(mask, bm)
    fb, fe = full_key_ranges(mask, bm)
    lo, hi, kpos = mask.q_lo.contiguous(), mask.q_hi.contiguous(), mask.k_pos.contiguous()
    lpt = _longest_first(accumulate, mask)
    tiles = longest_first(mask, bm, bn) if lpt else None
    grid = (b * h, cdiv(sq, bm)) if lpt else (cdiv(sq, bm), b * h)
    launch_keyed(_FWD, grid, (q, k, v, out, lse, lo, hi, kpos, kb, ke, *_gaps(mask, bm, bn, ke), fb, fe,
                              final_out if order else None, first, last, tiles),
                 (scale, *q.stride()[:3], *k.stride()[:3], *out.stride()[:3], *lse.stride()[:2], *fo_strides, sq, h,
                  h // k.shape[2], number),
                 dict(BLOCK_M=bm, BLOCK_N=bn, D=d, FULL=_full_tiles(), ACCUMULATE=accumulate,
                      ORDERED=order is not None, LPT=lpt, num_warps=warps, num_stages=stages))
    return (final_out if order is not None else out), lse


def masked_backward(dout, q, k, v, out, lse, mask, scale, rows=None, dq_acc=None, dk_acc=None, dv_acc=None,
                    dkv_add=True, dq_stream=None, order=None, dq_final=None, parts="both"):
    """(dq, dk, dv) given the final out and lse (as every backend; see ``distlab.kernels.attention``).

    A packed ring step passes ``rows = masked_backward_rows(dout, out, lse)`` of these query rows (computed
    once for the shard; then ``out``/``lse`` are not read) and float32 accumulators ``dq_acc`` (q's shape)
    and ``dk_acc``/``dv_acc`` (k's shape), last dims contiguous, that the kernels *add* their gradients into
    — no per-step sums, conversions or row statistics; it gets the accumulators back. ``dkv_add=False``: the
    dK/dV kernel *writes* the gradients of the keys some row sees (``seen_keys``) instead of adding them (a
    step's only block: its accumulator needs no zero fill first). ``dq_stream`` (a CUDA stream): the dQ kernel
    is launched there, after what the current stream holds so far (this dK/dV kernel included), beside the
    dK/dV kernels that follow (``distlab.cp.ring_packed.BackwardStreams``); the caller marks the inputs as
    used by that stream and waits for it before reading dQ. ``order = (first, last, number)`` with
    ``dq_final`` (a packed ring, as ``masked_forward``'s): a row's first block writes its dQ into ``dq_acc``
    (no zero fill needed), its last writes the final dQ into ``dq_final`` (q's shape and dtype, ``dq_acc``'s
    strides) instead. ``parts`` (with the accumulators): ``both``, or only the ``dkv`` kernel (``dq_acc`` may
    be None) or only the ``dq`` kernel (``dk_acc``/``dv_acc`` may be None) — a packed ring whose dQ runs by
    launch groups (``distlab.cp.ring_packed._backward``)."""
    _check(q, k, v, mask)
    if parts not in ("both", "dkv", "dq"):
        raise ValueError(f"parts={parts!r}: use both, dkv or dq")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    bm, bn, warps, stages = masked_tiles(q.device, d, "bwd")
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))   # Q and dO share strides in the kernels
    lse, delta = rows if rows is not None else masked_backward_rows(dout, out, lse)
    if lse.stride() != delta.stride() or lse.stride(-1) != 1 or lse.shape != (b, h, sq):
        raise ValueError("the backward rows (lse, delta) must be float32 (batch, heads, seq_q) sharing strides")
    accs = (dq_acc, dk_acc, dv_acc)
    if parts != "both" and all(a is None for a in accs):
        raise ValueError(f"parts={parts!r} needs the accumulators")
    if any(a is not None for a in accs):
        needed = {"both": (0, 1, 2), "dkv": (1, 2), "dq": (0,)}[parts]
        for i, (name, a, shape) in enumerate(zip(("dq_acc", "dk_acc", "dv_acc"), accs, (q.shape, k.shape, v.shape))):
            if i in needed and (a is None or a.shape != shape or a.dtype != torch.float32 or a.stride(-1) != 1):
                raise ValueError(f"{name} must be float32 {tuple(shape)} with a contiguous last dim (give all three, "
                                 "or those of parts)")
        if parts != "dq" and dk_acc.stride() != dv_acc.stride():
            raise ValueError("dk_acc and dv_acc must share strides")
        dq, dk, dv = accs
        if order is not None and parts != "dkv":
            first, last, number = order
            if dq_final is None or dq_final.shape != q.shape or dq_final.stride() != dq.stride() \
                    or any(t.shape != (sq,) or t.dtype != torch.int32 or t.stride(0) != 1 for t in (first, last)):
                raise ValueError(f"order=(first, last, number) needs dq_final {tuple(q.shape)} with dq_acc's strides "
                                 f"and first/last contiguous int32 ({sq},)")
    elif order is not None:
        raise ValueError("order=(first, last, number) needs the accumulators (dq_acc, dk_acc, dv_acc)")
    else:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    add = any(a is not None for a in accs)
    if add:   # only the keys some row sees: a ring block's other key tiles would load and store dK/dV for nothing
        cols, mask = seen_keys(mask)
        if cols is not None:
            k, v = k[:, cols], v[:, cols]
            if parts != "dq":
                dk, dv = dk[:, cols], dv[:, cols]
            sk = k.shape[1]
    lpt = _longest_first(add, mask)
    lo, hi, kpos = mask.q_lo.contiguous(), mask.q_hi.contiguous(), mask.k_pos.contiguous()
    if parts != "dq":
        qb, qe = query_ranges(mask, sk, bn)
        qfb, qfe = full_query_ranges(mask, sk, bn)
        tiles = longest_query_range_first(mask, sk, bn) if lpt else None
        launch_keyed(_DKV, (b * hk, cdiv(sk, bn)) if lpt else (cdiv(sk, bn), b * hk),
                     (q, k, v, dout, lse, delta, dk, dv, lo, hi, kpos, qb, qe, qfb, qfe, tiles),
                     (scale, *q.stride()[:3], *k.stride()[:3], *lse.stride()[:2], *dk.stride()[:3], sq, sk, h, hk,
                      h // hk),
                     dict(BLOCK_M=bm, BLOCK_N=bn, D=d, FULL=_full_tiles(), ADD=add and dkv_add, LPT=lpt,
                          num_warps=warps, num_stages=stages))
    if parts == "dkv":
        return dq, dk, dv
    kb, ke = key_ranges(mask, bm)
    fb, fe = full_key_ranges(mask, bm)
    tiles = longest_first(mask, bm, bn) if lpt else None
    if dq_stream is not None:   # after what the current stream holds so far, this dK/dV kernel included
        dq_stream.wait_stream(torch.cuda.current_stream(q.device))
        for t in (q, k, v, dout):   # copies made above (non-contiguous inputs) are freed when this returns
            t.record_stream(dq_stream)
    with torch.cuda.stream(dq_stream) if dq_stream is not None else contextlib.nullcontext():
        ordered = (dq_final, *order[:2]) if order is not None else (dq, lo, lo)   # unread without ORDERED
        launch_keyed(_DQ, (b * h, cdiv(sq, bm)) if lpt else (cdiv(sq, bm), b * h),
                     (q, k, v, dout, lse, delta, dq, lo, hi, kpos, kb, ke, *_gaps(mask, bm, bn, ke), fb, fe, tiles,
                      *ordered),
                     (scale, *q.stride()[:3], *k.stride()[:3], *lse.stride()[:2], *dq.stride()[:3], sq, h, h // hk,
                      order[2] if order is not None else 0),
                     dict(BLOCK_M=bm, BLOCK_N=bn, D=d, FULL=_full_tiles(), ADD=add, LPT=lpt,
                          ORDERED=order is not None, num_warps=warps, num_stages=stages))
    return dq, dk, dv


def masked_backward_rows(dout, out, lse):
    """``(lse, delta)``, float32 (batch, heads, seq), contiguous: the final LSE and ``rowsum(dO·O)`` the
    backward kernels read. A packed ring computes them once for its shard and passes row views to each
    step's ``masked_backward`` (the final out and LSE do not change between steps). delta comes from the
    dense backward's row kernel, one launch (PyTorch's float copies, product, sum and transpose were several
    launches and ~0.2-0.3 ms in the H200 profile of a 64k pack's W=8 rank)."""
    d = out.shape[-1]
    if d & (d - 1) or d < 16:
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    else:
        from distlab.kernels.triton_attention_backward import backward_rows

        delta, _ = backward_rows(dout, out, lse)
    lse = lse.float()
    if lse.stride() != delta.stride():   # e.g. a view of some heads (all-gather CP's kv-head groups) at batch 1:
        lse = torch.empty_like(delta).copy_(lse)   # "contiguous", yet its batch stride is the whole tensor's
    return lse, delta


# the launches, bound once per key (host cost, #24)
_FWD, _DKV, _DQ = map(CachedLaunch, (_fwd, _bwd_dkv, _bwd_dq))
