"""Flash attention backward in Triton (FA2-style), for ``distlab.kernels.triton_attention``'s forward.

    TRITON_INTERPRET=1 python tests/kernel_checks.py attention emulate    # CPU, against the PyTorch reference
    python -m distlab.kernels.bench --only attention                             # GPU: against cuDNN / flash SDPA

Backward (given the *final* out and LSE, as every backend here): a small kernel computes
``delta = rowsum(dO ∘ O)`` and the exp2-domain LSE (``backward_rows``; a ring does it once for its shard);
one kernel per (BLOCK_N keys, kv head) loops over the query tiles of *every* q head of its group and
accumulates dK, dV in registers (no atomics, GQA summed in place) — or, when that grid would not fill
the GPU once (a short ring block), one per (BLOCK_N keys, q head) writing float32 partial sums that are
added up after; one kernel per (BLOCK_M queries, q head) accumulates dQ over the key tiles, and can add
it into a float32 dQ in place (a ring step). ``DISTLAB_TRITON_ATTN_DQ_MODE``: ``kernel`` (default, 7
matmuls per tile pair), ``atomic`` (the dK/dV kernel adds each tile's dQ share into a float32 buffer with
pointer atomics: 5 matmuls; 10% slower on the H200) or ``tma-reduce`` (the same with one TMA reduce-add
per tile: 13% slower). ``DISTLAB_TRITON_ATTN_SPLIT_SUM``: where the per-q-head dK/dV partials are summed into
dK/dV, and where a later ring step adds its dK/dV into the accumulator it received: ``dq`` (default: by the
dQ kernel's programs after their dQ, no extra launch) or ``kernel`` (a launch of its own: the split sum's
kernel, or two ``add_`` without split groups).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from distlab import knobs
from distlab.kernels.launch import CachedLaunch, cdiv, launch_keyed, tensor_key
from distlab.kernels.triton_attention import (LOG2E, _descriptor, _fast_descriptor, _kv_tile, _last_contiguous,
                                              _layout, _precision, _tma_fits, _visible, check_triton_inputs,
                                              pdl_enabled, tile_config, tma_kernels)

DQ_MODES = ("kernel", "atomic", "tma-reduce")   # DISTLAB_TRITON_ATTN_DQ_MODE (see the module doc)


@triton.jit
def _delta_kernel(O, DO, LSE, DELTA, LSE2, seq, heads, sob, sos, soh, sdb, sds, sdh, slb, slh, log2e,
                  BLOCK: tl.constexpr, D: tl.constexpr):
    """delta = rowsum(dO ∘ O), and the exp2-domain LSE (+inf for a row that saw no key, so its
    probabilities are 0), both float32 (batch · heads, seq)."""
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    m = (rows < seq)[:, None]
    o = tl.load(O + b * sob + h * soh + rows[:, None] * sos + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sds + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * seq + rows, tl.sum(o * do, 1), mask=rows < seq)
    lse = tl.load(LSE + b * slb + h * slh + rows, mask=rows < seq, other=0.0)
    empty = lse == float("-inf")   # a row with no key: P = 0 (NaN and +inf stay, so the gradients show them)
    tl.store(LSE2 + bh * seq + rows, tl.where(empty, float("inf"), lse * log2e), mask=rows < seq)


@triton.jit
def _sum_split_rows(DKP, DVP, DK, DV, r, seq, kv_heads, n_rows, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                    SPLITS: tl.constexpr, D: tl.constexpr, ADD: tl.constexpr):
    """Rows ``r`` (batch, key, kv head) of dK, dV (any dtype and strides) = the sum, in split order, of the
    float32 per-q-head partials ``(batch, seq, kv_heads · SPLITS, D)`` (``ADD``: dK, dV += that sum)."""
    offs_d = tl.arange(0, D)
    m = (r < n_rows)[:, None]
    b, t, hk = r // (seq * kv_heads), (r // kv_heads) % seq, r % kv_heads
    dk_ptrs = DK + (b * sdkb + t * sdks + hk * sdkh)[:, None] + offs_d[None, :]
    dv_ptrs = DV + (b * sdvb + t * sdvs + hk * sdvh)[:, None] + offs_d[None, :]
    part = (r * SPLITS)[:, None] * D + offs_d[None, :]
    acc_k = tl.load(DKP + part, mask=m, other=0.0)
    acc_v = tl.load(DVP + part, mask=m, other=0.0)
    for j in tl.static_range(1, SPLITS):
        acc_k += tl.load(DKP + part + j * D, mask=m, other=0.0)
        acc_v += tl.load(DVP + part + j * D, mask=m, other=0.0)
    if ADD:   # into what DK/DV hold (a ring step's received accumulator)
        acc_k += tl.load(dk_ptrs, mask=m, other=0.0).to(tl.float32)
        acc_v += tl.load(dv_ptrs, mask=m, other=0.0).to(tl.float32)
    tl.store(dk_ptrs, acc_k.to(DK.dtype.element_ty), mask=m)
    tl.store(dv_ptrs, acc_v.to(DV.dtype.element_ty), mask=m)


@triton.jit
def _sum_splits_kernel(DKP, DVP, DK, DV, seq, kv_heads, n_rows, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                       SPLITS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, ADD: tl.constexpr):
    """The partials summed into dK, dV, ROWS rows a program: one launch for both, deterministic."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    _sum_split_rows(DKP, DVP, DK, DV, r, seq, kv_heads, n_rows, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, SPLITS, D, ADD)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, d_ptrs, dq_ptrs, stride_qm, stride_dom, stride_dqm, cols, lo,
                hi, seq_q, qk_scale, scale, QD, DOD, DQD, b, qcol, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                CAUSAL: tl.constexpr, PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr,
                D: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    for start in range(lo, hi, BLOCK_M):
        rows = start + offs_m
        if TMA:   # q and dO tiles through descriptors (zero-filled past seq_q), the row vectors masked
            q = QD.load([b, start, qcol]).reshape(BLOCK_M, D)
            do = DOD.load([b, start, qcol]).reshape(BLOCK_M, D)
            lse2 = tl.load(l_ptrs + start, mask=rows < seq_q, other=float("inf"))
            delta = tl.load(d_ptrs + start, mask=rows < seq_q, other=0.0)
        elif MASK:
            q = tl.load(q_ptrs + start * stride_qm, mask=(rows < seq_q)[:, None], other=0.0)
            do = tl.load(do_ptrs + start * stride_dom, mask=(rows < seq_q)[:, None], other=0.0)
            lse2 = tl.load(l_ptrs + start, mask=rows < seq_q, other=float("inf"))
            delta = tl.load(d_ptrs + start, mask=rows < seq_q, other=0.0)
        else:
            q = tl.load(q_ptrs + start * stride_qm)
            do = tl.load(do_ptrs + start * stride_dom)
            lse2 = tl.load(l_ptrs + start)
            delta = tl.load(d_ptrs + start)
        st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale                     # (BLOCK_N, BLOCK_M) = scores^T
        pt = tl.math.exp2(st - lse2[None, :])
        if MASK:
            if CAUSAL:
                pt = tl.where(cols[:, None] <= rows[None, :], pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
        if ATOMIC_DQ:   # this key tile's share of dQ = dS·K, added into the float32 dQ
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=PREC) * scale
            if ATOMIC_DQ == 2:   # one TMA reduce-add of the whole tile (rows past seq_q are dropped)
                DQD.atomic_add([b, start, qcol], dq.reshape(1, BLOCK_M, D))
            elif MASK:
                tl.atomic_add(dq_ptrs + start * stride_dqm, dq, mask=(rows < seq_q)[:, None], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs + start * stride_dqm, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, QD, DOD, DQD, LSE2, DELTA, DK, DV, DQA, seq_q, seq_k, heads, groups, per_program, qk_scale,
                 scale, srb, srh,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                 sdqb, sdqs, sdqh, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                 CAUSAL: tl.constexpr, PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (key tile, batch · kv head · split): the q heads [split·per_program, (split+1)·per_program) of
    the kv head's group; writes its dK/dV to head slot ``kv head · splits + split`` of DK/DV (splits = 1:
    the gradient itself; more: partial sums the host adds up)."""
    if PDL:   # the dQ kernel after this one needs none of its results: let it start on SMs this one frees
        tl.extra.cuda.gdc_launch_dependents()
        if ATOMIC_DQ:   # dQ is added to here: the kernel before may still be writing it
            tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(1)   # grid (batch · kv heads · splits, key tiles): the heaviest causal tiles first
    pid = tl.program_id(0)
    kv_heads = heads // groups
    splits = groups // per_program
    b, slot = pid // (kv_heads * splits), pid % (kv_heads * splits)
    hk, split = slot // splits, slot % splits
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BLOCK_M)
    in_cols = (cols < seq_k)[:, None]
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + offs_d[None, :], mask=in_cols, other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + offs_d[None, :], mask=in_cols, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for g in range(split * per_program, (split + 1) * per_program):
        h = hk * groups + g
        q_ptrs = Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :]
        do_ptrs = DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :]
        l_ptrs = LSE2 + b * srb + h * srh + offs_m      # LSE2 and DELTA: (batch, heads, seq_q), rows contiguous
        d_ptrs = DELTA + b * srb + h * srh + offs_m
        dq_ptrs = DQA + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :]
        full = seq_q - seq_q % BLOCK_M
        if CAUSAL:   # query tiles crossing the diagonal (masked), then those wholly below it
            lo = pid_n * BLOCK_N
            mid = tl.minimum(lo + BLOCK_N, full)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, d_ptrs, dq_ptrs, sqs, sdos, sdqs, cols,
                                 lo, mid, seq_q, qk_scale, scale, QD, DOD, DQD, b, h * D,
                                 BLOCK_M, True, True, PREC, ATOMIC_DQ, TMA, D)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, d_ptrs, dq_ptrs, sqs, sdos, sdqs, cols,
                                 mid, full, seq_q, qk_scale, scale, QD, DOD, DQD, b, h * D,
                                 BLOCK_M, False, True, PREC, ATOMIC_DQ, TMA, D)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, d_ptrs, dq_ptrs, sqs, sdos, sdqs, cols,
                                 tl.maximum(full, lo), seq_q, seq_q, qk_scale, scale, QD, DOD, DQD, b, h * D,
                                 BLOCK_M, True, True, PREC, ATOMIC_DQ, TMA, D)
        else:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, d_ptrs, dq_ptrs, sqs, sdos, sdqs, cols,
                                 0, full, seq_q, qk_scale, scale, QD, DOD, DQD, b, h * D,
                                 BLOCK_M, False, False, PREC, ATOMIC_DQ, TMA, D)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, d_ptrs, dq_ptrs, sqs, sdos, sdqs, cols,
                                 full, seq_q, seq_q, qk_scale, scale, QD, DOD, DQD, b, h * D,
                                 BLOCK_M, True, False, PREC, ATOMIC_DQ, TMA, D)
    if PDL:   # done only once the kernel before is: what runs after may rely on both (e.g. dQ's last writer)
        tl.extra.cuda.gdc_wait()
    tl.store(DK + b * sdkb + slot * sdkh + cols[:, None] * sdks + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=in_cols)
    tl.store(DV + b * sdvb + slot * sdvh + cols[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=in_cols)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, KD, VD, b, kcol, rows, lo, hi, seq_k,
              qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
              TMA: tl.constexpr, D: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        k, v = _kv_tile(k_ptrs, v_ptrs, start, stride_kn, stride_vn, cols, seq_k, KD, VD, b, kcol, MASK, TMA,
                        BLOCK_N, D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            p = tl.where(_visible(cols, rows, seq_k, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, KD, VD, DO, LSE2, DELTA, DQ, DQF, DKP, DVP, ACCK, ACCV, seq_q, seq_k, heads, groups,
               qk_scale, scale, srb, srh, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs,
               sdqh, sum_rows, sum_per_program, sakb, saks, sakh, savb, savs, savh, final_lo, final_hi,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
               PREC: tl.constexpr, TMA: tl.constexpr, DQ_ADD: tl.constexpr, PDL: tl.constexpr,
               SUM_SPLITS: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_ADD: tl.constexpr, DQ_FINAL: tl.constexpr):
    """Program (batch · head, query tile): dQ of its rows. With ``SUM_SPLITS`` (split dK/dV) it then sums
    its share (``sum_per_program`` rows) of the dK/dV kernel's per-q-head partials into ACCK/ACCV (dK, dV;
    ``SUM_ADD``: added to what they hold, a later ring step's received accumulators) — in place of a
    separate ``_sum_splits_kernel`` launch. ``DQ_FINAL`` (a ring step): rows [final_lo, final_hi), which no
    later step touches, go to DQF (the final dQ, q's dtype and DQ's strides) instead of DQ."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)   # grid (batch · heads, query tiles): heaviest first
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    hk = h // groups
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    in_rows = rows < seq_q
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=in_rows[:, None], other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + offs_d[None, :], mask=in_rows[:, None], other=0.0)
    lse2 = tl.load(LSE2 + b * srb + h * srh + rows, mask=in_rows, other=float("inf"))
    delta = tl.load(DELTA + b * srb + h * srh + rows, mask=in_rows, other=0.0)
    k_ptrs = K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :]
    v_ptrs = V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        diag = pid_m * BLOCK_M
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, 0, diag, seq_k,
                       qk_scale, BLOCK_N, False, True, PREC, TMA, D)
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, diag,
                       tl.minimum(diag + BLOCK_M, seq_k), seq_k, qk_scale, BLOCK_N, True, True, PREC, TMA, D)
    else:
        full = seq_k - seq_k % BLOCK_N
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, 0, full, seq_k,
                       qk_scale, BLOCK_N, False, False, PREC, TMA, D)
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, full, seq_k,
                       seq_k, qk_scale, BLOCK_N, True, False, PREC, TMA, D)
    dq_ptrs = DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + offs_d[None, :]
    dq = dq * scale
    if PDL:   # the kernels before (the last step's dQ kernel among them) must be done with dQ
        tl.extra.cuda.gdc_wait()
    if DQ_ADD:   # a ring step: add into the float32 dQ of the shard
        dq += tl.load(dq_ptrs, mask=in_rows[:, None], other=0.0)
    if DQ_FINAL:   # these rows' last step: the final dQ, converted here (no conversion launch after the ring)
        final = in_rows & (rows >= final_lo) & (rows < final_hi)
        tl.store(DQF + b * sdqb + h * sdqh + rows[:, None] * sdqs + offs_d[None, :], dq.to(DQF.dtype.element_ty),
                 mask=final[:, None])
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(in_rows & ~final)[:, None])
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_rows[:, None])
    if SUM_SPLITS:   # the dK/dV kernel is done (stream order, or the gdc_wait above under PDL)
        first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * sum_per_program
        for r0 in range(first, tl.minimum(first + sum_per_program, sum_rows), SUM_ROWS):
            _sum_split_rows(DKP, DVP, ACCK, ACCV, r0 + tl.arange(0, SUM_ROWS), seq_k, heads // groups, sum_rows,
                            sakb, saks, sakh, savb, savs, savh, SUM_SPLITS, D, SUM_ADD)


