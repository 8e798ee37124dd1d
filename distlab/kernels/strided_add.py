"""``acc += part`` in one vectorized Triton launch for tensors made of equal contiguous rows strided apart: a
ring backward's dK/dV share (a key range of a fused FA4 block's float32 scratch, ``(2, batch, kv_heads,
keys · dim)`` sliced along its last dimension) added into the travelling accumulator.

    TRITON_INTERPRET=1 python tests/kernel_checks.py merge      # CPU: this add beside the merge checks
    python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --steps-per-launch 4 \\
        --variant '' 'RING_DKV_ADD=torch' --wall                # H100/H200: against PyTorch's strided add

Why (#24): PyTorch adds a non-contiguous view with its generic element-wise kernel (``elementwise_kernel<128,
2>``: one element a load, an offset computed per element), not the vectorized one it uses for contiguous
tensors. On the H100 a W=8 zigzag rank at S32768 adds seven 32 MiB shares that way (96 MiB of traffic each) at
40–66 µs an add, ~360 µs of a ~4.7 ms backward (docs/PERF.md, the 16th session's timeline), where HBM3 would
move 96 MiB in ~32 µs. Here one program adds ``BLOCK`` elements of one row, so every load is 16-byte
vectorized wherever the rows' starts and strides are (Triton specialises on that).

``rows_of(t)`` says whether a tensor is such rows: (rows, row length, row stride), its last dimension
contiguous and every leading dimension stepping by whole rows. ``strided_add_(acc, part)`` uses the kernel
where both are, Triton runs on the device and the share is at least ``MIN_BYTES`` (below that the launch's
host time matters more than the traffic); otherwise ``acc.add_(part)``. Knob ``DISTLAB_RING_DKV_ADD``:
``auto`` (that rule), ``triton`` (always where both are rows), ``torch`` (never).
"""

from __future__ import annotations

import functools

import torch

from distlab import knobs
from distlab.kernels.launch import CachedLaunch, cdiv, triton_runs_on

MIN_BYTES = 4 << 20   # shares below this use PyTorch's add (S8192's 8 MiB shares still take the kernel)
BLOCK = 4096


def rows_of(t):
    """``(rows, length, stride)`` when ``t`` is ``rows`` runs of ``length`` contiguous elements ``stride``
    apart (every leading dimension a whole number of rows apart), else None."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    length = t.shape[-1]
    stride = None
    step = None   # the row stride the next-outer dimension must equal, times the rows inside it
    rows = 1
    for size, s in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if stride is None:
            if s < length:   # overlapping rows
                return None
            stride, step = s, s * size
        elif s != step:
            return None
        else:
            step = s * size
        rows *= size
    return rows, length, stride if stride is not None else length


def strided_add_(acc, part):
    """``acc += part`` (same shape and dtype); returns ``acc``. See the module's docstring for which kernel."""
    mode = knobs.get("RING_DKV_ADD")
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"DISTLAB_RING_DKV_ADD={mode!r}: use auto, triton or torch")
    if mode == "torch" or acc.shape != part.shape or acc.dtype != part.dtype or not triton_runs_on(acc.device) \
            or (mode == "auto" and (part.is_contiguous() and acc.is_contiguous()
                                    or part.numel() * part.element_size() < MIN_BYTES)):
        return acc.add_(part)
    a, p = rows_of(acc), rows_of(part)
    if a is None or p is None or a[:2] != p[:2]:
        return acc.add_(part)
    (rows, length, acc_stride), part_stride = a, p[2]
    key = (acc.dtype, rows, length, acc_stride, part_stride, acc.data_ptr() % 16, part.data_ptr() % 16)
    _kernel()(key, (cdiv(length, BLOCK), rows), (acc, part, length, acc_stride, part_stride),
              dict(BLOCK=BLOCK, num_warps=8))
    return acc


@functools.lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel (defined on first use: importing this module needs no triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rows(ACC, PART, length, acc_stride, part_stride, BLOCK: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < length
        a = ACC + row * acc_stride + offs
        tl.store(a, tl.load(a, mask=keep) + tl.load(PART + row * part_stride + offs, mask=keep), mask=keep)

    return CachedLaunch(_add_rows)
