"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) as a distlab attention backend: ``backend="fa4"``.

    pip install "distlab[fa4]"                              # flash-attn-4[cu13]; sm90 (Hopper) or newer
    python -m distlab.kernels.bench --only attention        # fa4 beside cuDNN and the Triton kernel
    python -m distlab.cp.ring --seq 32768 --backend fa4 --check

The contract of every backend: bshd tensors, GQA without repeating K/V (FA4 packs the q heads of a kv
head itself), causal or full attention; the forward returns (out, LSE) with the LSE float32
``(batch, heads, seq_q)``, and the backward takes the *final* out and LSE, so a ring step calls it on one
key block with the global LSE. ``flash_attn.cute`` is imported on first use, never at distlab's import.
Packed documents and windows (``KeyMask``) are not routed here yet: FA4 has varlen and windows, but its
masks are per-sequence offsets, not distlab's interval masks; ``auto`` keeps the masked Triton kernel for them.
"""

from __future__ import annotations

import functools

import torch

PACKAGE = "flash-attn-4"
DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _importable() -> bool:
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception:   # ImportError, or a CUDA library it cannot load
        return False
    return True


def runs_on(device, dtype) -> bool:
    """FA4 is importable, and the device is a CUDA GPU of sm90 or newer, and the dtype fp16/bf16."""
    device = torch.device(device)
    return (device.type == "cuda" and dtype in DTYPES and torch.cuda.get_device_capability(device)[0] >= 9
            and _importable())


def why_not(device, dtype) -> str:
    """What is missing for ``fa4`` here (for the error that refuses it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it runs on CUDA GPUs (sm90+), not {device.type}"
    if dtype not in DTYPES:
        return f"it takes float16 or bfloat16, not {dtype}"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return f"it needs sm90 or newer; this GPU is sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return f"the {PACKAGE} package is not importable (pip install 'distlab[fa4]', or {PACKAGE}[cu13])"


def _interface():
    import flash_attn.cute.interface as interface

    return interface


def fa4_forward(q, k, v, causal, scale):
    """(out, lse): out like q, lse float32 (batch, heads, seq_q)."""
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    return out, lse


def fa4_backward(dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) given the final out and LSE (a ring step passes the global ones)."""
    dq, dk, dv = _interface()._flash_attn_bwd(q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                                              dout.contiguous(), lse.contiguous(), softmax_scale=scale,
                                              causal=causal)[:3]
    return dq, dk, dv
