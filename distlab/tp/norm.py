"""RMSNorm, and its sequence-parallel form.

    python -m pytest tests/test_tp.py -k norm

``y = x / sqrt(mean(x²) + eps) · w`` over the last dim. With sequence parallelism each TP rank normalises
its own sequence shard (the norm is per token, so no communication is needed in the forward), but the
weight ``w`` is replicated over TP and each rank sees only its tokens: its gradient must be summed over
TP or the ranks' copies drift apart (Megatron-LM issue #1446). Here the weight is used through
``copy_to_group``: identity forward, all-reduce of the gradient backward, so every rank holds the full
gradient after ``backward()``.
"""

from __future__ import annotations

import torch

from distlab import comm


def rms_norm(x, weight, eps=1e-6):
    """Plain-PyTorch RMSNorm, computed in float32 (float64 for float64 inputs)."""
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6, group=None, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        self.eps, self.group, self.sequence_parallel = eps, group, sequence_parallel
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    @classmethod
    def from_norm(cls, norm: "RMSNorm", group=None, sequence_parallel=False):
        new = cls(norm.weight.shape[0], norm.eps, group, sequence_parallel, norm.weight.device, norm.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(norm.weight)
        return new

    def forward(self, x):
        w = comm.copy_to_group(self.weight, self.group) if self.sequence_parallel else self.weight
        return rms_norm(x, w, self.eps)
