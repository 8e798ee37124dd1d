"""The softmax gradient of a chunk of logits, in place, in Triton: the chunk step of fused linear + CE.

    TRITON_INTERPRET=1 DISTLAB_FUSED_CE_TRITON=1 python -m pytest tests/test_fused_ce.py -k triton   # CPU
    python -m distlab.kernels.fused_linear_ce --tokens 8192 --hidden 4096 --vocab 128256              # GPU

``distlab.kernels.fused_linear_ce`` walks the tokens a chunk at a time. With these two kernels a chunk's
logits stay in the GEMM's dtype (bf16) and are read three times and written once, instead of a float32
copy and half a dozen PyTorch passes over it (Liger-Kernel's approach):

- ``chunk_stats(logits, target, mine)``: per row, one pass with an online max: the local log-sum-exp, the
  target's logit where this rank holds it (``mine``), and the logits' sum (label smoothing), float32. Under
  TP the caller all-gathers these and takes the global log-sum-exp.
- ``chunk_grad_(logits, lse, target, mine, scale, smoothing, vocab)``: overwrites the logits with
  ``(softmax − (1−ε)·onehot − ε/V) · scale`` (``scale``: 1/count for kept rows, 0 for ignored ones), in
  their own dtype — the operand of the two GEMMs that follow (dx, dW).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stats(L, T, MINE, LSE, TGT, SUM, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = L + row.to(tl.int64) * stride
    m = tl.zeros([], tl.float32) - float("inf")
    s = tl.zeros([], tl.float32)
    total = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        total += tl.sum(tl.where(cols < V, x, 0.0), 0)
        m = m_new
    t = tl.load(T + row)
    mine = tl.load(MINE + row) != 0
    target_logit = tl.load(base + tl.where(mine, t, 0)).to(tl.float32)
    tl.store(LSE + row, m + tl.log(s))
    tl.store(TGT + row, tl.where(mine, target_logit, 0.0))
    tl.store(SUM + row, total)


@triton.jit
def _grad(L, LSE, T, MINE, SCALE, V, stride, on_target, everywhere, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = L + row.to(tl.int64) * stride
    lse = tl.load(LSE + row)
    t = tl.load(T + row)
    mine = tl.load(MINE + row) != 0
    scale = tl.load(SCALE + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where((cols == t) & mine, on_target, 0.0) - everywhere
        tl.store(base + cols, (g * scale).to(L.dtype.element_ty), mask=cols < V)


def _launch(logits):
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"chunk logits must be (rows, vocab) with a contiguous last dim; got {tuple(logits.shape)}")
    block = min(triton.next_power_of_2(logits.shape[1]), 4096)
    return (logits.shape[0],), block, (8 if block >= 2048 else 4)


def chunk_stats(logits, target, mine):
    """(lse, target logit (0 where not ``mine``), sum) per row, float32; ``target``: local ids (any value
    where not ``mine``), ``mine``: bool."""
    grid, block, warps = _launch(logits)
    rows = logits.shape[0]
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    t = target.clamp(0, logits.shape[1] - 1).to(torch.int32).contiguous()
    _stats[grid](logits, t, mine.to(torch.int8).contiguous(), out[0], out[1], out[2], logits.shape[1],
                 logits.stride(0), BLOCK=block, num_warps=warps)
    return out[0], out[1], out[2]


def chunk_grad_(logits, lse, target, mine, scale, smoothing: float, vocab: int):
    """Overwrite ``logits`` with ``(exp(logits − lse) − (1−ε)·[target, mine] − ε/vocab) · scale``; returns it."""
    grid, block, warps = _launch(logits)
    t = target.clamp(0, logits.shape[1] - 1).to(torch.int32).contiguous()
    _grad[grid](logits, lse.float().contiguous(), t, mine.to(torch.int8).contiguous(), scale.float().contiguous(),
                logits.shape[1], logits.stride(0), 1.0 - smoothing, smoothing / vocab, BLOCK=block, num_warps=warps)
    return logits
