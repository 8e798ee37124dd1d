"""Vocab-parallel embedding and cross-entropy: the vocabulary split over TP, logits never gathered.

    python -m pytest tests/test_tp.py -k vocab

Rank r holds vocabulary rows ``[r·V/tp, (r+1)·V/tp)``. The embedding looks up the ids it owns, writes
zeros for the others, and sums over TP (all-reduce; with sequence parallelism a reduce-scatter along the
sequence). The cross-entropy takes this rank's logits ``(..., V/tp)`` (a column-parallel LM head without
``gather_output``) and reduces three small tensors over TP instead of gathering ``(..., V)``: the row max
(for stability), the sum of ``exp(logit − max)``, and the target's logit (from the rank that owns it).
``loss = log(sum_exp) − (target_logit − max)``; its gradient is ``softmax − one_hot`` on each rank's
slice. Tokens equal to ``ignore_index`` count neither in the loss nor in the mean, as in
``F.cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import comm


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    if comm.group_size(group) > 1:
        comm.record("all_reduce", comm.sent_bytes("all_reduce", x.numel() * x.element_size(), comm.group_size(group)))
        dist.all_reduce(x, op=op, group=group)
    return x


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings, dim, group=None, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        self.group, self.tp, self.rank = group, comm.group_size(group), comm.group_rank(group)
        if num_embeddings % self.tp:
            raise ValueError(f"vocabulary size ({num_embeddings}) is not divisible by the tensor-parallel size {self.tp}")
        self.per_rank = num_embeddings // self.tp
        self.start = self.rank * self.per_rank
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.randn(self.per_rank, dim, device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, emb: torch.nn.Embedding, group=None, sequence_parallel=False):
        new = cls(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel, emb.weight.device, emb.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(emb.weight[new.start:new.start + new.per_rank])
        return new

    def forward(self, ids):
        vocab = self.per_rank * self.tp
        # one reduction, one host sync per forward; none inside a CUDA graph's capture (graphed decode feeds
        # back its own argmax, in range by construction, and a capture cannot read the device)
        capturing = ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and bool(((ids < 0) | (ids >= vocab)).any()):
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): min {int(ids.min())}, max {int(ids.max())}")
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mine.unsqueeze(-1)
        if self.sequence_parallel:
            return comm.reduce_scatter(out, self.group, dim=1)
        return comm.reduce_from_group(out, self.group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, start, ignore_index, reduction, smoothing=0.0, vocab=None):
        logits_dtype = logits.dtype
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        vmax = _all_reduce(logits.max(-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - vmax.unsqueeze(-1)
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1]) & (target != ignore_index)
        idx = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        target_logit = _all_reduce(shifted.gather(-1, idx).squeeze(-1) * mine, group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(-1), group)
        keep = target != ignore_index
        count = keep.sum().clamp_min(1) if reduction == "mean" else 1
        per_token = sum_exp.log() - target_logit
        if smoothing:   # (1 - e)·NLL + e·mean_j(-log p_j), with mean_j log p_j = mean_j shifted_j - log sum_exp
            mean_shifted = _all_reduce(shifted.sum(-1), group) / vocab
            per_token = (1 - smoothing) * per_token + smoothing * (sum_exp.log() - mean_shifted)
        loss = (per_token * keep).sum() / count
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), idx, mine, keep)
        ctx.count, ctx.dtype, ctx.smoothing, ctx.vocab = count, logits_dtype, smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, keep = ctx.saved_tensors
        g = softmax                                         # softmax - (1 - e)·one_hot - e / V
        g.scatter_add_(-1, idx, -(1 - ctx.smoothing) * mine.unsqueeze(-1).to(g.dtype))
        if ctx.smoothing:
            g.sub_(ctx.smoothing / ctx.vocab)
        g = g * (keep.unsqueeze(-1) * (grad / ctx.count))
        return g.to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_local, target, group=None, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0):
    """Cross-entropy over non-ignored tokens from this rank's vocabulary slice of the logits: their mean, or
    with ``reduction="sum"`` their sum (to divide by a count taken over more ranks than this one).
    ``label_smoothing`` as ``F.cross_entropy``'s (one more all-reduce of a token-sized tensor).

    logits_local: ``(..., V/tp)`` for vocabulary rows ``[rank·V/tp, ...)``, the same width on every rank (pad
    the vocabulary to a multiple of tp: slices of different widths are refused); target: ``(...)`` global ids
    in ``[0, V)`` or ``ignore_index``.
    """
    comm.check_same_on_every_rank("vocab_parallel_cross_entropy", comm.tensor_signature(logits_local, target),
                                  group, comm.describe_signature)
    if logits_local.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits_local.shape)} and target {tuple(target.shape)} disagree")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum'; got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    vocab = logits_local.shape[-1] * comm.group_size(group)
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        raise ValueError(f"targets outside the vocabulary [0, {vocab}) (and not ignore_index {ignore_index}): "
                         f"{target[bad][:4].tolist()}")
    start = comm.group_rank(group) * logits_local.shape[-1]
    return _VocabParallelCE.apply(logits_local, target, group, start, ignore_index, reduction, label_smoothing, vocab)
