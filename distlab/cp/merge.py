"""Log-sum-exp merge of partial attention results.

    python -m pytest tests/test_merge.py

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
"""

from __future__ import annotations

import torch


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
