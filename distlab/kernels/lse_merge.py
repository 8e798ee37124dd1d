"""The log-sum-exp merge of a partial attention result into a running one, in one Triton launch.

    python -m distlab.kernels.bench --only memory --kernel merge

For backends that cannot accumulate (cuDNN, flash SDPA), a ring step's block result ``(o_b, lse_b)`` is
merged into the float32 running ``(out, lse)`` in place — the same rule and the same care for rows with
no visible key as ``distlab.cp.merge.merge_into`` (a ``-inf`` block LSE contributes nothing; NaN and
``+inf`` make the row NaN, as the one-device math does), but one
kernel instead of about ten elementwise launches. ``out``/``lse`` may be views of some rows of a larger
buffer (a zigzag half block). One program per (batch, BLOCK rows, head), head_dim wide.
"""

from __future__ import annotations

import triton
import triton.language as tl

from distlab.kernels.launch import knob, num_warps


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
    _merge_kernel[(triton.cdiv(s, block), b * h)](
        out, lse, block_out, block_lse, s, h, out.stride(0), out.stride(1), out.stride(2), lse.stride(0),
        lse.stride(1), block_out.stride(0), block_out.stride(1), block_out.stride(2), block_lse.stride(0),
        block_lse.stride(1), BLOCK=block, D=d, num_warps=num_warps(4))
    return out, lse