def backward_rows(dout, out, lse):
    """``(delta, lse2)``, float32 ``(batch, heads, seq)``: ``rowsum(dO ∘ O)`` and the exp2-domain LSE the
    backward kernels read. A ring computes them once for its shard (the final out and LSE do not change
    between steps) and passes row views of them to every step's ``flash_backward``."""
    out, dout = _last_contiguous(out, dout)
    b, s, h, d = out.shape
    delta = torch.empty(b, h, s, dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)
    launch_keyed(_DELTA, (cdiv(s, 64), b * h), (out, dout, lse, delta, lse2),
                 (s, h, *out.stride()[:3], *dout.stride()[:3], *lse.stride()[:2], LOG2E), dict(BLOCK=64, D=d))
    return delta, lse2


class BackwardSteps:
    """What the ``flash_backward`` calls of one ring backward share (#24, host cost): every step takes the same
    q, dout, backward rows and dQ accumulator (or the same views of them) against a new K/V block. Kept by the
    caller for those calls, it works out the query side's part of the plan key once per set of those tensors
    (by identity: it holds them, so no other tensor can take their ids), and lends a later step the float32
    dK/dV partials it writes, the same two buffers every step: each step's kernels read them before the next
    step's dK/dV kernel writes them (stream order; under PDL that kernel stores only after its
    ``gdc_wait``)."""

    def __init__(self):
        self._query_sides: dict = {}
        self._buffers: dict = {}

    def query_side(self, q, dout, rows, dq_acc):
        """``(q, dout, key)``: q and dout with a contiguous last dim, and their, the rows' and dq_acc's key."""
        ident = (id(q), id(dout), rows is None or (id(rows[0]), id(rows[1])), id(dq_acc))
        got = self._query_sides.get(ident)
        if got is None:
            qc, doutc = _last_contiguous(q, dout)
            got = self._query_sides[ident] = (qc, doutc, _query_key(qc, doutc, rows, dq_acc),
                                              (q, dout, rows, dq_acc))   # the last: kept alive
        return got[0], got[1], got[2]

    def buffers(self, shape, device):
        """Two float32 tensors of ``shape``, the same ones on every call."""
        got = self._buffers.get(shape)
        if got is None:
            got = self._buffers[shape] = _new_float32_pair(shape, device)
        return got


