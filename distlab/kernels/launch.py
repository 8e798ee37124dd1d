"""Launch knobs of the memory-bound Triton kernels (RMSNorm, RoPE, SwiGLU, LSE merge), for tuning sweeps.

    DISTLAB_KERNEL_WARPS=8 python -m distlab.kernels.bench --only memory      # warps per program, every kernel
    DISTLAB_KERNEL_RMSNORM_ROWS=2 DISTLAB_KERNEL_ROPE_TOKENS=4 python -m distlab.kernels.bench --only memory
"""

from __future__ import annotations

import os


def num_warps(default: int) -> int:
    """``DISTLAB_KERNEL_WARPS`` when set (a tuning sweep), else the kernel's own default."""
    return int(os.environ.get("DISTLAB_KERNEL_WARPS", default))


def knob(name: str, default: int) -> int:
    """``DISTLAB_KERNEL_<name>`` when set, else ``default`` (e.g. rows or tokens per program)."""
    return int(os.environ.get(f"DISTLAB_KERNEL_{name}", default))
