"""The log-sum-exp merge in Triton (``distlab.kernels.lse_merge`` calls these; it imports this module only
once Triton runs, so that one imports without triton).

    TRITON_INTERPRET=1 python tests/kernel_checks.py merge       # CPU, against ``merge_into``

``_merge_kernel``: one block result into the float32 running (out, lse), in place. ``_merge_blocks_kernel``:
up to four block results, each covering its own rows, in one pass over the running result — one program per
(BLOCK rows, batch · head), head_dim wide; the LSEs first (their max), then the outputs, weighted.
"""

from __future__ import annotations

import triton
import triton.language as tl

from distlab.kernels.launch import CachedLaunch


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
    tl.debug_barrier()   # every warp read its rows' old LSE (each holds them all) before any is overwritten
    tl.store(LSE + b * slb + h * slh + rows, new, mask=in_rows)


@triton.jit
def _block_lse(L, lo, hi, slb, slh, b, h, rows):
    covered = (rows >= lo) & (rows < hi)
    return tl.load(L + b * slb + h * slh + (rows - lo), mask=covered, other=float("-inf"))


@triton.jit
def _block_add(acc, total, B, lse, safe, lo, hi, sbb, sbs, sbh, b, h, rows, offs_d):
    covered = (rows >= lo) & (rows < hi)
    w = tl.exp(lse - safe)   # 0 where the block has no key for the row (its output is garbage there)
    o = tl.load(B + b * sbb + h * sbh + (rows - lo)[:, None] * sbs + offs_d[None, :], mask=covered[:, None],
                other=0.0)
    return acc + tl.where((w > 0)[:, None], o.to(tl.float32), 0.0) * w[:, None], total + w


@triton.jit
def _merge_blocks_kernel(O, LSE, F, B0, L0, B1, L1, B2, L2, B3, L3, row0, rows_end, heads,
                         lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, sob, sos, soh, slb, slh, sfb, sfs, sfh,
                         sb0b, sb0s, sb0h, sl0b, sl0h, sb1b, sb1s, sb1h, sl1b, sl1h,
                         sb2b, sb2s, sb2h, sl2b, sl2h, sb3b, sb3s, sb3h, sl3b, sl3h,
                         N: tl.constexpr, HAS_ACC: tl.constexpr, FINAL: tl.constexpr, BLOCK: tl.constexpr,
                         D: tl.constexpr):
    """Rows [row0, rows_end) of one head: the running (O, LSE) (``HAS_ACC``; else nothing yet) and up to
    four block results, each covering rows [lo_i, hi_i), merged in one pass; written back to O, or to F
    in its dtype (``FINAL``), and LSE."""
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    rows = row0 + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    in_rows = rows < rows_end
    none = tl.full([BLOCK], float("-inf"), tl.float32)
    l_acc = tl.load(LSE + b * slb + h * slh + rows, mask=in_rows, other=float("-inf")) if HAS_ACC else none
    l0 = _block_lse(L0, lo0, hi0, sl0b, sl0h, b, h, rows) if N > 0 else none
    l1 = _block_lse(L1, lo1, hi1, sl1b, sl1h, b, h, rows) if N > 1 else none
    l2 = _block_lse(L2, lo2, hi2, sl2b, sl2h, b, h, rows) if N > 2 else none
    l3 = _block_lse(L3, lo3, hi3, sl3b, sl3h, b, h, rows) if N > 3 else none
    m = tl.maximum(tl.maximum(tl.maximum(l_acc, l0), tl.maximum(l1, l2)), l3)
    # an input's NaN or +inf makes the row NaN (maximum need not propagate a NaN: each is tested)
    bad = (m == float("inf")) | (l_acc != l_acc) | (l0 != l0) | (l1 != l1) | (l2 != l2) | (l3 != l3)
    safe = tl.where(m == float("-inf"), 0.0, m)
    o_ptrs = O + b * sob + h * soh + rows[:, None] * sos + offs_d[None, :]
    total = tl.exp(l_acc - safe)
    acc = tl.zeros([BLOCK, D], tl.float32)
    if HAS_ACC:
        o = tl.load(o_ptrs, mask=in_rows[:, None], other=0.0)
        acc = tl.where((total > 0)[:, None], o, 0.0) * total[:, None]
    if N > 0:
        acc, total = _block_add(acc, total, B0, l0, safe, lo0, hi0, sb0b, sb0s, sb0h, b, h, rows, offs_d)
    if N > 1:
        acc, total = _block_add(acc, total, B1, l1, safe, lo1, hi1, sb1b, sb1s, sb1h, b, h, rows, offs_d)
    if N > 2:
        acc, total = _block_add(acc, total, B2, l2, safe, lo2, hi2, sb2b, sb2s, sb2h, b, h, rows, offs_d)
    if N > 3:
        acc, total = _block_add(acc, total, B3, l3, safe, lo3, hi3, sb3b, sb3s, sb3h, b, h, rows, offs_d)
    new = tl.where(m == float("-inf"), float("-inf"), safe + tl.log(tl.where(total > 0, total, 1.0)))
    new = tl.where(bad, float("nan"), new)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out = tl.where(bad[:, None], float("nan"), out)
    if FINAL:
        tl.store(F + b * sfb + h * sfh + rows[:, None] * sfs + offs_d[None, :], out.to(F.dtype.element_ty),
                 mask=in_rows[:, None])
    else:
        tl.store(o_ptrs, out, mask=in_rows[:, None])
    tl.debug_barrier()   # every warp read its rows' old LSE (each holds them all) before any is overwritten
    tl.store(LSE + b * slb + h * slh + rows, new, mask=in_rows)


# bound once per key (host cost, #24)
MERGE, MERGE_BLOCKS = CachedLaunch(_merge_kernel), CachedLaunch(_merge_blocks_kernel)
