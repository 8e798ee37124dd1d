"""One training step of a whole model on one layout: time (compute and exposed communication), memory per
GPU, tokens/s and MFU. The pieces are ``distlab.plan.model``'s; this file adds the layers up.

    python -m distlab.plan --model llama3-8b --seq 131072 --cluster 2x8 --intra nvlink4 --inter ib-ndr400

Conventions (torchtitan's mixed precision): bf16 compute, float32 master weights, gradients and AdamW
moments; ZeRO-3 gathers parameters in bf16 and reduce-scatters gradients in float32. Data parallelism
shards over dp_shard × cp (``distlab.runtime.Layout``); dense gradients are reduced over every data and
context-parallel rank; experts are spread over ``ep`` = gcd(experts, world) ranks placed innermost.

Memory per GPU: parameters, gradients and optimizer state as ``distlab.zero.memory.predict`` counts them
(float32), ZeRO-3's two gathered bf16 layers in flight, activations (below), and the loss's float32
logits and their gradient. Activations per token and layer, bf16: without checkpointing 6h (norms,
residuals, the projections' inputs; /tp under SP) + (2·heads + 4·kv)·d/tp (q, k, v, out, RoPE'd q/k) + 4·ffn/tp
(gate, up, SwiGLU out) plus the float32 LSE; selective checkpointing (``distlab.zero.checkpointing``: matmul
outputs and the attention kept, norms, RoPE and SwiGLU recomputed, at the memory-bound kernels' cost) saves
2h (/tp under SP) + 2·ffn/tp of that; full checkpointing keeps the block input (h, /tp under SP) per layer
plus one layer's full set during its recompute (the whole forward again, collectives included). A layout fits when the sum is at most 92% of the
GPU's memory (the CUDA context, NCCL's buffers and the allocator's slack take the rest).
"""

from __future__ import annotations

import dataclasses
import math

from distlab.model.config import ModelConfig
from distlab.zero.memory import layer_parameter_count
from distlab.plan.links import Cluster
from distlab.plan.model import (ELEMENTWISE_CALLS, AttnShape, Kernels, Phase, attention_cost, block_cost,
                                 elementwise_bytes)

FIT_SHARE = 0.92


@dataclasses.dataclass(frozen=True)
class Plan:
    """One layout: TP × (Ulysses × ring) CP with ``method`` × data parallelism (ZeRO level, HSDP split)."""

    tp: int
    ulysses: int
    ring: int
    method: str           # ring, ulysses, usp, allgather (cp = 1: "none")
    dp_shard: int
    dp_replicate: int
    zero: int             # 0: plain DDP
    ac: str               # none, selective or full
    async_tp: bool = False

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    def describe(self) -> str:
        cp = {"none": "", "ring": f" · ring {self.ring}", "ulysses": f" · Ulysses {self.ulysses}",
              "usp": f" · USP {self.ulysses}x{self.ring}", "allgather": f" · all-gather KV {self.ring}"}[self.method]
        shards = self.dp_shard * self.cp               # ZeRO shards over dp_shard x cp
        dp = (f"FSDP {shards}" if self.zero == 3 else f"ZeRO-{self.zero} {shards}" if self.zero
              else f"DDP {self.dp}" if self.dp > 1 else "no DP")
        if self.dp_replicate > 1 and self.zero:
            dp = f"HSDP {self.dp_replicate}x{shards}"
        tp = f" · TP {self.tp}{' async' if self.async_tp else ''}" if self.tp > 1 else ""
        return f"{dp}{tp}{cp} · AC {self.ac}"


def model_flops(cfg: ModelConfig, tokens: int, attn_pairs: float) -> float:
    """FLOPs of one step as MFU counts them (no recompute): 6 × active non-embedding weights × tokens, the
    LM head 6·h·vocab per token, attention 3.5 × 4·pairs·heads·d per layer (FlashAttention's count)."""
    d = cfg.dims_per_head
    attn_w = cfg.hidden * (cfg.heads + 2 * cfg.kv_heads) * d + cfg.heads * d * cfg.hidden
    mlp_w = 3 * cfg.hidden * cfg.ffn * (cfg.moe_topk if cfg.moe_experts else 1) + cfg.hidden * cfg.moe_experts
    return (6 * (cfg.layers * (attn_w + mlp_w) + cfg.hidden * cfg.vocab) * tokens
            + cfg.layers * 3.5 * 4 * attn_pairs * cfg.heads * d)


