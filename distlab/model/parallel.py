"""The plan that shards the mini Llama over a mesh — so far data and tensor (+ sequence) parallelism.

    python -m pytest tests/test_model_parallel.py

``ParallelLlama(ref, mesh, sequence_parallel)`` builds, from the one-device ``Llama``'s weights:

- the embedding as ``VocabParallelEmbedding`` over ``tp`` (reduce-scatter along the sequence under SP);
- every block as ``TPLlamaBlock`` over ``tp`` (fused QKV / gate-up column-parallel, O / down row-parallel,
  SP norms with all-reduced weight gradients);
- the final RMSNorm (SP when SP), and the LM head column-parallel over ``tp`` without gathering the logits,
  with ``vocab_parallel_cross_entropy`` as the loss (the full logits never exist on any rank);
- ``dp`` replicates all of it; ``sync_gradients()`` averages every gradient over ``dp`` and sums the copies
  of replicated kv heads over ``tp`` — call it after ``backward()``, before the optimizer.

Each dp rank takes its slice of the batch; under SP each tp rank of a sequence takes its slice of the
sequence (``shard_batch``). CP and EP enter the same plan next (attention through ``distlab.cp``, MoE
through ``distlab.moe.MoE``).
"""

from __future__ import annotations

import torch

from distlab import comm
from distlab.model.llama import Llama
from distlab.tp.block import TPLlamaBlock
from distlab.tp.linear import ColumnParallelLinear
from distlab.tp.norm import RMSNorm
from distlab.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class ParallelLlama(torch.nn.Module):
    def __init__(self, ref: Llama, mesh, sequence_parallel=False):
        super().__init__()
        if ref.cfg.moe_experts:
            raise ValueError("MoE layers are not in the parallel plan yet (dense models only)")
        self.cfg, self.sp = ref.cfg, sequence_parallel
        self.tp_group, self.dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        tp = comm.group_size(self.tp_group)
        if ref.cfg.vocab % tp:
            raise ValueError(f"vocabulary size ({ref.cfg.vocab}) is not divisible by the tensor-parallel size {tp}")
        self.embed = VocabParallelEmbedding.from_embedding(ref.embed, self.tp_group, sequence_parallel)
        self.blocks = torch.nn.ModuleList(TPLlamaBlock(b, self.tp_group, sequence_parallel) for b in ref.blocks)
        self.norm = RMSNorm.from_norm(ref.norm, self.tp_group, sequence_parallel)
        self.head = ColumnParallelLinear.from_linear(ref.head, self.tp_group, sequence_parallel=sequence_parallel)

    def shard_batch(self, ids, targets):
        """This rank's rows (dp) and, under SP, its sequence slice (tp) of a global batch."""
        dp, r = comm.group_size(self.dp_group), comm.group_rank(self.dp_group)
        if ids.shape[0] % dp:
            raise ValueError(f"batch {ids.shape[0]} is not divisible by the data-parallel size {dp}")
        per = ids.shape[0] // dp
        ids, targets = ids[r * per:(r + 1) * per], targets[r * per:(r + 1) * per]
        if self.sp:   # the loss is taken on the full sequence of this rank's logits slice: targets stay whole
            tp = comm.group_size(self.tp_group)
            if ids.shape[1] % tp:
                raise ValueError(f"sequence {ids.shape[1]} is not divisible by the tensor-parallel size {tp}")
        return ids, targets

    def loss(self, ids, targets):
        """Mean cross-entropy over this dp rank's tokens (the vocabulary split over tp)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))          # (b, s, vocab/tp): the column layer gathered the sequence
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group)

    @torch.no_grad()
    def sync_gradients(self):
        for block in self.blocks:
            block.sync_replicated_kv_grads()
        dp = comm.group_size(self.dp_group)
        if dp > 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            flat = comm.all_reduce_raw(torch.cat([g.reshape(-1) for g in grads]), self.dp_group) / dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
