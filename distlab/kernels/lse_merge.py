"""The log-sum-exp merge of partial attention results: the plain-PyTorch reference, and one Triton launch.

    python -m pytest tests/test_merge.py
    python -m distlab.kernels.bench --only memory --kernel merge      # GPU: the Triton merge, % of copy

Attention over keys split into blocks A and B is recovered from the block results:

    lse = log(exp(lse_A) + exp(lse_B))
    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

Everything is done in float32 (float64 stays float64). A row that saw no key in a block has ``lse = -inf``
there (every distlab kernel reports it so); such a block contributes nothing, so its garbage output can
neither turn the row into NaN nor erase what the other block found. A row that sees no key in any block
ends with ``lse = -inf`` and ``out = 0``. Anything else that is not finite is the inputs' doing and must
reach the output as the one-device math gives it: a NaN LSE (a NaN in q, or in a visible key or value)
makes the row NaN, a ``+inf`` LSE (an infinite score) makes it NaN too, as ``softmax`` does.

Shapes follow the attention convention: ``out`` ``(batch, seq, heads, head_dim)``, ``lse``
``(batch, heads, seq)``.

``lse_merge_`` is the same rule in one Triton kernel, for backends that cannot accumulate (cuDNN, flash
SDPA): a ring step's block result is merged into the float32 running ``(out, lse)`` in place, instead of
about ten elementwise launches. ``out``/``lse`` may be views of some rows of a larger buffer (a zigzag half
block). One program per (batch, BLOCK rows, head), head_dim wide. The kernel is defined on first use, so
this file imports without triton.
"""

from __future__ import annotations

import functools

import torch

from distlab.kernels.launch import CachedLaunch, cdiv, knob, launch_keyed, num_warps


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_attention(out, lse, block_out, block_lse):
    """Merge ``(block_out, block_lse)`` into the running ``(out, lse)``; return the new pair.

    ``out``/``lse`` may be ``None`` (nothing merged yet). Results are float32 (float64 for float64 inputs).
    The weights are computed on the small LSE tensors; the output-sized work is one masked copy of the
    block, one scale and one fused multiply-add.
    """
    ct = _acc_dtype(block_out.dtype)
    block_lse = block_lse.to(ct)
    seen = (block_lse != float("-inf")).transpose(1, 2).unsqueeze(-1)   # NaN counts as seen: it must show
    block_out = torch.where(seen, block_out.to(ct), 0.0)       # an empty row's garbage must not leak in
    if out is None:
        return block_out, block_lse
    lse = lse.to(ct)
    new_lse = torch.logaddexp(lse, block_lse)                 # -inf only where both are -inf; NaN, +inf stay
    safe = torch.where(new_lse == float("-inf"), 0.0, new_lse)   # +inf gives exp(inf - inf) = NaN: as softmax
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)   # exp(-inf) = 0 for an empty side
    w_new = torch.exp(block_lse - safe).transpose(1, 2).unsqueeze(-1)
    return (out.to(ct) * w_old).addcmul_(block_out, w_new), new_lse


def merge_into(out, lse, block_out, block_lse, rows: slice | None = None):
    """In-place merge of a block that covers the query ``rows`` (a slice of the sequence dim) only.

    ``out``/``lse`` are the running float accumulators for all rows; returns them for chaining.
    """
    if rows is None:
        rows = slice(None)
    o, l = merge_attention(out[:, rows], lse[:, :, rows], block_out, block_lse)
    out[:, rows] = o
    lse[:, :, rows] = l
    return out, lse


# ------------------------------------------------------------------------------------------------ Triton
@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_kernel(O, LSE, BO, BLSE, seq, heads, sob, sos, soh, slb, slh, sbb, sbs, sbh, sblb, sblh,
                      BLOCK: tl.constexpr, D: tl.constexpr):
        bh = tl.program_id(1)
        b, h = bh // heads, bh % heads
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        in_rows = rows < seq
        lse = tl.load(LSE + b * slb + h * slh + rows, mask=in_rows, other=float("-inf"))
        blse = tl.load(BLSE + b * sblb + h * sblh + rows, mask=in_rows, other=float("-inf"))
        bad = (lse != lse) | (blse != blse) | (lse == float("inf")) | (blse == float("inf"))   # the inputs' NaN/inf
        hi = tl.maximum(lse, blse)
        safe = tl.where(hi == float("-inf"), 0.0, hi)
        w_old = tl.exp(lse - safe)
        w_new = tl.exp(blse - safe)
        total = w_old + w_new
        new = tl.where(hi == float("-inf"), float("-inf"), safe + tl.log(total))
        new = tl.where(bad, float("nan"), new)
        denom = tl.where(total > 0, total, 1.0)
        o_ptrs = O + b * sob + h * soh + rows[:, None] * sos + offs_d[None, :]
        o = tl.load(o_ptrs, mask=in_rows[:, None], other=0.0)
        bo = tl.load(BO + b * sbb + h * sbh + rows[:, None] * sbs + offs_d[None, :], mask=in_rows[:, None], other=0.0)
        bo = tl.where((w_new > 0)[:, None], bo.to(tl.float32), 0.0)
        out = (o * (w_old / denom)[:, None]) + bo * (w_new / denom)[:, None]
        out = tl.where(bad[:, None], float("nan"), out)
        tl.store(o_ptrs, out, mask=in_rows[:, None])
        tl.store(LSE + b * slb + h * slh + rows, new, mask=in_rows)

    return triton, CachedLaunch(_merge_kernel)   # bound once per key (host cost, #24)


def lse_merge_(out, lse, block_out, block_lse):
    """Merge ``(block_out, block_lse)`` into float32 ``(out, lse)`` in place; returns them."""
    b, s, h, d = out.shape
    if block_out.shape != out.shape or lse.shape != (b, h, s) or block_lse.shape != (b, h, s):
        raise ValueError(f"merge: out {tuple(out.shape)}, lse {tuple(lse.shape)}, block {tuple(block_out.shape)}, "
                         f"{tuple(block_lse.shape)} do not fit")
    if out.stride(-1) != 1 or block_out.stride(-1) != 1 or lse.stride(-1) != 1 or block_lse.stride(-1) != 1:
        raise ValueError("merge: the last dims must be contiguous")
    if d & (d - 1):
        raise ValueError(f"the Triton merge takes a power-of-two head_dim; got {d}")
    block = knob("MERGE_BLOCK", 32)
    triton, kernel = _kernel()
    launch_keyed(kernel, (cdiv(s, block), b * h), (out, lse, block_out, block_lse),
                 (s, h, *out.stride()[:3], *lse.stride()[:2], *block_out.stride()[:3], *block_lse.stride()[:2]),
                 dict(BLOCK=block, D=d, num_warps=num_warps(4)))
    return out, lse