def activation_bytes(cfg: ModelConfig, plan: Plan, tokens: int, itemsize: int = 2) -> float:
    d, h, tp = cfg.dims_per_head, cfg.hidden, plan.tp
    sp = tp if tp > 1 else 1
    ffn = cfg.ffn * cfg.moe_topk if cfg.moe_experts else cfg.ffn
    q_w, kv_w = cfg.heads // tp * d, max(1, cfg.kv_heads // tp) * d     # kv heads copied when tp > kv heads
    full = itemsize * (6 * h / sp + 2 * q_w + 4 * kv_w + 4 * ffn / tp) + 4 * cfg.heads / tp
    # selective (distlab.zero.checkpointing): matmul outputs and attention kept, norms/RoPE/SwiGLU recomputed
    selective = full - itemsize * (2 * h / sp + 2 * ffn / tp)
    per_layer = itemsize * h / sp if plan.ac == "full" else selective if plan.ac == "selective" else full
    layers = cfg.layers * per_layer + (full if plan.ac == "full" else 0.0)
    logits = 8 * cfg.vocab / tp
    return tokens * (layers + logits)


def memory(cfg: ModelConfig, plan: Plan, world: int, local_batch: int, seq: int) -> dict:
    from distlab.runtime import Layout
    from distlab.zero.memory import predict

    ep = math.gcd(cfg.moe_experts, world) if cfg.moe_experts else 1
    layout = Layout(world, dp=plan.dp, tp=plan.tp, ring=plan.ring, ulysses=plan.ulysses, sp=plan.tp > 1,
                    dp_shard=plan.dp_shard if plan.zero else None,
                    dp_replicate=plan.dp_replicate if plan.zero else None, zero=plan.zero or None)
    out = predict(cfg, layout, plan.dp, 1, bytes_per_value=4)
    if cfg.moe_experts and ep != world:   # predict spreads experts over every rank; here over ep of them
        per_rank = 3 * cfg.hidden * cfg.ffn * cfg.moe_experts * cfg.layers
        extra = per_rank / ep - per_rank / world
        out = {k: (v + extra * (2 if k == "optimizer" else 1) * 4 if v is not None else v) for k, v in out.items()}
    out = {k: v for k, v in out.items() if k != "activations"}
    out["gathered"] = 2 * 2 * layer_parameter_count(cfg, plan.tp) if plan.zero == 3 else 0.0
    out["activations"] = activation_bytes(cfg, plan, local_batch * seq // plan.cp)
    out["total"] = sum(out.values())
    return out


def group_links(cluster: Cluster, plan: Plan):
    """Links of the TP, Ulysses, ring (or all-gather) and sharding groups, placed as ``Layout.build_mesh``."""
    tp, u, r = plan.tp, plan.ulysses, plan.ring
    return {"tp": cluster.group_link(1, tp), "ulysses": cluster.group_link(tp, u), "ring": cluster.group_link(tp * u, r),
            "shard": cluster.group_link(tp, u * r * plan.dp_shard),
            "replicate": cluster.group_link(tp * u * r * plan.dp_shard, plan.dp_replicate)}


def step(cfg: ModelConfig, plan: Plan, cluster: Cluster, k: Kernels, seq: int, batch: int, docs=None) -> dict:
    """Predicted step of ``batch`` sequences of ``seq`` tokens (global) on ``cluster`` (module doc)."""
    world = cluster.world
    local_batch = batch // plan.dp
    t = local_batch * seq // plan.cp
    links = group_links(cluster, plan)
    d = cfg.dims_per_head
    shape = AttnShape(local_batch, seq, cfg.heads // plan.tp, max(1, cfg.kv_heads // plan.tp), d, k.itemsize,
                      True, docs, "zigzag")
    attn = attention_cost(plan.method if plan.cp > 1 else "ring", shape, k, links["ulysses"], links["ring"],
                          plan.ulysses, plan.ring)
    ep = math.gcd(cfg.moe_experts, world) if cfg.moe_experts else 1
    moe = ({"experts": cfg.moe_experts, "topk": cfg.moe_topk, "ep": ep, "ep_link": cluster.group_link(1, ep)}
           if cfg.moe_experts else None)
    dims = {"hidden": cfg.hidden, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": d, "ffn": cfg.ffn}
    fwd, bwd = block_cost(t, dims, plan.tp, plan.tp > 1, attn, k, links["tp"], plan.async_tp, moe)
    if plan.ac == "full":
        bwd = bwd + fwd                     # the forward again, its collectives included
    elif plan.ac == "selective":            # the memory-bound kernels of the forward again
        q_w, kv_w = cfg.heads // plan.tp * d, 2 * max(1, cfg.kv_heads // plan.tp) * d
        ffn_local = 0 if cfg.moe_experts else cfg.ffn // plan.tp
        bwd = bwd + Phase(k.memory(elementwise_bytes(t, cfg.hidden, q_w, kv_w, ffn_local, k.itemsize,
                                                     1 / plan.tp if plan.tp > 1 else 1.0), ELEMENTWISE_CALLS))
    # data parallel, per layer: gathers before the forward and backward, gradient reduction after
    p_layer = layer_parameter_count(cfg, plan.tp)
    shard_n = plan.dp_shard * plan.cp if plan.zero else plan.dp * plan.cp
    sl = links["shard"] if plan.dp_replicate == 1 or plan.zero else cluster.group_link(plan.tp, shard_n)
    if plan.zero == 3:
        gather = sl.time("all_gather", 2 * p_layer, shard_n)
        dp_f, dp_b = gather, gather + sl.time("reduce_scatter", 4 * p_layer, shard_n)
        if plan.dp_replicate > 1:
            dp_b += links["replicate"].time("all_reduce", 4 * p_layer / shard_n, plan.dp_replicate)
    elif plan.zero in (1, 2):
        dp_f, dp_b = 0.0, sl.time("reduce_scatter", 4 * p_layer, shard_n)
    else:
        dp_f, dp_b = 0.0, sl.time("all_reduce", 4 * p_layer, shard_n)
    if moe and world // ep > 1:              # experts' gradients over their replicas
        replicas = cluster.group_link(ep, world // ep)                # the ranks holding the same experts
        dp_b += replicas.time("all_reduce", 4 * 3 * cfg.hidden * cfg.ffn * cfg.moe_experts / ep, world // ep)
    hide = sl.overlaps_compute
    layer_f = fwd + Phase(0.0, dp_f, max(0.0, dp_f - fwd.compute) if hide else dp_f)
    layer_b = bwd + Phase(0.0, dp_b, max(0.0, dp_b - bwd.compute) if hide else dp_b)
    total = (layer_f + layer_b).scaled(cfg.layers)
    total += Phase(0.0, dp_f + dp_b, dp_f + dp_b)                     # the first gather, the last reduction
    if plan.zero in (1, 2):                                            # updated shards gathered after the step
        ag = sl.time("all_gather", 2 * p_layer * cfg.layers, shard_n)
        total += Phase(0.0, ag, ag)
    head_v = cfg.vocab // plan.tp
    head = k.gemm(t, cfg.hidden, head_v) + k.gemm(t, cfg.hidden, head_v, backward=True) + k.memory(3 * 4 * t * head_v, 6)
    mem = memory(cfg, plan, world, local_batch, seq)
    optimizer = k.memory(7 * 4 * (mem["optimizer"] / 8), 1)            # AdamW: read p, g, m, v; write p, m, v
    total += Phase(head + optimizer)
    step_s = total.total
    pairs = attn_pairs(seq, docs) * local_batch
    flops = model_flops(cfg, batch * seq, pairs * plan.dp)
    peak = k.cal.data.get("peak_tflops")
    return {"layout": plan.describe(), "plan": dataclasses.asdict(plan), "step_s": step_s,
            "compute_s": total.compute, "comm_s": total.comm, "exposed_comm_s": total.exposed,
            "per_layer": {"attention_fwd": dataclasses.asdict(attn[0]), "attention_bwd": dataclasses.asdict(attn[1]),
                          "block_fwd": dataclasses.asdict(fwd), "block_bwd": dataclasses.asdict(bwd),
                          "dp_fwd_s": dp_f, "dp_bwd_s": dp_b},
            "links": {name: link.name for name, link in links.items()},
            "tokens_per_s_per_gpu": batch * seq / step_s / world,
            "mfu": flops / step_s / world / (peak * 1e12) if peak else None,
            "memory": mem, "extrapolated": sorted(k.extrapolated)}


def attn_pairs(seq: int, docs=None) -> float:
    if docs is not None and docs.masked:
        import torch

        return docs.work(torch.arange(seq))
    return seq * (seq + 1) / 2