def _new_float32_pair(shape, device):
    return tuple(torch.empty(shape, dtype=torch.float32, device=device) for _ in range(2))


def _query_key(q, dout, rows, dq_acc):
    """The query side's part of a backward plan key: what the plan reads of q, dO, the backward rows, dQ."""
    return (tensor_key(q), tensor_key(dout), rows is None or (tensor_key(rows[0]), tensor_key(rows[1])),
            tensor_key(dq_acc))


def flash_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=None, split_groups=None, rows=None,
                   dq_acc=None, dk_out=None, dv_out=None, dkv_into=None, dq_add=True, steps=None, dq_final=None):
    """``(dq, dk, dv)`` in the inputs' dtype, from the final ``out`` and float32 ``lse``.

    ``split_groups``: with GQA, one dK/dV program per *q* head (float32 partial sums added up after) instead
    of one per kv head looping over its group — more programs when there are few key tiles (a ring block
    of a short shard). ``None``: when the per-kv-head grid would not fill the GPU once (a ring rank on the
    H200: 64 programs at S8192 split, 256 at S32768 not — splitting those cost 6% of its fwd+bwd).

    A ring step (``distlab.cp.ring``) passes ``rows`` = ``backward_rows`` of these query rows (then ``out``
    and ``lse`` are not read), ``dq_acc``, a float32 ``(batch, seq_q, heads, D)`` view that dQ is *added*
    to (``dq_add=False``: written, the ring's first step, so its accumulator needs no zero fill), and
    ``dk_out``/``dv_out``, float32 ``(batch, seq_k, kv_heads, D)`` views dK/dV are written to; it gets those
    three back. Instead of ``dk_out``/``dv_out``, a later ring step passes ``dkv_into``: a callable
    that returns the float32 views dK/dV are *added* to (the accumulator this rank receives for the block),
    called after this step's dK/dV kernel is launched, so the wait for it comes after that compute (and after
    the dQ kernel too, but not with ``SPLIT_SUM=dq``, the default, where the dQ kernel's programs add the
    step's dK/dV, or the sum of its split partials, into them after their dQ: no separate launch).

    Host cost (#24): as the forward, everything that follows from shapes, strides, dtypes, alignment, flags
    and knobs — checks, tiles, split groups, grids, integer arguments — is a ``_BackwardPlan`` kept per such
    key; a known key allocates, and calls the two compiled kernels' launchers. ``steps``: a ``BackwardSteps``
    the calls of one ring backward share (the query side's key once; the partials' buffers lent).

    ``dq_final = (tensor, lo, hi)``, with ``dq_acc`` (a ring step): rows [lo, hi) of this call, which no later
    step touches, get their final dQ written into ``tensor`` (q's shape and dtype, ``dq_acc``'s strides) by
    the dQ kernel, not into ``dq_acc``: the ring's dQ needs no conversion launch at its end. The dQ kernel's
    mode only (``DISTLAB_TRITON_ATTN_DQ_MODE=kernel``, the default)."""
    if steps is not None:
        q, dout, q_side = steps.query_side(q, dout, rows, dq_acc)
        k, v = _last_contiguous(k, v)
    else:
        q, k, v, dout = _last_contiguous(q, k, v, dout)
        q_side = _query_key(q, dout, rows, dq_acc)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    sig = tensor_key   # shape, strides, dtype, pointer alignment
    key = (q_side, sig(k), sig(v), sig(dk_out), sig(dv_out), dkv_into is not None, dq_add, causal, scale,
           split_groups, q.device, knobs.generation(), dq_final is not None)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = _backward_plan(q, k, v, dout, causal, scale, split_groups, rows, dq_acc, dk_out, dv_out, dkv_into,
                              dq_add, dq_final)
        if len(_BACKWARD_PLANS) >= 4096:
            _BACKWARD_PLANS.clear()
        _BACKWARD_PLANS[key] = plan
    delta, lse2 = rows if rows is not None else backward_rows(dout, out, lse)
    device = q.device
    dq = dq_acc if dq_acc is not None else torch.empty(q.shape, dtype=q.dtype, device=device)
    if dk_out is not None or plan.dkv_dtype is None:
        dk, dv = dk_out, dv_out
    elif steps is not None and dkv_into is not None:   # a later step's float32 dK/dV, added into its accumulator
        dk, dv = steps.buffers(k.shape, device)
    else:
        dk = torch.empty(k.shape, dtype=plan.dkv_dtype, device=device)
        dv = torch.empty(v.shape, dtype=plan.dkv_dtype, device=device)
    if plan.splits > 1:   # float32 partial sums per q head, added up below
        dk_part, dv_part = (steps.buffers if steps is not None else _new_float32_pair)(plan.part_shape, device)
    else:
        dk_part, dv_part = dk, dv
    if not plan.atomic:
        dq_sum = dq
    else:   # atomics add into a float32 dQ: the ring's accumulator itself, or a zeroed one
        dq_sum = dq_acc if dq_acc is not None else torch.zeros(q.shape, dtype=torch.float32, device=device)
        if dq_acc is not None and not dq_add:
            dq_sum.zero_()
    dqd = _descriptor(dq_sum, plan.dkv_constexprs["BLOCK_M"]) if plan.atomic == 2 else dq_sum
    qd, dod = (_fast_descriptor(q, *plan.dkv_tma[0]), _fast_descriptor(dout, *plan.dkv_tma[1])) if plan.dkv_tma \
        else (q, dout)
    _DKDV(plan.dkv_key, plan.dkv_grid, (q, k, v, dout, qd, dod, dqd, lse2, delta, dk_part, dv_part, dq_sum,
                                        *plan.dkv_scalars), plan.dkv_constexprs)
    if plan.sum_splits_launch:   # one launch sums the partials
        _sum_splits(dk_part, dv_part, dk, dv, plan.splits, add=False)
    if plan.atomic:
        dq = dq_sum if dq_acc is not None else dq_sum.to(q.dtype)
    else:
        kd, vd = (_fast_descriptor(k, *plan.dq_tma[0]), _fast_descriptor(v, *plan.dq_tma[1])) if plan.dq_tma \
            else (k, v)
        # split partials: summed into dK/dV (a later ring step: added into the received accumulators) by the
        # dQ kernel's programs after their dQ (DISTLAB_TRITON_ATTN_SPLIT_SUM=dq, the default: W8 ring rank at
        # S8192 f+b 0.902 -> 0.854 ms on the H200, ring15) or by their own launch (kernel); a later ring
        # step's unsplit dK/dV likewise (one "split"; not yet timed on the H200: kernel = two add_ after). With
        # dq a ring step's wait for the received accumulator comes before the dQ launch instead of after it
        dq_key, acc_strides = plan.dq_key, plan.acc_strides
        dqf, f_lo, f_hi = dq, 0, 0
        if dq_final is not None:   # the final rows' dQ in q's dtype: key on its pointer's alignment and rows
            dqf, f_lo, f_hi = dq_final
            if dqf.stride() != dq.stride():
                raise ValueError(f"dq_final must have dq_acc's strides {dq.stride()}; got {dqf.stride()}")
            dq_key = (dq_key, dqf.data_ptr() % 16, f_lo, f_hi)
        if not plan.in_dq:
            acc_k = acc_v = dq
        elif dkv_into is None:
            acc_k, acc_v = dk, dv
        else:
            acc_k, acc_v = _received(dkv_into, k, v)
            acc_strides = (*acc_k.stride()[:3], *acc_v.stride()[:3])
            dq_key = (dq_key, acc_strides, acc_k.data_ptr() % 16, acc_v.data_ptr() % 16)
        _DQ(dq_key, plan.dq_grid, (q, k, v, kd, vd, dout, lse2, delta, dq, dqf, dk_part, dv_part, acc_k, acc_v,
                                   *plan.dq_scalars, *acc_strides, f_lo, f_hi), plan.dq_constexprs)
        if plan.in_dq and dkv_into is not None:
            return dq, acc_k, acc_v
    if dkv_into is None:
        return dq, dk, dv
    acc_k, acc_v = _received(dkv_into, k, v)   # e.g. the ring's wait for the accumulator it receives
    if plan.splits > 1:                 # the partials summed straight into the accumulators
        _sum_splits(dk_part, dv_part, acc_k, acc_v, plan.splits, add=True)
    else:
        acc_k.add_(dk)
        acc_v.add_(dv)
    return dq, acc_k, acc_v


