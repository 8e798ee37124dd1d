"""RoPE on Q and K in one Triton launch (forward and backward), and its reference.

    python -m distlab.kernels.bench --only memory --kernel rope

Rotate-half RoPE as ``distlab.tp.block.rope``: for each head, with ``x = [x1, x2]`` (halves of head_dim)
and angle ``θ_i = pos · base^(−2i/d)``: ``[x1 cos θ − x2 sin θ, x2 cos θ + x1 sin θ]``. The cos/sin tables
``(seq, d/2)`` float32 are computed once per positions with the reference's own formula (so the kernel's
angles are bit-identical to it; computing ``pos · base^(−2i/d)`` inside would differ by ~pos · 1 ulp).
One program per token (or ``DISTLAB_KERNEL_ROPE_TOKENS`` tokens) rotates all of its q heads and k heads,
reading the table row once; the backward is
the same kernel rotating by −θ (a rotation's transpose).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distlab.kernels.launch import knob, num_warps


def rope_tables(positions, head_dim, base=10000.0, device=None):
    """(cos, sin) float32 (seq, head_dim/2), as ``distlab.tp.block.rope`` computes them."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = positions.to(device=device, dtype=torch.float32)[:, None] * inv[None]
    return ang.cos().contiguous(), ang.sin().contiguous()


def rope_reference(x, cos, sin):
    """x (b, s, h, d), tables (s, d/2) -> rotated x, computed in float32."""
    half = x.shape[-1] // 2
    c, s_ = cos[None, :, None], sin[None, :, None]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1).to(x.dtype)


@triton.jit
def _rotate_heads(X, OUT, row, seq, heads, cos, sin, sxb, sxs, sxh, HB: tl.constexpr, HALF: tl.constexpr):
    b, s = row // seq, row % seq
    offs_h = tl.arange(0, HB)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < heads)[:, None]
    base = X + b * sxb + s * sxs + offs_h[:, None] * sxh + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out = OUT + row * heads * 2 * HALF + offs_h[:, None] * 2 * HALF + offs_d[None, :]
    tl.store(out, (x1 * cos[None, :] - x2 * sin[None, :]).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, seq, tokens, hq, hk, sqb, sqs, sqh, skb, sks, skh, sign,
                 HQB: tl.constexpr, HKB: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr):
    """TOKENS consecutive tokens per program, all their q and k heads."""
    offs_d = tl.arange(0, HALF)
    for i in range(TOKENS):
        row = tl.program_id(0).to(tl.int64) * TOKENS + i
        if row < tokens:
            s = row % seq
            cos = tl.load(COS + s * HALF + offs_d)
            sin = tl.load(SIN + s * HALF + offs_d) * sign
            _rotate_heads(Q, QO, row, seq, hq, cos, sin, sqb, sqs, sqh, HQB, HALF)
            _rotate_heads(K, KO, row, seq, hk, cos, sin, skb, sks, skh, HKB, HALF)


def rope_qk_forward(q, k, cos, sin, inverse=False):
    """(q', k'), contiguous, in the inputs' dtype; ``inverse`` rotates by −θ (the backward)."""
    b, s, hq, d = q.shape
    if k.shape[:2] != (b, s) or k.shape[3] != d or cos.shape != (s, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)} and tables {tuple(cos.shape)} do not fit "
                         f"(tables (seq, head_dim/2))")
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"the Triton RoPE kernel takes a head_dim that is twice a power of two; got {d}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    per = knob("ROPE_TOKENS", 1)
    _rope_kernel[(triton.cdiv(b * s, per),)](
        q, k, qo, ko, cos.float().contiguous(), sin.float().contiguous(), s, b * s, hq, k.shape[2],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), -1.0 if inverse else 1.0,
        HQB=triton.next_power_of_2(hq), HKB=triton.next_power_of_2(k.shape[2]), HALF=d // 2, TOKENS=per,
        num_warps=num_warps(4))
    return qo, ko


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_qk_forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_qk_forward(dq, dk, cos, sin, inverse=True)
        return dq, dk, None, None


def rope_qk(q, k, cos, sin):
    """Differentiable RoPE of q (b, s, hq, d) and k (b, s, hk, d) with tables from ``rope_tables``."""
    return _RopeQK.apply(q, k, cos, sin)
