"""The MoE layer (router → dispatch → grouped-GEMM SwiGLU experts → combine), one-device and EP.

    distlab run --nproc 4 -m distlab.moe --experts 8 --topk 2 --hidden 256 --ffn 512 --tokens 4096 --check

``MoEReference`` is the one-device layer: every expert as a plain loop over the tokens routed to it.
``MoE.from_reference(ref, group)`` builds the expert-parallel layer from its weights: the router is
replicated, rank r keeps experts ``[r·E/P, (r+1)·E/P)``. Each rank routes *its own* tokens (expert
parallelism is data parallelism for everything but the experts), so the one-device equivalent of P ranks
is the reference run on all ranks' tokens together; the router's gradient on a rank is that rank's
tokens' share (sum it over the group, as data-parallel training does, to get the reference's).

Experts are SwiGLU, ``down(silu(x·gate_e) * (x·up_e))``, as three grouped GEMMs over the local experts'
row segments (``distlab.kernels.grouped_gemm``: ``loop``, ``torch`` = torch._grouped_mm, ``triton``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distlab import comm
from distlab.moe.dispatch import capacity_keep, combine, dispatch
from distlab.moe.router import Router
from distlab.profiling import phase
from distlab.kernels.grouped_gemm import grouped_mm


class MoEReference(torch.nn.Module):
    def __init__(self, hidden, ffn, num_experts, topk, score="softmax", device=None, dtype=None, renormalize=True,
                 bias_rate=0.0):
        super().__init__()
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.router = Router(hidden, num_experts, topk, score, renormalize, bias_rate, device=device, dtype=dtype)
        kw = {"device": device, "dtype": dtype}
        self.w_gate = torch.nn.Parameter(torch.randn(num_experts, hidden, ffn, **kw) * hidden ** -0.5)
        self.w_up = torch.nn.Parameter(torch.randn(num_experts, hidden, ffn, **kw) * hidden ** -0.5)
        self.w_down = torch.nn.Parameter(torch.randn(num_experts, ffn, hidden, **kw) * ffn ** -0.5)

    def forward(self, x, capacity_factor=None, chunks=1):
        """``capacity_factor``: each expert keeps its first C assignments of each of ``chunks`` equal token
        chunks (the EP layer applies capacity per rank, so P chunks reproduce P ranks)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, self.aux_loss, self.counts = self.router(x)
        if capacity_factor is not None:
            keep = []
            for part in experts.chunk(chunks, 0):
                cap = math.ceil(capacity_factor * part.numel() / self.num_experts)
                keep.append(capacity_keep(part.flatten(), self.num_experts, cap).view(part.shape))
            weights = weights * torch.cat(keep, 0)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = (experts == e).nonzero(as_tuple=True)
            if len(tok) == 0:
                continue
            h = F.silu(x[tok] @ self.w_gate[e]) * (x[tok] @ self.w_up[e])
            out = out.index_add(0, tok, (h @ self.w_down[e]) * weights[tok, slot].unsqueeze(-1).to(x.dtype))
        return out.view(shape)


class MoE(torch.nn.Module):
    """Expert-parallel MoE over ``group`` (EP size P must divide the number of experts)."""

    def __init__(self, hidden, ffn, num_experts, topk, group=None, score="softmax", backend="auto",
                 capacity_factor=None, device=None, dtype=None, renormalize=True, bias_rate=0.0):
        super().__init__()
        p = comm.group_size(group)
        if num_experts % p:
            raise ValueError(f"{num_experts} experts cannot be split over {p} expert-parallel ranks")
        self.group, self.num_experts, self.topk, self.local = group, num_experts, topk, num_experts // p
        self.first = comm.group_rank(group) * self.local
        self.backend, self.capacity_factor = backend, capacity_factor
        self.router = Router(hidden, num_experts, topk, score, renormalize, bias_rate, device=device, dtype=dtype)
        kw = {"device": device, "dtype": dtype}
        self.w_gate = torch.nn.Parameter(torch.empty(self.local, hidden, ffn, **kw))
        self.w_up = torch.nn.Parameter(torch.empty(self.local, hidden, ffn, **kw))
        self.w_down = torch.nn.Parameter(torch.empty(self.local, ffn, hidden, **kw))
        self.timings = None

    @classmethod
    def from_reference(cls, ref: MoEReference, group=None, backend="auto", capacity_factor=None):
        """The EP layer holding ``ref``'s weights and every router setting (score, renormalisation, the
        aux-loss-free bias and its rate, the logit offset)."""
        router = ref.router
        layer = cls(ref.hidden, ref.ffn, ref.num_experts, ref.topk, group, router.score, backend,
                    capacity_factor, ref.w_gate.device, ref.w_gate.dtype, router.renormalize, router.bias_rate)
        mine = slice(layer.first, layer.first + layer.local)
        with torch.no_grad():
            layer.router.weight.copy_(router.weight)
            layer.router.bias.copy_(router.bias)
            layer.router.logit_offset.copy_(router.logit_offset)
            for name in ("w_gate", "w_up", "w_down"):
                getattr(layer, name).copy_(getattr(ref, name)[mine])
        return layer

    def experts(self, rows, counts):
        g = grouped_mm(rows, self.w_gate, counts, self.backend)
        u = grouped_mm(rows, self.w_up, counts, self.backend)
        return grouped_mm(F.silu(g) * u, self.w_down, counts, self.backend)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        with phase("moe.router"):
            weights, experts, self.aux_loss, self.counts = self.router(x)
        with phase("moe.dispatch"):
            rows, state = dispatch(x, experts, weights, self.num_experts, self.group, self.capacity_factor)
        with phase("moe.experts"):
            y = self.experts(rows, state.tokens_per_expert)
        with phase("moe.combine"):
            out = combine(y, state, self.group)
        self.state = state
        return out.view(shape)