class _BackwardPlan(NamedTuple):
    splits: int            # dK/dV programs per kv head (q heads per program: groups / splits)
    dkv_dtype: object      # dtype of the dK/dV this call allocates (None: it allocates none)
    part_shape: tuple      # the float32 per-q-head partials, when splits > 1
    atomic: int            # DQ_MODES index: 0 the dQ kernel, 1 pointer atomics, 2 TMA reduce-add
    sum_splits_launch: bool
    dkv_key: tuple         # CachedLaunch keys
    dkv_grid: tuple
    dkv_scalars: tuple
    dkv_tma: tuple         # (q's, dO's descriptor layout) or ()
    dkv_constexprs: dict
    in_dq: bool            # the dQ kernel's programs sum the split partials (or add dK/dV into dkv_into's)
    dq_key: tuple
    dq_grid: tuple
    dq_scalars: tuple      # the dQ kernel's arguments up to the accumulators' strides
    acc_strides: tuple     # those strides, unless they come with a received accumulator
    dq_tma: tuple
    dq_constexprs: dict


_BACKWARD_PLANS: dict = {}
_PLAN_IDS = itertools.count()


def _backward_plan(q, k, v, dout, causal, scale, split_groups, rows, dq_acc, dk_out, dv_out, dkv_into, dq_add,
                   dq_final=None):
    """Check a backward call and compute everything its launches need that does not depend on the data."""
    check_triton_inputs(q, k, v, causal)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if dout.shape != q.shape or dout.dtype != q.dtype:
        raise ValueError(f"dout must be {tuple(q.shape)} {q.dtype}; got {tuple(dout.shape)} {dout.dtype}")
    for name, t, shape in (("dq_acc", dq_acc, q.shape), ("dk_out", dk_out, k.shape), ("dv_out", dv_out, v.shape)):
        if t is not None and (t.shape != shape or t.dtype != torch.float32 or t.stride(-1) != 1):
            raise ValueError(f"{name} must be float32 {tuple(shape)} with a contiguous last dim; got "
                             f"{tuple(t.shape)} {t.dtype}")
    if dkv_into is not None and (dk_out is not None or dv_out is not None):
        raise ValueError("give dkv_into or dk_out/dv_out, not both")
    if (dk_out is None) != (dv_out is None):
        raise ValueError("give dk_out and dv_out together")
    mode, env, split_sum = _backward_knobs(knobs.generation())
    if dq_final is not None:
        final = dq_final[0]
        if dq_acc is None or mode != "kernel":
            raise ValueError("dq_final needs dq_acc and the dQ kernel (DISTLAB_TRITON_ATTN_DQ_MODE=kernel)")
        if final.shape != q.shape or final.dtype != q.dtype:
            raise ValueError(f"dq_final must be {tuple(q.shape)} {q.dtype}; got {tuple(final.shape)} {final.dtype}")
    if rows is not None:
        delta, lse2 = rows
        if delta.shape != (b, h, sq) or lse2.shape != delta.shape or delta.stride() != lse2.stride() \
                or delta.stride(-1) != 1:
            raise ValueError(f"the backward rows (delta, lse2) must be {(b, h, sq)}, share strides, rows contiguous")
        row_strides = delta.stride()[:2]
    else:   # backward_rows: new, contiguous
        row_strides = (h * sq, sq)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    bm, bn, warps, stages = tile_config("DKV" if rows is None else "DKV_RING", q.device, d)
    groups, tiles = h // hk, cdiv(sk, bn)
    if split_groups is None:   # env: DISTLAB_TRITON_ATTN_SPLIT_GROUPS = auto (default), 0 or 1 forces it
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 0
        split_groups = groups > 1 and (env == "1" or (env == "auto" and tiles * b * hk < sms))
    splits = groups if split_groups else 1
    # dK/dV this call allocates: none when given, or with dkv_into and split partials (summed into those)
    if dk_out is not None:
        dkv_dtype, dk_strides, dv_strides = None, dk_out.stride()[:3], dv_out.stride()[:3]
    elif dkv_into is None or splits == 1:   # with dkv_into: float32, added into the accumulators after
        dkv_dtype = torch.float32 if dkv_into is not None else k.dtype
        dk_strides = dv_strides = (sk * hk * d, hk * d, d)
    else:
        dkv_dtype, dk_strides, dv_strides = None, None, None
    part_shape = (b, sk, hk * splits, d)
    # what the dK/dV kernel writes: dK/dV, or the split partials
    part_strides = (sk * hk * splits * d, hk * splits * d, d) * 2 if splits > 1 else (*dk_strides, *dv_strides)
    dq_strides = dq_acc.stride()[:3] if dq_acc is not None else (sq * h * d, h * d, d)
    atomic = 0 if mode == "kernel" else 1
    if mode == "tma-reduce":   # the interpreter has no TMA reduce: pointer atomics there (the GPU tests check them)
        dq_sum = dq_acc if dq_acc is not None else torch.empty(q.shape, dtype=torch.float32, device=q.device)
        atomic = 2 if q.is_cuda and _tma_fits(dq_sum) else 1
    # a ring step (rows given, computed by an earlier launch) runs its kernels as programmatic dependents
    pdl = {"launch_pdl": True} if rows is not None and q.is_cuda and pdl_enabled(q.device) else {}
    dkv_tma = ("dkv" in tma_kernels() and _tma_fits(q, dout))
    plan_id = next(_PLAN_IDS)
    dkv = dict(dkv_key=("dkv", plan_id), dkv_grid=(b * hk * splits, tiles),
               dkv_scalars=(sq, sk, h, groups, groups // splits, scale * LOG2E, scale, *row_strides, *strides,
                            *part_strides, *dq_strides),
               dkv_tma=(_layout(q, bm), _layout(dout, bm)) if dkv_tma else (),
               dkv_constexprs=dict(BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal, PREC=_precision(q), ATOMIC_DQ=atomic,
                                   TMA=dkv_tma, PDL=bool(pdl), num_warps=warps, num_stages=stages, **pdl))
    sum_splits_launch = splits > 1 and dkv_into is None and bool(atomic or split_sum == "kernel")
    # the dQ kernel's programs sum the split partials into dK/dV, or add a later ring step's dK/dV (one
    # "split") into the accumulators it received: no launch of their own (SPLIT_SUM=kernel: one)
    in_dq = not atomic and split_sum == "dq" and (splits > 1 or dkv_into is not None)
    bm, bn, warps, stages = tile_config("DQ" if rows is None else "DQ_RING", q.device, d)
    dq_tma = "dq" in tma_kernels() and _tma_fits(k, v)
    grid = (b * h, cdiv(sq, bm))
    if not in_dq:
        acc_strides = (*dq_strides, *dq_strides)
    elif dkv_into is None:
        acc_strides = (*dk_strides, *dv_strides)
    else:
        acc_strides = ()   # the received accumulator's, at the call
    rows_per_program = cdiv(cdiv(b * sk * hk, grid[0] * grid[1]), 16) * 16
    return _BackwardPlan(
        splits, dkv_dtype, part_shape, atomic, sum_splits_launch, **dkv, in_dq=in_dq, dq_key=("dq", plan_id),
        dq_grid=grid, dq_scalars=(sq, sk, h, groups, scale * LOG2E, scale, *row_strides, *strides, *dq_strides,
                                  b * sk * hk, rows_per_program),
        acc_strides=acc_strides, dq_tma=(_layout(k, bn), _layout(v, bn)) if dq_tma else (),
        dq_constexprs=dict(BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal, PREC=_precision(q), TMA=dq_tma,
                           DQ_ADD=dq_acc is not None and dq_add, PDL=bool(pdl), SUM_SPLITS=splits if in_dq else 0,
                           SUM_ROWS=16, SUM_ADD=dkv_into is not None, DQ_FINAL=dq_final is not None,
                           num_warps=warps, num_stages=stages, **pdl))


