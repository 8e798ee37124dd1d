"""Fused residual add + RMSNorm in Triton (forward and backward), and its plain-PyTorch reference.

    python -m distlab.kernels.bench --only memory --kernel rmsnorm   # GPU: % of copy bandwidth, vs torch.compile

``rmsnorm_residual(x, residual, weight, eps)`` returns ``(y, h)`` with ``h = x + residual`` (the new
residual stream; ``residual=None`` means ``h = x``) and ``y = h / sqrt(mean(h²) + eps) · weight``, the
statistics in float32, as in a pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` calls it
once per norm with the branch output as ``x``. One program per row reads x, residual and weight once and
writes y and h (and the row's 1/rms); the backward reads dy, dh (the gradient reaching h from the
residual path), h, weight and 1/rms, writes dx (= dresidual), and each program sums its rows' share of
dweight, the partial sums added once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distlab.kernels.launch import knob, num_warps


def rmsnorm_residual_reference(x, residual, weight, eps=1e-6):
    h = x if residual is None else x + residual
    hf = h.float() if h.dtype != torch.float64 else h
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(hf.dtype)).to(x.dtype)
    return y, h


@triton.jit
def _fwd(X, R, W, Y, H, RSTD, rows, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """ROWS rows per program (the weight read once for them)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    in_rows = r < rows
    mask = in_rows[:, None] & (cols < n)[None, :]
    offs = r[:, None] * n + cols[None, :]
    w = tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(H + offs, h.to(H.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / n + eps)
    tl.store(Y + offs, (h * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + r, rstd, mask=in_rows)


@triton.jit
def _bwd(DY, DH, H, W, RSTD, DX, DW_PARTIAL, rows, n, rows_per_program,
         HAS_DH: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """ROWS rows at a time (more bytes in flight per program); each program sums its rows' dweight."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_cols = cols < n
    w = tl.load(W + cols, mask=in_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    for start in range(first, last, ROWS):
        r = start + tl.arange(0, ROWS)
        mask = (r < last)[:, None] & in_cols[None, :]
        offs = r[:, None] * n + cols[None, :]
        h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=r < last, other=0.0)
        hat = h * rstd[:, None]
        dw += dy * hat
        g = dy * w[None, :]
        dx = rstd[:, None] * (g - hat * (tl.sum(g * hat, 1) / n)[:, None])
        if HAS_DH:
            dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n + cols, tl.sum(dw, 0), mask=in_cols)


def _launch_shape(n):
    block = triton.next_power_of_2(n)
    return block, num_warps(4 if block < 2048 else 8 if block < 8192 else 16)


def rmsnorm_residual_forward(x, residual, weight, eps=1e-6):
    """(y, h, rstd) on rows of ``x`` (…, n); ``h`` is ``x`` itself without a residual."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} must be ({x.shape[-1]},)")
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    r2 = residual.reshape(-1, n).contiguous() if residual is not None else x2
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    block, warps = _launch_shape(n)
    per = knob("RMSNORM_ROWS", 1)                          # a power of two
    _fwd[(triton.cdiv(x2.shape[0], per),)](x2, r2, weight, y, h, rstd, x2.shape[0], n, eps,
                                           HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=per, num_warps=warps)
    return y.view(x.shape), h.view(x.shape), rstd


def rmsnorm_residual_backward(dy, dh, h, weight, rstd):
    """(dx, dweight): dx is also the residual's gradient; ``dh`` (or None) is what reached ``h`` directly."""
    n = h.shape[-1]
    rows = h.numel() // n
    dx = torch.empty(rows, n, dtype=h.dtype, device=h.device)
    programs = min(rows, 8 * (torch.cuda.get_device_properties(h.device).multi_processor_count
                              if h.is_cuda else 1)) or 1
    per = triton.cdiv(rows, programs)
    partial = torch.empty(programs, n, dtype=torch.float32, device=h.device)
    block, warps = _launch_shape(n)
    rows_at_once = knob("RMSNORM_BWD_ROWS", max(1, min(4, 8192 // block)))   # ~8K elements per load
    dh2 = dh.reshape(rows, n).contiguous() if dh is not None else dx
    _bwd[(programs,)](dy.reshape(rows, n).contiguous(), dh2, h.reshape(rows, n).contiguous(), weight, rstd, dx,
                      partial, rows, n, per, HAS_DH=dh is not None, BLOCK=block, ROWS=rows_at_once,
                      num_warps=warps)
    return dx.view(h.shape), partial.sum(0).to(weight.dtype)


class _RMSNormResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, h, rstd = rmsnorm_residual_forward(x, residual, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.has_residual = residual is not None
        return (y, h) if ctx.has_residual else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_residual_backward(dy, dh, h, weight, rstd)
        return dx, (dx if ctx.has_residual else None), dw, None


def rmsnorm_residual(x, residual, weight, eps=1e-6):
    """Differentiable ``(y, h)`` (see module doc); with ``residual=None``, ``(y, x)``."""
    if residual is None:
        return _RMSNormResidual.apply(x, None, weight, eps), x
    return _RMSNormResidual.apply(x, residual, weight, eps)
