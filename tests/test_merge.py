"""The LSE merge: exact recombination of split attention, and rows that see no key in some block."""

import math

import pytest
import torch

from distlab.kernels.lse_merge import merge_attention, merge_into
from distlab.kernels.attention import attention_forward


def halves(seq_k=20, cut=7, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, 3, 8, generator=g, dtype=dtype)
    k = torch.randn(2, seq_k, 3, 8, generator=g, dtype=dtype)
    v = torch.randn(2, seq_k, 3, 8, generator=g, dtype=dtype)
    whole = attention_forward(q, k, v, backend="torch")
    a = attention_forward(q, k[:, :cut], v[:, :cut], backend="torch")
    b = attention_forward(q, k[:, cut:], v[:, cut:], backend="torch")
    return whole, a, b


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_merge_of_two_key_blocks_is_whole_attention(order):
    (out, lse), a, b = halves()
    first, second = (a, b) if order == "ab" else (b, a)
    m_out, m_lse = merge_attention(*merge_attention(None, None, *first), *second)
    assert m_out.dtype == torch.float64
    torch.testing.assert_close(m_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m_lse, lse, rtol=1e-12, atol=1e-12)


def test_merge_accumulates_in_float32_from_half_precision():
    (out, lse), a, b = halves()
    m_out, m_lse = merge_attention(None, None, a[0].half(), a[1].float())
    m_out, m_lse = merge_attention(m_out, m_lse, b[0].half(), b[1].float())
    assert m_out.dtype == torch.float32 and m_lse.dtype == torch.float32
    assert (m_out.double() - out).abs().max() < 2e-3


def test_block_with_empty_rows_neither_nans_nor_erases():
    (_, _), a, b = halves()
    b_out, b_lse = b[0].clone(), b[1].clone()
    b_lse[:, :, :4] = float("-inf")      # rows 0..3 saw no key in block b ...
    b_out[:, :4] = float("nan")          # ... and the kernel left garbage in their output
    m_out, m_lse = merge_attention(*merge_attention(None, None, *a), b_out, b_lse)
    assert torch.isfinite(m_out).all() and torch.isfinite(m_lse).all()
    torch.testing.assert_close(m_out[:, :4], a[0][:, :4], rtol=1e-12, atol=1e-12)   # a survives intact
    torch.testing.assert_close(m_lse[:, :, :4], a[1][:, :, :4], rtol=1e-12, atol=1e-12)
    # the other rows are the proper two-block merge
    want_lse = torch.logaddexp(a[1][:, :, 4:], b[1][:, :, 4:])
    torch.testing.assert_close(m_lse[:, :, 4:], want_lse)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("side", ["running", "block"])
def test_nan_or_inf_lse_from_the_inputs_makes_the_row_nan(bad, side):
    """A NaN LSE (NaN in q or a visible key) or +inf (an infinite score) is not an empty row: the row must come
    out NaN, as softmax gives it, never 0 or the other block's result."""
    (_, _), a, b = halves()
    a, b = [t.clone() for t in a], [t.clone() for t in b]
    (a if side == "running" else b)[1][0, 1, 2] = bad
    m_out, m_lse = merge_attention(*merge_attention(None, None, *a), *b)
    assert torch.isnan(m_out[0, 2, 1]).all() and not torch.isfinite(m_lse[0, 1, 2])
    rest = torch.ones_like(m_lse, dtype=torch.bool)
    rest[0, 1, 2] = False
    assert torch.isfinite(m_lse[rest]).all()


def test_rows_that_see_no_key_anywhere_end_zero_with_neg_inf_lse():
    out = torch.zeros(1, 4, 2, 3)
    lse = torch.full((1, 2, 4), float("-inf"))
    block_out = torch.full((1, 4, 2, 3), float("nan"))
    block_lse = torch.full((1, 2, 4), float("-inf"))
    merge_into(out, lse, block_out, block_lse)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    # a later block with keys then fills them in exactly
    o2, l2 = torch.ones(1, 4, 2, 3), torch.full((1, 2, 4), math.log(3.0))
    merge_into(out, lse, o2, l2)
    assert torch.equal(out, o2) and torch.allclose(lse, l2)


def test_merge_into_rows_touches_only_those_rows():
    (_, _), a, b = halves()
    out, lse = a[0].clone(), a[1].clone()
    merge_into(out, lse, b[0][:, 5:], b[1][:, :, 5:], slice(5, 9))
    assert torch.equal(out[:, :5], a[0][:, :5])
    torch.testing.assert_close(lse[:, :, 5:], torch.logaddexp(a[1][:, :, 5:], b[1][:, :, 5:]))
