"""Tree attention for speculative decoding's verify step: every draft token of a tree in one forward.

    python -m pytest tests/test_tree_attention.py

A draft tree of n tokens is given by ``parents`` (n,): ``parents[i]`` is the index of token i's parent in
the tree, or -1 for a child of the last accepted token; parents come before children (``parents[i] < i``).
Token i attends to the whole accepted prefix (the KV cache) and to its ancestors in the tree and itself —
the tokens its branch would have decoded one by one — and sits at RoPE position ``prefix + depth(i)``.

``tree_attention(q, k_tree, v_tree, parents, k_prefix, v_prefix, block)`` computes it as block-sparse
attention: the prefix part is one ordinary (unmasked) attention call, the tree part walks (query block, key
block) tiles of the ancestor mask, skips every tile with no visible pair (``stats["tiles"]`` counts the
ones computed), and the parts are merged by their log-sum-exps (``distlab.kernels.lse_merge``). The tree
part is small (n ≤ a few hundred), so its tiles run in plain PyTorch; the prefix part uses the attention
backends. The reference is dense masked softmax over [prefix, tree] (``tree_attention_reference``).

``distlab.speculative.verify_tree`` runs the mini Llama over a tree with a KV cache; tests check it against
decoding each branch separately, token for token.
"""

from __future__ import annotations

import math

import torch

from distlab.kernels.attention import attention_forward
from distlab.kernels.lse_merge import merge_attention


def check_parents(parents, n: int) -> torch.Tensor:
    parents = torch.as_tensor(parents, dtype=torch.int64).cpu()
    if parents.shape != (n,):
        raise ValueError(f"parents: one entry per tree token ({n}); got shape {tuple(parents.shape)}")
    bad = [i for i, p in enumerate(parents.tolist()) if not -1 <= p < i]
    if bad:
        raise ValueError(f"parents: each token's parent must be -1 (the prefix) or an earlier token; tokens {bad[:4]} "
                         f"have {[int(parents[i]) for i in bad[:4]]}")
    return parents


def ancestor_mask(parents) -> torch.Tensor:
    """(n, n) bool: ``mask[i, j]`` when j is i or one of its ancestors."""
    parents = torch.as_tensor(parents, dtype=torch.int64).cpu()
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def depths(parents) -> torch.Tensor:
    """Each token's depth in the tree (a child of the prefix has depth 0)."""
    out = []
    for p in torch.as_tensor(parents).tolist():
        out.append(0 if p < 0 else out[p] + 1)
    return torch.tensor(out, dtype=torch.int64)


def _expand_kv(k, heads):
    return k.repeat_interleave(heads // k.shape[2], dim=2) if k.shape[2] != heads else k


def tree_attention(q, k_tree, v_tree, parents, k_prefix=None, v_prefix=None, block: int = 16, softmax_scale=None,
                   backend="auto", stats: dict | None = None):
    """(batch, n, heads, d) queries of the tree's tokens against the prefix (``k_prefix``/``v_prefix``,
    (batch, L, kv_heads, d), every token sees all of it) and their ancestors in the tree (``k_tree``/
    ``v_tree``, (batch, n, kv_heads, d)). Returns the output like ``q``."""
    b, n, h, d = q.shape
    parents = check_parents(parents, n)
    if k_tree.shape[:2] != (b, n) or v_tree.shape != k_tree.shape or h % k_tree.shape[2]:
        raise ValueError(f"tree_attention: q {tuple(q.shape)}, k {tuple(k_tree.shape)}, v {tuple(v_tree.shape)} "
                         "do not fit ((batch, n, heads, d) and (batch, n, kv_heads, d), kv_heads dividing heads)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = ancestor_mask(parents).to(q.device)
    kt, vt = _expand_kv(k_tree, h).to(ct), _expand_kv(v_tree, h).to(ct)
    out = lse = None
    computed = 0
    for qs in range(0, n, block):
        qe = min(n, qs + block)
        o_blk = l_blk = None
        for ks in range(0, qe, block):            # ancestors come first: no key block past the query block
            ke = min(n, ks + block)
            tile = mask[qs:qe, ks:ke]
            if not bool(tile.any()):
                continue
            computed += 1
            s = torch.einsum("bqhd,bkhd->bhqk", q[:, qs:qe].to(ct), kt[:, ks:ke]) * scale
            s = s.masked_fill(~tile, float("-inf"))
            tile_lse = torch.logsumexp(s, -1)                                        # (b, h, q)
            p = torch.exp(s - tile_lse[..., None]).nan_to_num(0.0)
            tile_out = torch.einsum("bhqk,bkhd->bqhd", p, vt[:, ks:ke])
            o_blk, l_blk = merge_attention(o_blk, l_blk, tile_out, tile_lse)
        out = o_blk if out is None else torch.cat([out, o_blk], 1)
        lse = l_blk if lse is None else torch.cat([lse, l_blk], 2)
    if stats is not None:
        stats["tiles"] = computed
        stats["all_tiles"] = sum(1 for qs in range(0, n, block) for _ in range(0, min(n, qs + block), block))
    if k_prefix is not None and k_prefix.shape[1] > 0:
        p_out, p_lse = attention_forward(q, k_prefix, v_prefix, causal=False, softmax_scale=scale, backend=backend)
        out, lse = merge_attention(out, lse, p_out, p_lse)
    return out.to(q.dtype)


def tree_attention_reference(q, k_tree, v_tree, parents, k_prefix=None, v_prefix=None, softmax_scale=None):
    """Dense masked softmax over [prefix, tree] in float64."""
    b, n, h, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    mask = ancestor_mask(parents)
    if k_prefix is not None:
        k_tree, v_tree = torch.cat([k_prefix, k_tree], 1), torch.cat([v_prefix, v_tree], 1)
        mask = torch.cat([torch.ones(n, k_prefix.shape[1], dtype=torch.bool), mask], 1)
    k, v = _expand_kv(k_tree, h).double(), _expand_kv(v_tree, h).double()
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    s = s.masked_fill(~mask.to(q.device), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v).to(q.dtype)
