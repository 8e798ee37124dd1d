"""What one rank holds: parameters, gradients, AdamW state and activations, counted and predicted.

    python -m distlab.train --config small --ac full --memory --steps 3
    distlab run --nproc 4 -m distlab.train --config tiny --dp-shard 4 --memory --steps 2

``held(model, optimizer)`` counts the bytes of the tensors a rank holds right after the optimizer step
(parameters, gradients, AdamW's moments; each storage once); ``saved_activations()`` is a context that
counts the bytes autograd saves for the backward during a forward (each storage once, parameters
excluded): the activation memory a step peaks at, less the temporaries of a kernel. On CUDA ``train``
also reads ``torch.cuda.max_memory_allocated`` over the forward and backward.

``predict(cfg, layout, batch, seq, bytes_per_value)`` is the model of the same quantities from the config
alone:

- parameters per rank: the TP slice of every weight (kv heads copied when tp > kv heads), the replicated
  norms and routers, and E / (dp·cp·tp) experts; under ZeRO-3 everything but the experts divided by the
  shard degree (dp_shard × cp), e.g. a dense model's parameters = total / tp / (dp_shard·cp);
- gradients: the same as the parameters, except that ZeRO-1 keeps them whole (ZeRO-2 divides them);
- AdamW: two moments of what this rank steps (divided by the shard degree from ZeRO-1 on);
- activations under ``--ac full``: each block's input, layers × t × hidden values for t = (batch/dp) ×
  (seq/cp) tokens, plus the loss head's saves: the final norm's input and output and the head's
  flattened input (3 × t × hidden) and the log-softmax (t × vocab/tp, float32). The recompute of one block
  at a time adds that block's own activations during its backward (not counted: a peak of one block).
"""

from __future__ import annotations

import contextlib

import torch

from distlab.model.config import ModelConfig


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def held(model, optimizer) -> dict:
    """Bytes of parameters (ZeRO's pieces included, a released ZeRO-3 parameter is empty), gradients and
    optimizer state on this rank."""
    trained = model.optimizer_parameters() if hasattr(model, "optimizer_parameters") else list(model.parameters())
    params = list(model.parameters()) + [p for p in trained if getattr(p, "distlab_sharding", None) == "zero"]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    grads = [p.grad for p in params if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    state = [v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"parameters": _storage_bytes(local), "gradients": _storage_bytes(grads), "optimizer": _storage_bytes(state)}


class saved_activations(contextlib.AbstractContextManager):
    """``with saved_activations() as saved: loss = model.loss(...)``; then ``saved.bytes``."""

    def __init__(self):
        self.bytes, self._seen = 0, set()

    def _pack(self, t):
        if not isinstance(t, torch.nn.Parameter) and t.numel():
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


def layer_parameter_count(cfg: ModelConfig, tp: int = 1) -> int:
    """Values of one layer's dense weights on a TP rank: the attention's slices (kv heads copied when tp
    exceeds them), the norms, and the SwiGLU MLP's slices or the MoE router."""
    d = cfg.dims_per_head
    kv_local = max(1, cfg.kv_heads // tp)
    attention = cfg.hidden * (cfg.heads // tp + 2 * kv_local) * d + (cfg.heads // tp) * d * cfg.hidden
    norms = 2 * cfg.hidden + (2 * d if cfg.qk_norm else 0)
    mlp = cfg.hidden * cfg.moe_experts if cfg.moe_experts else 3 * cfg.hidden * cfg.ffn // tp
    return attention + norms + mlp


def parameter_counts(cfg: ModelConfig, tp: int = 1, ep: int = 1) -> dict:
    """Values one rank holds of each kind before ZeRO: "sharded" (TP slices and replicated weights, what ZeRO
    shards further) and "experts"."""
    embed = cfg.vocab // tp * cfg.hidden * (1 if cfg.tie_embeddings else 2)
    experts = 3 * cfg.hidden * cfg.ffn * cfg.moe_experts // ep if cfg.moe_experts else 0
    return {"sharded": cfg.layers * layer_parameter_count(cfg, tp) + embed + cfg.hidden,
            "experts": cfg.layers * experts}


def predict(cfg: ModelConfig, layout, batch: int, seq: int, bytes_per_value: int = 4, ac: str = "none") -> dict:
    """The model's bytes per rank for this layout (see the module docstring); activations only for
    ``ac="full"`` (None otherwise: measured or counted, not modelled). ``bytes_per_value``: the weights'
    dtype, which is also the residual stream's under autocast (only the matmuls run in bf16)."""
    counts = parameter_counts(cfg, layout.tp, layout.world_size)   # experts spread over every rank
    shards = layout.shard_degree if layout.sharded else 1
    zero = layout.zero if layout.sharded else 0
    dense, experts = counts["sharded"], counts["experts"]

    def cut(level):
        return dense / shards if zero >= level else dense

    out = {"parameters": (cut(3) + experts) * bytes_per_value, "gradients": (cut(2) + experts) * bytes_per_value,
           "optimizer": 2 * (cut(1) + experts) * bytes_per_value}
    t = batch // layout.dp * seq // layout.cp
    out["activations"] = ((cfg.layers + 3) * t * cfg.hidden * bytes_per_value + t * cfg.vocab // layout.tp * 4
                          if ac == "full" else None)
    return out


def table(rows: list[dict]) -> str:
    """One line per rank and quantity: counted (and measured on CUDA) next to predicted, in MiB."""
    lines = [f"{'rank':>4}  {'what':<12} {'held MiB':>10} {'predicted':>10} {'CUDA MiB':>10}"]
    for r in rows:
        for what in ("parameters", "gradients", "optimizer", "activations"):
            pred = r["predicted"].get(what)
            cuda = r.get("cuda", {}).get(what)
            lines.append(f"{r['rank']:>4}  {what:<12} {r['held'][what] / 2**20:>10.3f} "
                         f"{'-' if pred is None else f'{pred / 2**20:.3f}':>10} "
                         f"{'-' if cuda is None else f'{cuda / 2**20:.3f}':>10}")
    return "\n".join(lines)