@functools.lru_cache(maxsize=8)
def _backward_knobs(generation: int):
    """(DQ_MODE, SPLIT_GROUPS, SPLIT_SUM), checked; read once per knob generation (host cost, #24)."""
    mode, env, split_sum = (knobs.get(f"TRITON_ATTN_{n}") for n in ("DQ_MODE", "SPLIT_GROUPS", "SPLIT_SUM"))
    if mode not in DQ_MODES or env not in ("auto", "0", "1") or split_sum not in ("dq", "kernel"):
        raise ValueError(f"DISTLAB_TRITON_ATTN_DQ_MODE={mode!r} (use one of {', '.join(DQ_MODES)}), "
                         f"DISTLAB_TRITON_ATTN_SPLIT_GROUPS={env!r} (use auto, 0 or 1), "
                         f"DISTLAB_TRITON_ATTN_SPLIT_SUM={split_sum!r} (use dq or kernel)")
    return mode, env, split_sum


def dq_kernel_mode() -> bool:
    """dQ comes from its own kernel (``DISTLAB_TRITON_ATTN_DQ_MODE=kernel``, the default), which can write a
    ring's final rows in q's dtype (``flash_backward(dq_final=...)``), and knob ``DISTLAB_RING_DQ_FINAL`` (1,
    the default) lets it."""
    return _backward_knobs(knobs.generation())[0] == "kernel" and ring_dq_final()


