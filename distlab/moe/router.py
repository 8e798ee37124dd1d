"""The MoE router: top-k experts per token, their weights, the balancing loss, aux-loss-free bias.

    python -m pytest tests/test_moe.py -k router

``logits = x W_r^T`` (float32), ``scores = softmax(logits)`` (or ``sigmoid``, DeepSeek-V3 style). The k
experts of a token are the k largest ``scores + bias``, ties broken by the lower expert index (a stable
sort, so the choice is deterministic on every rank and device); their weights are the *unbiased* scores,
renormalised to sum to 1 when ``renormalize`` (always for sigmoid). ``bias`` is the aux-loss-free
balancing term: it moves the choice but never the weights, and ``update_bias(counts)`` nudges it by
``bias_rate`` towards experts that got fewer tokens than average. The auxiliary loss is Switch/GShard's
``E · Σ_e f_e · P_e`` (f = fraction of assignments to e, P = mean score of e), 1 when perfectly balanced.

Hugging Face's convention differs by a factor: transformers' ``load_balancing_loss_func`` (Mixtral, Qwen-MoE)
takes f as the fraction of *tokens* choosing e per top-k slot, summed over the k slots, so it equals
``top-k × aux_loss`` here (k when perfectly balanced; tested in ``tests/test_hf.py``). Scale the
coefficient by 1/k to carry a ``router_aux_loss_coef`` over from a Hugging Face recipe.
"""

from __future__ import annotations

import torch


def route(logits, topk, score="softmax", bias=None, renormalize=True):
    """(weights (T, k), experts (T, k) int64, scores (T, E)) from router logits (T, E)."""
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown router score {score!r}; use softmax or sigmoid")
    if not 1 <= topk <= logits.shape[-1]:
        raise ValueError(f"top-k ({topk}) must be between 1 and the number of experts ({logits.shape[-1]})")
    scores = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()
    choice = scores.detach() if bias is None else scores.detach() + bias
    experts = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(-1, experts)
    if renormalize or score == "sigmoid":
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts, scores


def load_balancing_loss(scores, experts, num_experts):
    """Switch/GShard auxiliary loss ``E · Σ_e f_e · P_e``; differentiable through ``scores``."""
    if experts.numel() == 0:                     # a rank with no tokens
        return scores.sum() * 0.0
    counts = torch.bincount(experts.flatten(), minlength=num_experts).float()
    f = counts / experts.numel()
    return num_experts * (f * scores.mean(0)).sum()


class Router(torch.nn.Module):
    def __init__(self, hidden, num_experts, topk, score="softmax", renormalize=True, bias_rate=0.0,
                 device=None, dtype=None):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"top-k ({topk}) must be between 1 and the number of experts ({num_experts})")
        self.num_experts, self.topk, self.score, self.renormalize = num_experts, topk, score, renormalize
        self.bias_rate = bias_rate
        self.weight = torch.nn.Parameter(torch.randn(num_experts, hidden, device=device, dtype=dtype) * hidden ** -0.5)
        self.register_buffer("bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        # a fixed prior added to the logits (zero by default); the MoE study uses it to skew the load
        self.register_buffer("logit_offset", torch.zeros(num_experts, device=device, dtype=torch.float32))

    def forward(self, x):
        """x (T, hidden) -> (weights, experts, aux_loss, counts per expert)."""
        logits = (x @ self.weight.t()).float() + self.logit_offset
        weights, experts, scores = route(logits, self.topk, self.score, self.bias if self.bias_rate else None,
                                         self.renormalize)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        return weights, experts, load_balancing_loss(scores, experts, self.num_experts), counts

    @torch.no_grad()
    def update_bias(self, counts):
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded ones."""
        counts = counts.float()
        self.bias += self.bias_rate * torch.sign(counts.mean() - counts)
