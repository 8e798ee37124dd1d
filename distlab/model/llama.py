"""The one-device mini Llama: byte embedding → N Llama blocks (dense or MoE) → RMSNorm → LM head.

    python -m distlab.train --config tiny

Built from distlab's own layers (``distlab.tp.block.LlamaBlock``, ``distlab.moe.MoEReference``), so the
sharded model can be built from the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab.model.config import ModelConfig
from distlab.moe.layer import MoEReference
from distlab.tp.block import LlamaBlock
from distlab.tp.norm import RMSNorm


class Llama(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        kw = {"device": device, "dtype": dtype}
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.hidden, **kw)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(cfg.layers):
            moe = MoEReference(cfg.hidden, cfg.ffn, cfg.moe_experts, cfg.moe_topk, cfg.moe_score, **kw,
                               renormalize=cfg.moe_renormalize, bias_rate=cfg.moe_bias_rate) if cfg.moe_experts else None
            self.blocks.append(LlamaBlock(cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.rope_base, cfg.rms_norm_eps,
                                          moe=moe, head_dim=cfg.head_dim, rope_scaling=cfg.rope_scaling,
                                          qk_norm=cfg.qk_norm, **kw))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_norm_eps, **kw)
        self.head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False, **kw)
        if cfg.tie_embeddings:   # one matrix: the embedding's rows are the LM head's
            self.head.weight = self.embed.weight

    fused_ce = False   # True or a chunk of rows: the loss through distlab.kernels.fused_linear_ce

    def forward(self, ids, docs=None, hidden_only=False):
        """``docs``: packed documents, one cu_seqlens per row of ``ids``: attention stays inside each
        document and RoPE positions restart at every document start (as Llama 3 packs). ``hidden_only``: the
        final norm's output, before the LM head."""
        positions = document_positions(docs, ids.shape[1]).to(ids.device) if docs is not None else None
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, positions, docs)
        h = self.norm(x)
        return h if hidden_only else self.head(h)

    def loss(self, ids, targets, docs=None, label_smoothing=0.0):
        """Mean cross-entropy over the targets that are not ``-100`` (ignored: a document's last token);
        with ``fused_ce`` the LM head and the loss in chunks, never holding the logits."""
        if self.fused_ce:
            from distlab.kernels.fused_linear_ce import fused_linear_cross_entropy

            return fused_linear_cross_entropy(self(ids, docs, hidden_only=True), self.head.weight, targets,
                                              chunk=None if self.fused_ce is True else self.fused_ce,
                                              label_smoothing=label_smoothing)
        logits = self(ids, docs)
        logits = logits if logits.dtype == torch.float64 else logits.float()   # the loss in at least fp32
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                               label_smoothing=label_smoothing)


def document_positions(docs, seq: int, positions=None) -> torch.Tensor:
    """(rows, len) RoPE positions: each token's offset in its document, for the global ``positions``
    (default all of ``0..seq-1``) of every row's packed documents ``docs`` (one cu_seqlens per row)."""
    pos = torch.arange(seq) if positions is None else positions.cpu()
    rows = []
    for cu in docs:
        cu = torch.as_tensor(cu, dtype=torch.int64)
        rows.append(pos - cu[torch.searchsorted(cu, pos, right=True) - 1])
    return torch.stack(rows)
