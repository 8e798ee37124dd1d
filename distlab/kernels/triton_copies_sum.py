"""dK and dV of keys that FlashAttention-4's variable-length backward read as copies, summed in one pass
(``distlab.kernels.fa4.fa4_masked_backward`` calls this on CUDA; knob ``DISTLAB_FA4_COPIES_KERNEL=0`` for the
torch path). H100, all-gather CP's FA4 rank at 64k, W=8: its f+b 2.24-2.29 -> 1.86-1.94 ms (docs/PERF.md).

    TRITON_INTERPRET=1 python tests/kernel_checks.py copies     # CPU, against the torch path, bit for bit

When a rank's query pieces share keys (all-gather CP: two pieces of one document both see its first keys),
FA4's sequences read their own copies of those keys, and its backward writes a gradient per copy. Each key
row's dK/dV is then the sum of its copies' (none: zero). The torch path (``fa4._copies_summed``) adds every copy
into a float32 tensor of all key rows with ``index_add_`` and writes it back rounded (five passes, when this
kernel was measured against it, doing the float32 sums for rows read twice only); here one program a
key row reads its copies (CSR: ``spec.copy_start``, ``spec.copy_order``, packed rows in copy order), adds them
in float32 in that order, and writes dK and dV once, in their dtype — the same additions in the same order as
the torch path on the CPU, so the same bits (CUDA's ``index_add_`` adds a row's third copy in any order).
Outputs may be strided views (a head group of all-gather's scatter buffer); the last dimension is contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl

from distlab.kernels.launch import CachedLaunch, num_warps, tensor_key


@triton.jit
def _copies_sum_kernel(DK, DV, OK, OV, ORDER, START, sdr, sdh, skr, skh, svr, svh,
                       H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, DB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    first = tl.load(START + row)
    stop = tl.load(START + row + 1)
    heads = tl.arange(0, HB)[:, None]
    dims = tl.arange(0, DB)[None, :]
    inside = (heads < H) & (dims < D)
    src = heads * sdh + dims
    acc_k = tl.zeros([HB, DB], dtype=tl.float32)
    acc_v = tl.zeros([HB, DB], dtype=tl.float32)
    for i in range(first, stop):
        packed = tl.load(ORDER + i).to(tl.int64)
        acc_k += tl.load(DK + packed * sdr + src, mask=inside, other=0.0).to(tl.float32)
        acc_v += tl.load(DV + packed * sdr + src, mask=inside, other=0.0).to(tl.float32)
    tl.store(OK + row * skr + heads * skh + dims, acc_k.to(OK.dtype.element_ty), mask=inside)
    tl.store(OV + row * svr + heads * svh + dims, acc_v.to(OV.dtype.element_ty), mask=inside)


_LAUNCH = CachedLaunch(_copies_sum_kernel)


def takes(dk, dv, out_k, out_v) -> bool:
    """The layouts ``copies_sum_`` reads and writes: dK and dV of one layout, every last dimension contiguous."""
    return dk.stride() == dv.stride() and all(t.shape[-1] == 1 or t.stride(-1) == 1 for t in (dk, out_k, out_v))


def copies_sum_(dk, dv, out_k, out_v, order, start):
    """``out_k[r]``, ``out_v[r]`` = the sum of ``dk``/``dv`` over the packed rows ``order[start[r]:start[r+1]]``
    (float32 additions in that order, one rounding), for every key row r of ``out_k`` (rows, heads, head_dim);
    ``dk`` and ``dv`` (packed rows, heads, head_dim) share their strides; last dimensions contiguous
    (``takes`` says whether they are)."""
    if not takes(dk, dv, out_k, out_v):
        raise ValueError("copies_sum_: dk and dv share strides, and every last dimension is contiguous")
    rows, heads, dim = out_k.shape
    args = (dk, dv, out_k, out_v, order, start, dk.stride(0), dk.stride(1), out_k.stride(0), out_k.stride(1),
            out_v.stride(0), out_v.stride(1))
    meta = dict(H=heads, HB=triton.next_power_of_2(heads), D=dim, DB=triton.next_power_of_2(dim),
                num_warps=num_warps(2))
    key = tuple(tensor_key(a) for a in args[:6]) + args[6:] + tuple(meta.values())
    _LAUNCH(key, (rows,), args, meta)
    return out_k, out_v
