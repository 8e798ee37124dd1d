"""SwiGLU ``silu(gate) · up`` in Triton (forward and backward) on the fused gate/up projection, and its reference.

    python -m distlab.kernels.bench --only memory --kernel swiglu

Input ``gu`` is the output of the fused gate-up GEMM, ``(…, 2F)`` = ``[gate | up]`` (as
``distlab.tp.block`` splits it); output ``(…, F)``. Forward reads 2F and writes F per row; backward reads
dy, gate and up and writes the ``(…, 2F)`` gradient: ``d gate = dy · up · σ(g)(1 + g(1 − σ(g)))``,
``d up = dy · silu(g)``, in float32 registers. Elementwise: programs of BLOCK columns of one row, on a
1-d grid whose consecutive programs walk along a row (memory order; any number of rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from distlab.kernels.launch import knob, num_warps


def swiglu_reference(gu):
    gate, up = gu.chunk(2, -1)
    return F.silu(gate) * up


@triton.jit
def _fwd(GU, Y, f, col_blocks, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    if EVICT:   # streaming reads: keep them from evicting other data in L2
        g = tl.load(GU + row * 2 * f + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        u = tl.load(GU + row * 2 * f + f + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        g = tl.load(GU + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * f + cols, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(GU, DY, DGU, f, col_blocks, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    g = tl.load(GU + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * f + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(DGU + row * 2 * f + cols, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * 2 * f + f + cols, (dy * g * sig).to(DGU.dtype.element_ty), mask=mask)


def _grid(gu):
    f = gu.shape[-1] // 2
    block = min(knob("SWIGLU_BLOCK", 2048), triton.next_power_of_2(f))
    return f, block, triton.cdiv(f, block)


def swiglu_forward(gu):
    if gu.shape[-1] % 2:
        raise ValueError(f"the fused gate/up input needs an even last dim; got {gu.shape[-1]}")
    gu = gu.contiguous()
    f, block, col_blocks = _grid(gu)
    y = torch.empty(*gu.shape[:-1], f, dtype=gu.dtype, device=gu.device)
    _fwd[(gu.numel() // (2 * f) * col_blocks,)](gu, y, f, col_blocks, BLOCK=block,
                                                 EVICT=bool(knob("SWIGLU_EVICT", 0)),
                                                 num_warps=num_warps(4 if block <= 1024 else 8))
    return y


def swiglu_backward(gu, dy):
    gu, dy = gu.contiguous(), dy.contiguous()
    f, block, col_blocks = _grid(gu)
    dgu = torch.empty_like(gu)
    _bwd[(gu.numel() // (2 * f) * col_blocks,)](gu, dy, dgu, f, col_blocks, BLOCK=block,
                                                 num_warps=num_warps(4 if block <= 1024 else 8))
    return dgu


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        return swiglu_forward(gu)

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        return swiglu_backward(gu, dy)


def swiglu(gu):
    """Differentiable ``silu(gate) · up`` of the fused ``[gate | up]`` tensor."""
    return _SwiGLU.apply(gu)
