"""One launch knob shared by the memory-bound Triton kernels (RMSNorm, RoPE, SwiGLU, LSE merge).

    DISTLAB_KERNEL_WARPS=8 python -m kernels.bench --only memory      # sweep warps per program on a GPU
"""

from __future__ import annotations

import os


def num_warps(default: int) -> int:
    """``DISTLAB_KERNEL_WARPS`` when set (a tuning sweep), else the kernel's own default."""
    return int(os.environ.get("DISTLAB_KERNEL_WARPS", default))
