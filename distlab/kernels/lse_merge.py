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
block). ``lse_merge_blocks_`` merges up to four block results in one launch (a ring's steps). The kernels
(``distlab/kernels/triton_lse_merge.py``) are imported on first use, so this file imports without triton.
"""

from __future__ import annotations

import torch

from distlab.kernels.launch import cdiv, knob, launch_keyed, num_warps


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


def merge_blocks_reference(out, lse, blocks, shape):
    """What ``lse_merge_blocks_`` computes, in plain PyTorch: the block results ``[(block_out, block_lse, lo,
    hi)]`` merged one after another (``merge_into``) into copies of the running ``(out, lse)``, or, when
    ``out`` is None, into a new float32 result of ``shape`` (0 and −inf where no block has a key). Returns
    ``(out, lse)``; the inputs are not changed."""
    if out is None:
        b, s, h, _ = shape
        out = torch.zeros(shape, dtype=torch.float32, device=blocks[0][0].device)
        lse = torch.full((b, h, s), float("-inf"), device=blocks[0][0].device)
    else:
        out, lse = out.clone(), lse.clone()
    for bo, bl, lo, hi in blocks:
        merge_into(out, lse, bo, bl, slice(lo, hi))
    return out, lse


def _kernel():
    """The Triton launches (``distlab.kernels.triton_lse_merge``), imported on first use."""
    from distlab.kernels import triton_lse_merge

    return triton_lse_merge.MERGE, triton_lse_merge.MERGE_BLOCKS


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
    kernel, _ = _kernel()
    launch_keyed(kernel, (cdiv(s, block), b * h), (out, lse, block_out, block_lse),
                 (s, h, *out.stride()[:3], *lse.stride()[:2], *block_out.stride()[:3], *block_lse.stride()[:2]),
                 dict(BLOCK=block, D=d, num_warps=num_warps(4)))
    return out, lse


MERGE_BLOCKS = 4   # block results one ``lse_merge_blocks_`` launch takes


def lse_merge_blocks_(out, lse, blocks, has_acc=True, final=None):
    """Up to ``MERGE_BLOCKS`` block results ``[(block_out, block_lse, lo, hi)]`` — each the attention of rows
    lo..hi of the shard — merged into the float32 running ``(out, lse)`` in one launch: the running result
    is read and written once, not once per block (a ring step of a backend that cannot accumulate, cuDNN or
    FA4). ``has_acc=False``: ``out``/``lse`` hold nothing yet (new buffers; every row is written, 0 and
    -inf where no block has a key). ``final``: shaped like ``out``, any float dtype: every row's merged
    result goes there instead (the ring's last merge, in q's dtype: no conversion after); ``out`` is then
    not written, and not read without ``has_acc``. Returns ``(final or out, lse)``.

    Host cost (#24): the checks, the launch's integer arguments, its grid and options are a plan kept per
    layout of the arguments (shapes, strides, dtypes, row ranges, ``has_acc``, ``final``'s, the launch knobs);
    a call with a layout seen before only reads the pointers' alignment and launches (CPU, launches skipped:
    34 → 9.7 µs a call, four blocks at S1024, 32 heads)."""
    fo = final if final is not None else out
    key = _layout_key(out, lse, blocks, has_acc, final)
    plan = _BLOCK_PLANS.get(key)
    if plan is None:
        plan = _BLOCK_PLANS[key] = _merge_blocks_plan(out, lse, blocks, has_acc, final, fo)
        if len(_BLOCK_PLANS) > 1024:
            _BLOCK_PLANS.clear()
    grid, scalars, kwargs = plan
    tensors = (out, lse, fo, *(t for bo, bl, _, _ in blocks for t in (bo, bl)))
    aligned = sum(1 << i for i, t in enumerate(tensors) if t.data_ptr() % 16 == 0)
    _, kernel = _kernel()
    kernel((key, aligned), grid, (*tensors, *[None] * (2 * (MERGE_BLOCKS - len(blocks))), *scalars), kwargs)
    return fo, lse


_BLOCK_PLANS: dict = {}


def _layout_key(out, lse, blocks, has_acc, final):
    """What ``lse_merge_blocks_``'s plan and its compiled kernel depend on: every argument's shape, strides and
    dtype, the blocks' row ranges, ``has_acc``, ``final``'s layout and the launch knobs."""
    return (out.shape, out.stride(), out.dtype, lse.shape, lse.stride(), lse.dtype, has_acc,
            None if final is None else (final.shape, final.stride(), final.dtype),
            tuple((bo.shape, bo.stride(), bo.dtype, bl.shape, bl.stride(), bl.dtype, lo, hi) for bo, bl, lo, hi in blocks),
            knob("MERGE_BLOCK", 32), num_warps(4))


def bind_merge_blocks(out, lse, blocks, has_acc=True, final=None):
    """``lse_merge_blocks_(out, lse, blocks, has_acc, final)``'s launch with its plan worked out once and the
    block results fixed: returns ``launch(out, lse, final)``, which merges those very block tensors (the
    ring's kept FA4 outputs, ``distlab.cp.ring_kept``) into an ``out``/``lse``/``final`` laid out as these are
    (same shapes, strides, dtypes; ``final`` None or not as here). Per call it reads three pointers'
    alignment and launches: the layout key of up to four blocks is not rebuilt (#24: host time a ring pass)."""
    fo = final if final is not None else out
    key = _layout_key(out, lse, blocks, has_acc, final)
    grid, scalars, kwargs = _merge_blocks_plan(out, lse, blocks, has_acc, final, fo)
    fixed = tuple(t for bo, bl, _, _ in blocks for t in (bo, bl))
    fixed_aligned = sum(1 << (3 + i) for i, t in enumerate(fixed) if t.data_ptr() % 16 == 0)
    tail = (*fixed, *[None] * (2 * (MERGE_BLOCKS - len(blocks))), *scalars)
    _, kernel = _kernel()

    def launch(out, lse, final=None):
        fo = final if final is not None else out
        aligned = fixed_aligned | (out.data_ptr() % 16 == 0) | (lse.data_ptr() % 16 == 0) << 1 \
            | (fo.data_ptr() % 16 == 0) << 2
        kernel((key, aligned), grid, (out, lse, fo, *tail), kwargs)
        return fo, lse
    return launch


def _merge_blocks_plan(out, lse, blocks, has_acc, final, fo):
    """``lse_merge_blocks_``'s checks, then its launch's grid, integer arguments and options."""
    b, s, h, d = out.shape
    if len(blocks) > MERGE_BLOCKS or lse.shape != (b, h, s) or lse.dtype != torch.float32 \
            or out.dtype != torch.float32 and (has_acc or final is None):
        raise ValueError(f"merge: at most {MERGE_BLOCKS} blocks into float32 out {tuple(out.shape)} and lse "
                         f"{(b, h, s)}; got {len(blocks)} blocks, out {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")
    for bo, bl, lo, hi in blocks:
        if not 0 <= lo < hi <= s or bo.shape != (b, hi - lo, h, d) or bl.shape != (b, h, hi - lo) \
                or bo.stride(-1) != 1 or bl.stride(-1) != 1:
            raise ValueError(f"merge: a block of rows [{lo}, {hi}) of {s} must be {(b, hi - lo, h, d)} and "
                             f"{(b, h, hi - lo)}, last dims contiguous; got {tuple(bo.shape)}, {tuple(bl.shape)}")
    if final is not None and (final.shape != out.shape or final.stride(-1) != 1):
        raise ValueError(f"merge: final must be {tuple(out.shape)} with a contiguous last dim")
    if out.stride(-1) != 1 or lse.stride(-1) != 1 or d & (d - 1):
        raise ValueError(f"merge: contiguous last dims and a power-of-two head_dim; got head_dim {d}")
    # rows every block leaves alone keep their running result, unless there is none or it moves to final
    row0, rows_end = (0, s) if final is not None or not has_acc else \
        (min(lo for *_, lo, _ in blocks), max(hi for *_, hi in blocks))
    block = knob("MERGE_BLOCK", 32)
    bounds = [x for *_, lo, hi in blocks for x in (lo, hi)] + [0, 0] * (MERGE_BLOCKS - len(blocks))
    strides = [x for bo, bl, _, _ in blocks for x in (*bo.stride()[:3], *bl.stride()[:2])]
    strides += [0] * (5 * (MERGE_BLOCKS - len(blocks)))
    scalars = (row0, rows_end, h, *bounds, *out.stride()[:3], *lse.stride()[:2], *fo.stride()[:3], *strides)
    kwargs = dict(N=len(blocks), HAS_ACC=has_acc, FINAL=final is not None, BLOCK=block, D=d, num_warps=num_warps(4))
    return (cdiv(rows_end - row0, block), b * h), scalars, kwargs
