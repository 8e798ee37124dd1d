"""The plan that shards the mini Llama over a mesh: data, context (ring × Ulysses) and tensor (+ SP).

    python -m pytest tests/test_model_parallel.py

``ParallelLlama(ref, layout, mesh)`` builds, from the one-device ``Llama``'s weights, the model sharded as
the ``distlab.runtime.Layout`` says over the mesh it built:

- the embedding as ``VocabParallelEmbedding`` over ``tp`` (reduce-scatter along the sequence under SP);
- every block as ``TPLlamaBlock`` over ``tp`` (fused QKV / gate-up column-parallel, O / down row-parallel,
  SP norms with all-reduced weight gradients);
- the final RMSNorm (SP when SP), and the LM head column-parallel over ``tp`` without gathering the logits,
  with ``vocab_parallel_cross_entropy`` as the loss (the full logits never exist on any rank);
- context parallelism over the ``ring`` × ``ulysses`` axes: each CP rank holds a piece of every sequence
  (``cp_layout`` contiguous or zigzag, the USP piece order of ``distlab.cp.layout``); attention runs as
  ring attention (ulysses = 1), Ulysses (ring = 1) or USP on the tp-local heads, and RoPE uses the
  pieces' global positions; the loss is each rank's mean over its tokens;
- ``dp`` replicates all of it, or with ``layout.dp_shard`` shards it (ZeRO-1/2/3, ``distlab.zero``: the
  optimizer then steps ``optimizer_parameters()``, and ``after_step()`` follows it); ``sync_gradients()`` averages every gradient over ``dp`` × ``cp`` (the
  ranks holding the same weights) and sums the copies of replicated kv heads over ``tp`` — call it after
  ``backward()``, before the optimizer.

- MoE layers (``cfg.moe_experts``): the experts are sharded over every rank, dp × cp × tp (expert
  parallelism over the ranks that otherwise hold the same weights, and over tp: each TP rank routes its
  own share of the tokens — its SP shard, or a 1/tp slice of the replicated tokens — so the router's
  gradient is summed over tp).

``shard_batch`` gives a rank its batch rows (dp) and its sequence piece (cp), and the keyword arguments of
``forward`` / ``loss`` for them (RoPE positions, documents); under SP the embedding then splits that piece
over tp. Attention is each block's child module, chosen here (``ContextAttention`` under CP); positions
and a decode's KV caches are forward arguments. Parameters carry a tag where they are built
(``param.distlab_sharding``: "tp", "ep" or "replicated"), which the gradient sync and the norm read.
"""

from __future__ import annotations

import torch

from distlab import comm
from distlab.cp.allgather import allgather_attention
from distlab.cp.layout import check_divisible, shard_sequence
from distlab.cp.ring import ring_attention
from distlab.cp.ulysses import ulysses_attention
from distlab.cp.usp import usp_attention
from distlab.model.llama import Llama, document_positions
from distlab.runtime import Layout
from distlab.tp.block import TPLlamaBlock
from distlab.tp.linear import ColumnParallelLinear
from distlab.tp.norm import RMSNorm
from distlab.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class ContextAttention(torch.nn.Module):
    """Causal attention over the context-parallel group, the method the layout names: ring attention
    (ulysses 1), Ulysses (ring 1) or USP, or all-gather KV over the ring axis (``method="allgather"``);
    ``forward(q, k, v, cu_seqlens)`` as every block's attention child."""

    def __init__(self, ring_group, ulysses_group, cp_layout, method="ring"):
        super().__init__()
        self.ring_group, self.ulysses_group, self.cp_layout = ring_group, ulysses_group, cp_layout
        self.ring, self.ulysses = comm.group_size(ring_group), comm.group_size(ulysses_group)
        self.method = method

    def forward(self, q, k, v, cu_seqlens=None):
        if self.method == "allgather":
            return allgather_attention(q, k, v, self.ring_group, True, self.cp_layout, cu_seqlens=cu_seqlens)
        if self.ring > 1 and self.ulysses > 1:
            return usp_attention(q, k, v, self.ulysses_group, self.ring_group, True, self.cp_layout, cu_seqlens=cu_seqlens)
        if self.ulysses > 1:
            return ulysses_attention(q, k, v, self.ulysses_group, True, layout=self.cp_layout, cu_seqlens=cu_seqlens)
        return ring_attention(q, k, v, self.ring_group, True, self.cp_layout, cu_seqlens=cu_seqlens)


