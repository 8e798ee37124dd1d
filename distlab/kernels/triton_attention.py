"""Flash attention in Triton (FA2-style): forward with LSE, backward, causal, GQA, and an accumulate mode.

    python -m distlab.kernels.bench --only attention          # GPU: against cuDNN / flash SDPA
    TRITON_INTERPRET=1 python -m pytest tests/test_triton_kernels.py -k attention   # CPU, fp32/fp16

Layout as in ``distlab.kernels.attention``: q ``(batch, seq_q, heads, D)``, k/v ``(batch, seq_k, kv_heads, D)``
(any strides with the last dim contiguous), LSE float32 ``(batch, heads, seq_q)``. D is a power of two
from 16 to 256; fp16/bf16 on a GPU, fp32 too under ``TRITON_INTERPRET=1`` (the CPU checks).

Forward: one program per (BLOCK_M query rows, query head). It streams the kv head's K/V in BLOCK_N tiles,
keeps the running max ``m`` and sum ``l`` of exp2-domain scores (the softmax scale times log2 e is folded
into the scores, so one ``exp2`` per score) and the unnormalised output in registers, and writes
``out = acc / l`` and ``lse = (m + log2 l) · ln 2``. Causal rows see keys ``j <= i`` (``seq_q == seq_k``):
tiles strictly below the diagonal run without a mask, only the tiles crossing it are masked; programs are
launched heaviest (last query rows) first, across heads too: the grid is (batch · heads, query tiles) with
heads varying fastest, so every head's longest tile starts before any head's shorter ones. The row max
is taken on the raw scores and scaled once, so each score costs one FMA before its ``exp2``
(``DISTLAB_TRITON_ATTN_FMA=0``: the old scale-then-subtract, for comparison).

Accumulate mode (``accumulate=True``, what a ring step uses instead of a separate merge launch): ``out``
and ``lse`` are float32 running results, possibly views of some rows of a larger buffer; the kernel merges
its block into them in place, ``lse' = logaddexp(lse, lse_b)``, ``out' = out·e^(lse−lse') +
out_b·e^(lse_b−lse')`` (a row whose running LSE is −inf takes the block's result).

Backward: ``distlab/kernels/triton_attention_backward.py`` (``flash_backward``).

Knobs, measured on the H200 (docs/PERF-archive.md): ``DISTLAB_TRITON_ATTN_TMA`` — which kernels move their
streamed tiles (K/V of the forward and dQ kernels, Q/dO of the dK/dV kernel) through TMA descriptors over
(batch, seq, heads·D): default ``auto`` — the forward, when its launch has at least ``TMA_MIN_FLOPS`` of work
(+3–7% on the GPU; below it the descriptors' host time is more than that: a host-bound launch) — ``fwd``
the forward always, ``1`` all, ``0`` none (dK/dV through TMA was 25% slower). ``DISTLAB_TRITON_ATTN_PDL=1``:
a ring's accumulating forwards (and its backward's kernels) launch as programmatic dependent launches
(``pdl_enabled``). ``DISTLAB_TRITON_ATTN_{FWD,DKV,DKV_RING,DQ,DQ_RING}``: tiles; ``DISTLAB_TRITON_ATTN_SPLIT_GROUPS``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from distlab import knobs
from distlab.kernels.launch import CachedLaunch, cdiv, sm_major, tensor_key
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634

# tile configs: (BLOCK_M, BLOCK_N, num_warps, num_stages); env DISTLAB_TRITON_ATTN_{FWD,DKV,DQ}="128,64,8,3".
# DKV_RING: the dK/dV kernel of a ring step's block (``flash_backward(rows=...)``), whose short key range
# wants smaller tiles than one call over the whole sequence (H200, ``ring9``: ring fwd+bwd 4-8% faster,
# one call 2% slower); DQ_RING: the dQ kernel of a ring step (``distlab.kernels.tune_attention --ring-step``)
_GPU_DEFAULTS = {"FWD": (64, 64, 4, 3), "DKV": (64, 128, 8, 3), "DKV_RING": (32, 64, 4, 3), "DQ": (128, 64, 8, 3),
                 "DQ_RING": (128, 64, 8, 3)}
_CPU = {"FWD": (32, 16, 4, 1), "DKV": (16, 32, 4, 1), "DKV_RING": (16, 32, 4, 1), "DQ": (32, 16, 4, 1),
        "DQ_RING": (32, 16, 4, 1)}
# causal loops need BLOCK_M % BLOCK_N == 0 (FWD, DQ, DQ_RING) and BLOCK_N % BLOCK_M == 0 (DKV, DKV_RING)


def tile_config(kind: str, device: torch.device, head_dim: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a kernel: the knob, else the device's defaults (worked out
    once per knob value, device type and head_dim: this runs on every launch)."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _tile_config_now(kind, device_type, head_dim, knobs.generation())


@functools.lru_cache(maxsize=256)
def _tile_config_now(kind: str, device_type: str, head_dim: int, generation: int):
    """``_tile_config`` with the knob read once per knob generation (``distlab.knobs.generation``)."""
    return _tile_config(kind, knobs.get(f"TRITON_ATTN_{kind}"), device_type, head_dim)


@functools.lru_cache(maxsize=256)
def _tile_config(kind: str, env, device_type: str, head_dim: int):
    if env:
        bm, bn, w, s = (int(x) for x in env.split(","))
    elif device_type != "cuda":
        bm, bn, w, s = _CPU[kind]
    else:
        bm, bn, w, s = _GPU_DEFAULTS[kind]
        if head_dim > 128:
            bm, bn, s = min(bm, 64), min(bn, 64), 1
    big, small = (bn, bm) if kind.startswith("DKV") else (bm, bn)
    if big % small:
        raise ValueError(f"{kind} tiles {bm}x{bn}: the {'key' if kind.startswith('DKV') else 'query'} tile must be a multiple "
                         f"of the other")
    return bm, bn, w, s


# ----------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _kv_tile(k_ptrs, v_ptrs, start, stride_kn, stride_vn, cols, seq_k, KD, VD, b, kcol, MASK: tl.constexpr,
             TMA: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """The K and V tile of keys ``start + [0, BLOCK_N)`` (rows past seq_k as zeros when MASK) — through the
    pointers, or with TMA through the (batch, seq, kv_heads·D) descriptors KD/VD (zero-filled past seq_k)."""
    if TMA:
        k = KD.load([b, start, kcol]).reshape(BLOCK_N, D)
        v = VD.load([b, start, kcol]).reshape(BLOCK_N, D)
    elif MASK:
        k = tl.load(k_ptrs + start * stride_kn, mask=(cols < seq_k)[:, None], other=0.0)
        v = tl.load(v_ptrs + start * stride_vn, mask=(cols < seq_k)[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + start * stride_kn)
        v = tl.load(v_ptrs + start * stride_vn)
    return k, v


@triton.jit
def _visible(cols, rows, seq_k, CAUSAL: tl.constexpr):
    """Which (query row, key column) pairs of a tile exist (key < seq_k) and, causal, are not in the future."""
    visible = cols[None, :] < seq_k
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    return visible


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, KD, VD, b, kcol, rows, lo, hi, seq_k,
               qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
               TMA: tl.constexpr, D: tl.constexpr, FMA: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        k, v = _kv_tile(k_ptrs, v_ptrs, start, stride_kn, stride_vn, cols, seq_k, KD, VD, b, kcol, MASK, TMA,
                        BLOCK_N, D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASK:
            s = tl.where(_visible(cols, rows, seq_k, CAUSAL), s, float("-inf"))
        if FMA:   # the row max of the raw scores, scaled once; then one FMA per score (qk_scale > 0)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        else:
            s = s * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_all_keys(acc, m_i, l_i, q, k_ptrs, v_ptrs, sks, svs, KD, VD, b, kcol, rows, seq_k, qk_scale,
                  BLOCK_N: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, D: tl.constexpr, FMA: tl.constexpr):
    """Every key of a block, no causal mask: the whole tiles unmasked, then the last partial tile masked."""
    full = seq_k - seq_k % BLOCK_N
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_ptrs, v_ptrs, sks, svs, KD, VD, b, kcol, rows, 0, full, seq_k,
                               qk_scale, BLOCK_N, False, False, PREC, TMA, D, FMA)
    return _fwd_tiles(acc, m_i, l_i, q, k_ptrs, v_ptrs, sks, svs, KD, VD, b, kcol, rows, full, seq_k, seq_k, qk_scale,
                      BLOCK_N, True, False, PREC, TMA, D, FMA)


@triton.jit
def _fwd_later_block(acc, m_i, l_i, q, K, V, KD, VD, seq_k, lo, hi, first, rows, b, hk, skb, sks, skh, svb, svs, svh,
                     qk_scale, BLOCK_N: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, D: tl.constexpr,
                     FMA: tl.constexpr):
    """A later block of a launch (another ring step): rows [lo, hi) see all of its keys."""
    if (first >= lo) & (first < hi):
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        k_ptrs = K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :]
        v_ptrs = V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :]
        acc, m_i, l_i = _fwd_all_keys(acc, m_i, l_i, q, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, seq_k,
                                      qk_scale, BLOCK_N, PREC, TMA, D, FMA)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, KD, VD, K2, V2, KD2, VD2, K3, V3, KD3, VD3, K4, V4, KD4, VD4, O, LSE, FO, seq_q, seq_k,
                seq_k2, seq_k3, seq_k4, heads, groups, qk_scale, row0, lo1, hi1, lo2, hi2, lo3, hi3, lo4, hi4,
                final_lo, final_hi,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, s2kb, s2ks, s2kh, s2vb, s2vs, s2vh,
                sob, sos, soh, slb, slh, sfb, sfs, sfh,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                PDL: tl.constexpr, FMA: tl.constexpr, FINAL: tl.constexpr, BLOCKS: tl.constexpr):
    if PDL:   # let the next step's kernel start on SMs this one's last wave leaves idle
        tl.extra.cuda.gdc_launch_dependents()
    # grid (batch · heads, query tiles), heads fastest: every head's heaviest causal tile is launched
    # before any head's lighter ones (longest first), so no heavy program is left for the tail
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    hk = h // groups
    first = row0 + pid_m * BLOCK_M   # the tiles cover rows [row0, ...): the union of the blocks' rows
    rows = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=(rows < seq_q)[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_ptrs = K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :]
    v_ptrs = V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :]
    run1 = True   # block 1: query rows [lo1, hi1) against K, V (with one block: every tile)
    if BLOCKS > 1:
        run1 = (first >= lo1) & (first < hi1)
    if run1:
        if CAUSAL:   # unmasked tiles left of the diagonal block, then the masked diagonal tiles
            acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, 0,
                                       first, seq_k, qk_scale, BLOCK_N, False, True, PREC, TMA, D, FMA)
            acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, first,
                                       tl.minimum(first + BLOCK_M, seq_k), seq_k, qk_scale, BLOCK_N, True, True, PREC,
                                       TMA, D, FMA)
        else:
            acc, m_i, l_i = _fwd_all_keys(acc, m_i, l_i, q, k_ptrs, v_ptrs, sks, svs, KD, VD, b, hk * D, rows, seq_k,
                                          qk_scale, BLOCK_N, PREC, TMA, D, FMA)
    # blocks 2-4 (later ring steps in the same launch; one set of strides): rows [lo, hi) see all their keys
    if BLOCKS > 1:
        acc, m_i, l_i = _fwd_later_block(acc, m_i, l_i, q, K2, V2, KD2, VD2, seq_k2, lo2, hi2, first, rows, b, hk,
                                         s2kb, s2ks, s2kh, s2vb, s2vs, s2vh, qk_scale, BLOCK_N, PREC, TMA, D, FMA)
    if BLOCKS > 2:
        acc, m_i, l_i = _fwd_later_block(acc, m_i, l_i, q, K3, V3, KD3, VD3, seq_k3, lo3, hi3, first, rows, b, hk,
                                         s2kb, s2ks, s2kh, s2vb, s2vs, s2vh, qk_scale, BLOCK_N, PREC, TMA, D, FMA)
    if BLOCKS > 3:
        acc, m_i, l_i = _fwd_later_block(acc, m_i, l_i, q, K4, V4, KD4, VD4, seq_k4, lo4, hi4, first, rows, b, hk,
                                         s2kb, s2ks, s2kh, s2vb, s2vs, s2vh, qk_scale, BLOCK_N, PREC, TMA, D, FMA)
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634
    out = acc / l_i[:, None]
    in_rows = rows < seq_q
    o_ptrs = O + b * sob + h * soh + rows[:, None] * sos + offs_d[None, :]
    l_ptrs = LSE + b * slb + h * slh + rows
    if PDL:   # the previous step's kernel may still be writing (out, lse): wait for all of it
        tl.extra.cuda.gdc_wait()
    if ACCUMULATE:   # merge into the running float32 (out, lse)
        prev = tl.load(l_ptrs, mask=in_rows, other=float("-inf"))
        new = tl.maximum(prev, lse) + tl.log(1.0 + tl.exp(-tl.abs(prev - lse)))
        new = tl.where(prev == float("-inf"), lse, new)
        w_prev = tl.where(prev == float("-inf"), 0.0, tl.exp(prev - new))
        w_blk = tl.exp(lse - new)
        o_prev = tl.load(o_ptrs, mask=in_rows[:, None], other=0.0)
        out = o_prev * w_prev[:, None] + out * w_blk[:, None]
        lse = new
    if FINAL:   # rows [final_lo, final_hi) see no later block: their result goes to FO in its dtype, not to O
        final = in_rows & (rows >= final_lo) & (rows < final_hi)
        tl.store(FO + b * sfb + h * sfh + rows[:, None] * sfs + offs_d[None, :], out.to(FO.dtype.element_ty),
                 mask=final[:, None])
        in_rows = in_rows & ~final
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_rows[:, None])
    tl.store(l_ptrs, lse, mask=rows < seq_q)


def check_triton_inputs(q, k, v, causal):
    d = q.shape[-1]
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"the Triton attention kernel takes head_dim 16, 32, 64, 128 or 256; got {d}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the Triton attention kernel takes fp16, bf16 or fp32; got {q.dtype}")
    if q.dtype == torch.float32 and q.is_cuda:
        # fp32 is the interpreter's checking path; on the H200 its kernels did not compile within a minute
        raise ValueError("the Triton attention kernel runs fp16/bf16 on a GPU (fp32 only under TRITON_INTERPRET=1); "
                         "use sdpa-efficient or torch for fp32")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs seq_q == seq_k; got {q.shape[1]} and {k.shape[1]}")
    if k.shape[1] == 0:
        raise ValueError("the Triton attention kernel needs at least one key")


def _precision(q):
    """fp32 inputs (the interpreter's checking path): exact fp32 dots, not TF32."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


TMA_KERNELS = ("fwd", "dq", "dkv")
TMA_DEFAULT = "auto"  # the H200 (``next`` call): forward +3% (MHA) / +7% (GQA); all three: backward -18%
# ``auto``: a forward launch below this much work (FLOPs) runs without TMA. H200, S2048, 4 q / 1 kv heads,
# causal (4.3 GFLOP): host 35.2 µs / GPU 26.4 with TMA, 26.0 / 29.5 without (docs/PERF.md: a launch that
# small waits on the host, so the one without descriptors is done first); at S8192, 32 heads (550 GFLOP)
# the GPU time is ~1 ms and TMA's +3–7% is what counts. The bar sits where the GPU time (~60 µs at 500
# TFLOP/s) passes the host time with descriptors.
TMA_MIN_FLOPS = 3e10


def tma_kernels() -> tuple[str, ...]:
    """The kernels whose tiles move through TMA descriptors: ``DISTLAB_TRITON_ATTN_TMA`` = ``0`` (none),
    ``1`` (all), a comma list of fwd, dq, dkv, or ``auto`` (the default: fwd, for launches of at least
    ``TMA_MIN_FLOPS``, see ``tma_by_size``)."""
    return _tma_now(knobs.generation())[1]


def tma_by_size() -> bool:
    """The knob is ``auto``: the forward uses TMA only for launches of at least ``TMA_MIN_FLOPS``."""
    return _tma_now(knobs.generation())[0] == "auto"


@functools.lru_cache(maxsize=8)
def _tma_now(generation: int) -> tuple[str, tuple[str, ...]]:
    """(the knob's value, the kernels it names), read once per knob generation."""
    env = knobs.get("TRITON_ATTN_TMA")
    return env, _tma_kinds(env)


@functools.lru_cache(maxsize=64)
def _tma_kinds(env: str) -> tuple[str, ...]:
    kinds = {"0": (), "1": TMA_KERNELS, "auto": ("fwd",)}.get(env, tuple(x for x in env.split(",") if x))
    if any(k not in TMA_KERNELS for k in kinds):
        raise ValueError(f"DISTLAB_TRITON_ATTN_TMA={env!r}: use 0, 1, auto or a comma list of "
                         f"{', '.join(TMA_KERNELS)}")
    return kinds


def _tma_fits(*ts) -> bool:
    """TMA can address these (batch, seq, heads, D) tensors as (batch, seq, heads·D): heads packed in a
    token, 16-byte aligned base and strides, on sm_90+ (or in the interpreter)."""
    if ts[0].is_cuda and sm_major(ts[0].device) < 9:
        return False
    d, e = ts[0].shape[-1], ts[0].element_size()
    return not any(t.stride(2) != d or t.data_ptr() % 16 or (t.stride(0) * e) % 16 or (t.stride(1) * e) % 16
                   for t in ts)


def _descriptor(t, block):
    return TensorDescriptor(t, *_layout(t, block))


def _tile_descriptors(kind, k, v, block_n):
    """``(KD, VD, True)``: TMA descriptors over two (batch, seq, heads, D) tensors (k and v, or q and dO),
    blocks of (1, block_n, D), when ``kind`` is in ``tma_kernels()`` and ``_tma_fits``; else
    ``(k, v, False)`` (pointer loads)."""
    if kind not in tma_kernels() or not _tma_fits(k, v):
        return k, v, False
    return _descriptor(k, block_n), _descriptor(v, block_n), True


def pdl_enabled(device) -> bool:
    """``DISTLAB_TRITON_ATTN_PDL=1`` on sm_90+: accumulating forwards launch as programmatic dependents —
    a ring step's kernel runs its key loop while the previous step's last wave finishes, and waits for it
    (``griddepcontrol.wait``) only before it reads and writes the running (out, lse)."""
    return knobs.get("TRITON_ATTN_PDL") == "1" and sm_major(device) >= 9


def _last_contiguous(*ts):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def flash_forward(q, k, v, causal=False, softmax_scale=None, out=None, lse=None, accumulate=False, final_out=None,
                  final_rows=None):
    """``(out, lse)``. Without ``out``/``lse``: new tensors (out in q's dtype). With them: written there
    (e.g. float32 accumulators); ``accumulate=True`` merges into what they hold (see module doc).

    ``final_out`` (shaped like q, any float dtype) with ``final_rows = (lo, hi)``: the results of query rows
    [lo, hi) are written there instead of to ``out`` — a ring's last block for those rows, so no
    conversion of the accumulator follows (their ``lse`` is still written)."""
    return flash_forward_blocks(q, [(0, q.shape[1], k, v, causal)], softmax_scale, out, lse, accumulate, final_out,
                                final_rows)


MAX_BLOCKS = 4   # ring steps one forward launch can take (``flash_forward_blocks``)


def blocks_fit_one_launch(q, blocks) -> bool:
    """Whether ``flash_forward_blocks`` can run ``blocks`` (a list of ``(lo, hi, k, v, causal)``) in one
    launch: at most ``MAX_BLOCKS``, only the first causal, every row range starting on a query tile, the
    K/V of the later blocks with one set of strides (as a ring's received buffers have)."""
    bm = tile_config("FWD", q.device, q.shape[-1])[0]
    later = [t.stride() for _, _, kb, vb, _ in blocks[1:] for t in (kb, vb)]
    return len(blocks) <= MAX_BLOCKS and not any(c for *_, c in blocks[1:]) \
        and all(lo % bm == 0 for lo, *_ in blocks) and all(st[-1] == 1 for st in later) \
        and all(st == later[0] for st in later[2::2]) and all(st == later[1] for st in later[3::2])


def flash_forward_blocks(q, blocks, softmax_scale=None, out=None, lse=None, accumulate=False, final_out=None,
                         final_rows=None):
    """Attention of query rows against up to four K/V blocks in one launch, as ``flash_forward`` (same
    ``out``/``lse``/``accumulate``/``final_*``, rows absolute in q). ``blocks``: ``[(lo, hi, k, v, causal)]``
    — query rows [lo, hi) see all of that block's keys (causal: the first block only, covering every row,
    with as many keys as q rows). A row's softmax runs over every block that covers it. Several ring steps
    then cost one launch: one epilogue, and one longer key loop for the rows they share.
    Raises unless ``blocks_fit_one_launch``; the rows the blocks cover must be one range.

    Host cost (#24): everything computed from shapes, strides, dtypes, flags and knobs — the checks, the
    grid, the integer arguments, whether TMA is used — is a ``_ForwardPlan`` kept per such key; a call with
    a known key only allocates what it must, builds the two-per-block TMA descriptors and goes straight to
    the compiled kernel's launcher (``distlab.kernels.launch.CachedLaunch``)."""
    (lo1, hi1, k, v, causal), *later = blocks
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = _last_contiguous(q, k, v)
        blocks = [(lo1, hi1, k, v, causal), *later]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if scale < 0:   # the kernel takes a row's max before scaling (one FMA per score): keep the scale positive
        q, scale = -q, -scale
    sig = tensor_key   # shape, strides, dtype, pointer alignment: what the plan and Triton's binding read
    if out is None:    # new out and lse: their strides follow from q's, their pointers are aligned
        if accumulate:
            raise ValueError("accumulate=True needs the running out and lse")
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
        outs = None
    else:
        outs = (sig(out), sig(lse))
    fo = final_out if final_out is not None else out
    key = (sig(q), tuple([(lo, hi, sig(kb), sig(vb), c) for lo, hi, kb, vb, c in blocks]), scale, outs,
           None if final_out is None else (sig(final_out), final_rows and tuple(final_rows)), accumulate, q.device,
           knobs.generation())
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = _forward_plan(q, blocks, scale, out, lse, accumulate, final_out, final_rows)
        if len(_FORWARD_PLANS) >= 4096:
            _FORWARD_PLANS.clear()
        _FORWARD_PLANS[key] = plan
    kvs = [(kb, vb) for _, _, kb, vb, _ in blocks]
    if plan.tma:
        descs = [(_fast_descriptor(kb, *k_layout), _fast_descriptor(vb, *v_layout))
                 for (kb, vb), (k_layout, v_layout) in zip(kvs, plan.tma)]
    else:
        descs = kvs
    slots = [x for (kb, vb), (kd, vd) in zip(kvs[1:], descs[1:]) for x in (kb, vb, kd, vd)]
    slots += [None] * (4 * (MAX_BLOCKS - 1) - len(slots))   # unused block slots: constexpr None
    _FORWARD_LAUNCH(key, plan.grid, (q, k, v, *descs[0], *slots, out, lse, fo, *plan.scalars), plan.constexprs)
    return out, lse


class _ForwardPlan(NamedTuple):
    grid: tuple
    scalars: tuple      # the kernel's integer and float arguments, in order
    tma: tuple          # per block: K's and V's descriptor (shape, strides, block), or () for pointer loads
    constexprs: dict    # and launch options


_FORWARD_PLANS: dict = {}


def _forward_plan(q, blocks, scale, out, lse, accumulate, final_out, final_rows):
    """Check a forward launch and compute everything it needs that does not depend on the data."""
    if not blocks_fit_one_launch(q, blocks):
        raise ValueError(f"flash_forward_blocks: at most {MAX_BLOCKS} blocks, only the first causal, each starting "
                         f"on a query tile of {tile_config('FWD', q.device, q.shape[-1])[0]} rows, the later blocks' "
                         f"K/V strided alike; got {[(lo, hi, c) for lo, hi, _, _, c in blocks]}")
    (lo1, hi1, k, v, causal), *later = blocks
    for lo, hi, kb, vb, c in blocks:
        check_triton_inputs(q[:, lo:hi], kb, vb, c)
        if not 0 <= lo < hi <= q.shape[1] or kb.shape[2:] != k.shape[2:] or kb.dtype != k.dtype:
            raise ValueError(f"flash_forward_blocks: block rows [{lo}, {hi}) of {q.shape[1]}, or K/V of another "
                             f"shape or dtype")
    if causal and (lo1, hi1) != (0, q.shape[1]):
        raise ValueError("flash_forward_blocks: a causal block covers every query row")
    span = sorted((lo, hi) for lo, hi, *_ in blocks)
    reach = span[0][1]
    for lo, hi in span[1:]:
        if lo > reach:
            raise ValueError(f"flash_forward_blocks: the blocks' rows {span} leave a gap")
        reach = max(reach, hi)
    row0, row1 = span[0][0], reach
    b, sq, h, d = q.shape
    if out.shape != q.shape or lse.shape != (b, h, sq) or lse.dtype != torch.float32 or out.stride(-1) != 1 \
            or lse.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} (last dim contiguous) and lse float32 {(b, h, sq)}; "
                         f"got {tuple(out.shape)} and {tuple(lse.shape)} {lse.dtype}")
    if final_out is not None and (final_out.shape != q.shape or final_out.stride(-1) != 1 or final_rows is None):
        raise ValueError(f"final_out must be {tuple(q.shape)} with a contiguous last dim, and final_rows (lo, hi) given")
    fo, (f_lo, f_hi) = (final_out, final_rows) if final_out is not None else (out, (0, 0))
    bm, bn, warps, stages = tile_config("FWD", q.device, d)
    # TMA descriptors for every block's K/V, or pointers for all of them when one block cannot use TMA
    kvs = [(kb, vb) for _, _, kb, vb, _ in blocks]
    flops = 4 * b * h * d * sum((hi - lo) * kb.shape[1] * (0.5 if c else 1) for lo, hi, kb, _, c in blocks)
    tma = all(_tile_descriptors("fwd", kb, vb, bn)[2] for kb, vb in kvs) \
        and (not tma_by_size() or flops >= TMA_MIN_FLOPS)
    k2, v2 = kvs[1] if len(kvs) > 1 else (k, v)
    los_his = [x for lo, hi, *_ in later for x in (lo, hi)] + [0, 0] * (MAX_BLOCKS - len(blocks))
    seqs = [kb.shape[1] for kb, _ in kvs[1:]] + [k.shape[1]] * (MAX_BLOCKS - len(blocks))
    scalars = (sq, k.shape[1], *seqs, h, h // k.shape[2], scale * LOG2E, row0, lo1, hi1, *los_his, f_lo, f_hi,
               *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *k2.stride()[:3], *v2.stride()[:3],
               *out.stride()[:3], *lse.stride()[:2], *fo.stride()[:3])
    # PDL: an accumulating step launches as a dependent of the kernel before it; every forward lets its
    # dependents start early (they wait for it before touching what it writes)
    use_pdl = q.is_cuda and pdl_enabled(q.device)
    constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal, ACCUMULATE=accumulate, PREC=_precision(q),
                      TMA=tma, PDL=use_pdl, FMA=knobs.get("TRITON_ATTN_FMA") == "1", FINAL=final_out is not None,
                      BLOCKS=len(blocks), num_warps=warps, num_stages=stages)
    if accumulate and use_pdl:
        constexprs["launch_pdl"] = True
    descs = tuple((_layout(kb, bn), _layout(vb, bn)) for kb, vb in kvs) if tma else ()
    return _ForwardPlan((b * h, cdiv(row1 - row0, bm)), scalars, descs, constexprs)


def _layout(t, block):
    """A (batch, seq, heads, D) tensor seen by TMA as (batch, seq, heads·D): (shape, strides, block shape)."""
    b, s, h, d = t.shape
    return [b, s, h * d], [t.stride(0), t.stride(1), 1], [1, block, d]


def _fast_descriptor(t, shape, strides, block):
    """``TensorDescriptor(t, shape, strides, block)`` without its checks (the plan made them once for this
    shape, strides and alignment): a microsecond instead of ten."""
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=shape, strides=strides, block_shape=block, padding="zero")
    return desc


_FORWARD_LAUNCH = CachedLaunch(_fwd_kernel)
