"""Whether Triton can run here, and the launch knobs of the memory-bound Triton kernels (RMSNorm, RoPE,
SwiGLU, LSE merge), for tuning sweeps.

    DISTLAB_KERNEL_WARPS=8 python -m distlab.kernels.bench --only memory      # warps per program, every kernel
    DISTLAB_KERNEL_RMSNORM_ROWS=2 DISTLAB_KERNEL_ROPE_TOKENS=4 python -m distlab.kernels.bench --only memory
"""

from __future__ import annotations

import functools
import os

from distlab import knobs


def sm_major(device) -> int:
    """The CUDA device's compute-capability major (9 on Hopper), cached per device: the query costs host
    time on every kernel launch that asks (TMA, PDL)."""
    import torch

    device = torch.device(device)
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm_major(index: int) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]


def triton_runs_on(device) -> bool:
    """Triton is importable and the tensors are on CUDA (or on CPU with ``TRITON_INTERPRET=1``). The one
    guard of the triton import: modules whose kernels are Triton are imported only after it says yes (or
    define their kernels lazily), so an install without the gpu extra never imports triton."""
    import torch

    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _triton_importable()


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def num_warps(default: int) -> int:
    """Knob ``KERNEL_WARPS`` when set (a tuning sweep), else the kernel's own default."""
    value = knobs.get("KERNEL_WARPS")
    return int(value) if value is not None else default


def knob(name: str, default: int) -> int:
    """Knob ``KERNEL_<name>`` (``distlab.knobs``: e.g. rows or tokens per program), else ``default``."""
    value = knobs.get(f"KERNEL_{name}")
    return int(value) if value is not None else default
