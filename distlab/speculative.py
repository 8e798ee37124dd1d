"""Speculative decoding's verify step on the mini Llama: the logits of every token of a draft tree, in one
forward over the tree, after one prefill of the accepted prefix.

    python -m pytest tests/test_tree_attention.py

``verify_tree(model, prefix_ids, tree_ids, parents)`` prefills ``prefix_ids`` (1, L) with a ``TreeCache``
per block (it keeps the prefix's K/V after RoPE), then runs the tree's tokens (1, n) at positions
``L + depth`` with each block's attention replaced by ``tree_attention`` (prefix + ancestors). Row i of the
result is what decoding token i's branch one token at a time would give after token i: the target model's
distribution for the token that follows it, so a draft token is accepted when it equals the argmax at
its parent's row. The model is a ``ParallelLlama`` without context parallelism (TP is fine: each rank's
cache holds its heads); a CP-sharded prefix would need the tree's queries merged across the CP ranks,
which this does not do.
"""

from __future__ import annotations

import torch

from distlab.kernels.tree_attention import check_parents, depths, tree_attention


class TreeCache:
    """A block's cache: during the prefix's prefill, attend causally and keep K/V; during the tree's forward,
    attend the tree's queries to the prefix and their ancestors."""

    def __init__(self, parents=None):
        self.parents, self.k, self.v = parents, None, None

    def attend(self, q, k, v, attention):
        if self.parents is None:     # the prefix
            self.k, self.v = k, v
            return attention(q, k, v)
        return tree_attention(q, k, v, self.parents, self.k, self.v)


@torch.no_grad()
def verify_tree(model, prefix_ids, tree_ids, parents) -> torch.Tensor:
    """(n, vocab/tp) logits of the tree's tokens (this rank's vocabulary slice under TP)."""
    if getattr(model, "layout", None) is None or model.layout.cp > 1:
        raise ValueError("verify_tree takes a ParallelLlama without context parallelism (ring = ulysses = 1)")
    if prefix_ids.dim() != 2 or tree_ids.dim() != 2 or prefix_ids.shape[0] != 1 or tree_ids.shape[0] != 1:
        raise ValueError(f"verify_tree: one sequence, prefix (1, L) and tree (1, n); got {tuple(prefix_ids.shape)} "
                         f"and {tuple(tree_ids.shape)}")
    parents = check_parents(parents, tree_ids.shape[1])
    length = prefix_ids.shape[1]
    caches = [TreeCache() for _ in model.blocks]
    model(prefix_ids, positions=torch.arange(length), caches=caches)
    for c in caches:
        c.parents = parents
    positions = length + depths(parents)
    return model(tree_ids, positions=positions, caches=caches)[0]