def ring_dq_final() -> bool:
    """Knob ``DISTLAB_RING_DQ_FINAL``: 1 (the default) — a Triton ring's backward writes each row's final dQ in
    q's dtype from its last block's dQ kernel; 0 — a float32 dQ converted after the ring (an A/B)."""
    flag = knobs.get("RING_DQ_FINAL")
    if flag not in ("0", "1"):
        raise ValueError(f"DISTLAB_RING_DQ_FINAL={flag!r}: use 1 (final dQ from the last block) or 0")
    return flag == "1"


def _received(dkv_into, k, v):
    acc_k, acc_v = dkv_into()
    for name, t, shape in (("dkv_into()[0]", acc_k, k.shape), ("dkv_into()[1]", acc_v, v.shape)):
        if t.shape != shape or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 {tuple(shape)} with a contiguous last dim; got "
                             f"{tuple(t.shape)} {t.dtype}")
    return acc_k, acc_v


def _sum_splits(dk_part, dv_part, dk, dv, splits, add):
    b, sk, hk, d = dk.shape
    rows = b * sk * hk
    launch_keyed(_SUM_SPLITS, (cdiv(rows, 16),), (dk_part, dv_part, dk, dv),
                 (sk, hk, rows, *dk.stride()[:3], *dv.stride()[:3]),
                 dict(SPLITS=splits, ROWS=16, D=d, ADD=add, num_warps=4))


# the launches, bound once per key (host cost, #24)
_DELTA, _DKDV, _DQ, _SUM_SPLITS = map(CachedLaunch, (_delta_kernel, _dkdv_kernel, _dq_kernel, _sum_splits_kernel))
