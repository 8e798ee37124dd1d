"""The softmax ladder (``distlab.kernels.softmax``): every rung but the naive one equals torch's softmax to
1e-5 on logits past exp's range; the Triton kernel under the interpreter (fp32, fp16; both the one-block
and the long-row two-pass paths) with its output poisoned first."""

import pytest
import torch

from distlab.testing import run_in_triton_interpreter

from distlab.kernels.softmax import check, naive, online_one_pass, online_two_pass, safe


@pytest.mark.parametrize("fn", [safe, online_two_pass, online_one_pass], ids=lambda f: f.__name__)
@pytest.mark.parametrize("cols", [1, 255, 256, 1000])
def test_rungs_match_torch(fn, cols):
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(0)) * 40
    assert check(fn, x) < 1e-5


def test_naive_overflows_where_the_safe_forms_do_not():
    x = torch.tensor([[100.0, 0.0, -3.0]])
    assert not torch.isfinite(naive(x)).all() and check(safe, x) < 1e-7


INTERPRETED = """
import torch
from distlab.kernels import softmax as s
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    for rows, cols in ((5, 1), (5, 1000), (3, s.MAX_BLOCK + 37)):
        x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 40).to(dtype)
        out = torch.full_like(x, float("nan"))
        s.softmax_triton(x, out=out)
        err = (out.double() - torch.softmax(x.double(), -1)).abs().max().item()
        assert err < tol, (dtype, rows, cols, err)
        print("OK", dtype, rows, cols, err)
"""


def test_triton_softmax_in_the_interpreter():
    proc = run_in_triton_interpreter(INTERPRETED)
    assert proc.returncode == 0 and proc.stdout.count("OK") == 6, proc.stdout + proc.stderr[-3000:]


@pytest.mark.gpu
def test_triton_softmax_at_real_sizes():
    from distlab.kernels.softmax import softmax_triton

    for cols in (4096, 32768):
        x = torch.randn(4096, cols, device="cuda") * 40
        assert check(softmax_triton, x) < 1e-5
        assert check(softmax_triton, x.bfloat16()) < 1e-2