class ParallelLlama(torch.nn.Module):
    def __init__(self, ref: Llama, layout: Layout, mesh, fsdp_impl: str = "hand"):
        """``fsdp_impl``: with a sharded layout, the hand-written ZeRO (``distlab.zero.sharded``) or PyTorch's
        FSDP2 (``distlab.zero.torch_fsdp``, the anchor)."""
        super().__init__()
        layout.validate()
        sequence_parallel, cp_layout = layout.sp, layout.cp_layout
        self.cfg, self.layout, self.sp, self.cp_layout = ref.cfg, layout, sequence_parallel, cp_layout
        self.tp_group, self.dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        self.ring_group, self.ulysses_group = mesh.get_group("ring"), mesh.get_group("ulysses")
        self.replica_group, self.cp_group = mesh.get_group("dp_cp"), mesh.get_group("cp")
        ring, uly = comm.group_size(self.ring_group), comm.group_size(self.ulysses_group)
        tp = comm.group_size(self.tp_group)
        self.ep_group = mesh.get_group("dp_cp_tp")      # every rank (= dp_cp when tp is 1)
        if ref.cfg.moe_experts and ref.cfg.moe_experts % comm.group_size(self.ep_group):
            raise ValueError(f"{ref.cfg.moe_experts} experts cannot be split over the "
                             f"{comm.group_size(self.ep_group)} expert-parallel (dp x cp x tp) ranks")
        if ref.cfg.vocab % tp:
            raise ValueError(f"vocabulary size ({ref.cfg.vocab}) is not divisible by the tensor-parallel size {tp}")
        if uly > 1 and (ref.cfg.heads // tp) % uly:
            raise ValueError(f"the Ulysses degree {uly} must divide the {ref.cfg.heads // tp} q heads per TP rank")
        if uly > 1 and ring == 1 and cp_layout == "zigzag":
            self.cp_layout = cp_layout = "contiguous"   # Ulysses alone gathers the sequence in order
        self.embed = VocabParallelEmbedding.from_embedding(ref.embed, self.tp_group, sequence_parallel)
        # MoE layers: experts sharded over all ranks (EP = dp x cp x tp)
        self.blocks = torch.nn.ModuleList(
            TPLlamaBlock(b, self.tp_group, sequence_parallel, ep_group=self.ep_group,
                         attention=ContextAttention(self.ring_group, self.ulysses_group, cp_layout, layout.cp_method)
                         if ring * uly > 1
                         else None) for b in ref.blocks)
        self.norm = RMSNorm.from_norm(ref.norm, self.tp_group, sequence_parallel)
        self.head = ColumnParallelLinear.from_linear(ref.head, self.tp_group, sequence_parallel=sequence_parallel)
        if ref.cfg.tie_embeddings:   # both hold vocabulary rows [r·V/tp, (r+1)·V/tp): one parameter, as on one device
            self.head.weight = self.embed.weight
        self._tag_parameters()
        self.zero = None
        if layout.sharded:   # ZeRO over dp_shard x cp: the pieces are what the optimizer steps
            if fsdp_impl not in ("hand", "torch"):
                raise ValueError(f"--fsdp-impl {fsdp_impl!r}: hand (distlab.zero) or torch (FSDP2)")
            from distlab.zero.sharded import ZeroEngine
            from distlab.zero.torch_fsdp import TorchFSDP

            self.zero = (ZeroEngine if fsdp_impl == "hand" else TorchFSDP)(self, layout, mesh)

    def _tag_parameters(self) -> None:
        """``param.distlab_sharding``: "tp" (a slice over the tp group), "ep" (an expert, on one rank of the ep
        group) or "replicated" (the same on every rank of the replica group)."""
        for p in self.parameters():
            p.distlab_sharding = "replicated"
        for p in (self.embed.weight, self.head.weight):
            p.distlab_sharding = "tp"
        for b in self.blocks:
            for layer in (b.qkv, b.o, b.gate_up, b.down):
                if layer is not None:
                    layer.weight.distlab_sharding = "tp"
            if b.moe is not None:
                for p in (b.moe.w_gate, b.moe.w_up, b.moe.w_down):
                    p.distlab_sharding = "ep"
            if b.kv_copies > 1:   # (first element of the kv rows, copies): the gradient norm counts them once
                b.qkv.weight.distlab_kv_copies = (b.local_heads * b.head_dim * b.qkv.weight.shape[1], b.kv_copies)

    def optimizer_parameters(self) -> list:
        """What the optimizer steps: the parameters, or under ZeRO the pieces this rank owns (and the experts)."""
        return self.zero.optimizer_parameters() if self.zero else list(self.parameters())

    def after_step(self) -> None:
        """After the optimizer step (ZeRO-1/2 gather the updated pieces back into the parameters)."""
        if self.zero:
            self.zero.after_step()

    def parameters_tagged(self, tag: str):
        return [p for p in self.parameters() if p.distlab_sharding == tag]

    def shard_batch(self, ids, targets, docs=None):
        """(ids, targets, ctx): this rank's rows (dp) and sequence piece (cp) of a global batch, and ``ctx``
        the keyword arguments of ``loss`` / ``forward`` for them: the pieces' RoPE positions (global
        positions; with ``docs``, one cu_seqlens per row of the global batch, the in-document positions)
        and the rows' documents."""
        dp, r = comm.group_size(self.dp_group), comm.group_rank(self.dp_group)
        if ids.shape[0] % dp:
            raise ValueError(f"batch {ids.shape[0]} is not divisible by the data-parallel size {dp}")
        per = ids.shape[0] // dp
        ids, targets = ids[r * per:(r + 1) * per], targets[r * per:(r + 1) * per]
        ring, uly = comm.group_size(self.ring_group), comm.group_size(self.ulysses_group)
        seq = ids.shape[1]
        check_divisible(seq, ring, self.cp_layout, uly)

        def piece(t, cu=None):
            return shard_sequence(t, self.ring_group, self.cp_layout, 1, self.ulysses_group, cu_seqlens=cu)

        if docs is not None:
            docs = [torch.as_tensor(cu, dtype=torch.int64) for cu in docs[r * per:(r + 1) * per]]
            rows = [piece(torch.stack([i, t, torch.arange(seq)]), cu) for i, t, cu in
                    zip(ids, targets, docs)]            # each row cut by its own documents (balanced layout)
            ids, targets = torch.stack([x[0] for x in rows]), torch.stack([x[1] for x in rows])
            positions = torch.stack([document_positions([cu], seq, x[2])[0] for x, cu in zip(rows, docs)])
            return ids, targets, {"docs": docs, "positions": positions}
        positions = piece(torch.arange(seq)[None])[0] if ring * uly > 1 else None
        ids, targets = piece(ids), piece(targets)
        if self.sp:   # the embedding splits the piece over tp; the LM head gathers it back for the loss
            tp = comm.group_size(self.tp_group)
            if ids.shape[1] % tp:
                raise ValueError(f"sequence piece {ids.shape[1]} is not divisible by the tensor-parallel size {tp}")
        return ids, targets, {"positions": positions}

    fused_ce = False   # True or a chunk of rows: the loss through distlab.kernels.fused_linear_ce

    def forward(self, ids, docs=None, positions=None, caches=None, hidden_only=False):
        """This rank's logits (b, s, vocab/tp) for its ids (its piece of the sequence; the column layer
        gathers the sequence back under SP). ``docs``/``positions``: from ``shard_batch``; ``caches``: one KV
        cache per block (``distlab.infer``); ``hidden_only``: the final norm's output (this rank's SP shard)."""
        x = self.embed(ids)
        positions = positions.to(ids.device) if positions is not None else None
        for i, block in enumerate(self.blocks):
            x = block(x, positions, docs, caches[i] if caches is not None else None)
        h = self.norm(x)
        return h if hidden_only else self.head(h)

    def loss(self, ids, targets, docs=None, positions=None, label_smoothing=0.0):
        """This rank's share of the global batch's mean cross-entropy over non-ignored targets (-100):
        n · (its sum) / (the count over all n = dp x cp ranks that hold different tokens), so averaging the
        losses and gradients over those ranks (``sync_gradients``) gives exactly the one-device mean, however
        unevenly the ignored targets fall. Under TP every rank of a tp group holds the same tokens."""
        if self.fused_ce:   # the column-parallel head's input, then its rows and the loss chunk by chunk
            from distlab.kernels.fused_linear_ce import fused_linear_cross_entropy

            h = self(ids, docs, positions, hidden_only=True)
            h = comm.all_gather(h, self.tp_group, 1) if self.sp else comm.copy_to_group(h, self.tp_group)
            local = fused_linear_cross_entropy(h, self.head.weight, targets, self.tp_group, reduction="sum",
                                               chunk=None if self.fused_ce is True else self.fused_ce,
                                               label_smoothing=label_smoothing)
        else:
            local = vocab_parallel_cross_entropy(self(ids, docs, positions), targets, self.tp_group,
                                                 reduction="sum", label_smoothing=label_smoothing)
        count = comm.all_reduce_raw((targets != -100).sum().to(torch.float64).reshape(1), self.replica_group)
        n = comm.group_size(self.replica_group)
        return local * n / count.clamp_min(1).to(local.dtype).squeeze(0)   # no host sync on the step's path

    @torch.no_grad()
    def full_tensors(self, get) -> dict:
        """``get(param)`` for every parameter, gathered into the one-device ``Llama``'s state-dict names (plus
        the routers' buffers): what a consolidated checkpoint stores."""
        tp = self.tp_group
        out = {"embed.weight": comm.all_gather_raw(get(self.embed.weight), tp, 0), "norm.weight": get(self.norm.weight)}
        if not self.cfg.tie_embeddings:   # tied: the embedding is the head (and named so on one device too)
            out["head.weight"] = comm.all_gather_raw(get(self.head.weight), tp, 0)
        for i, block in enumerate(self.blocks):
            for name, t in block.full_tensors(get).items():
                out[f"blocks.{i}.{name}.weight"] = t
            if block.moe is not None:
                out[f"blocks.{i}.moe.router.weight"] = get(block.moe.router.weight)
                for name in ("w_gate", "w_up", "w_down"):
                    out[f"blocks.{i}.moe.{name}"] = comm.all_gather_raw(get(getattr(block.moe, name)),
                                                                      self.ep_group, 0)
        return out

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (as one device would compute it), after ``sync_gradients``:
        tp-sharded weights summed over tp (a kv head copied on c ranks counted 1/c each), experts over ep,
        replicated parameters once."""
        device = self.norm.weight.device
        sums = {tag: torch.zeros((), dtype=torch.float64, device=device) for tag in ("replicated", "tp", "ep")}
        for p in self.parameters():
            if p.grad is not None:
                sums[p.distlab_sharding] += p.grad.double().square().sum()
        rep, tp, ep = sums["replicated"], sums["tp"], sums["ep"]
        for b in self.blocks:                              # kv-head copies: count each head once
            if b.kv_copies > 1 and b.qkv.weight.grad is not None:
                kv_rows = b.qkv.weight.grad[b.local_heads * b.head_dim:].double().square().sum()
                tp -= kv_rows * (1 - 1 / b.kv_copies)
        total = rep + comm.all_reduce_raw(tp, self.tp_group) + comm.all_reduce_raw(ep, self.ep_group)
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        if self.zero:
            return self.zero.clip_grad_norm(max_norm)
        norm = self.grad_norm()
        scale = min(1.0, max_norm / (norm.item() + 1e-6))
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return norm.item()

    @torch.no_grad()
    def sync_gradients(self):
        if self.zero:
            return self.zero.finish_gradients()
        for block in self.blocks:
            block.sync_replicated_kv_grads()
            block.sync_router_grads()
        n = comm.group_size(self.replica_group)
        if n > 1:
            for p in self.parameters_tagged("ep"):   # an expert lives on one rank and holds every token's part
                if p.grad is not None:
                    p.grad /= n
            comm.all_reduce_mean_([p.grad for p in self.parameters() if p.grad is not None and
                                   p.distlab_sharding != "ep"], self.replica_group)
