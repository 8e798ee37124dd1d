"""Hugging Face checkpoints in and out: a transformers-format folder <-> a distlab checkpoint.

    python -m distlab.model.convert --from-hf path/to/Llama-3.2-1B --to ckpt/llama/step_0
    python -m distlab.infer --checkpoint ckpt/llama/step_0 --steps 16       # the config comes with it
    distlab run --nproc 4 -m distlab.train --resume ckpt/llama/step_0 --tp 2 --ring 2
    python -m distlab.model.convert --from ckpt/llama/step_0 --to-hf out/llama

``--from-hf`` reads ``config.json`` and the safetensors files (one, or shards with an index) of a Llama,
Qwen3 (dense), Mixtral or Qwen3-MoE model and writes a weights-only distlab checkpoint (``step_0``, no
optimizer state: AdamW starts afresh on resume), loadable at any layout. ``--to-hf`` writes the weights
back under transformers' names and a ``config.json`` of the matching model type, so
``AutoModelForCausalLM.from_pretrained`` reads it. Only ``safetensors`` is needed here; transformers never.

The weight layouts map without permutation: distlab's fused ``qkv`` is ``cat(q, k, v)`` of the projections,
``gate_up`` is ``cat(gate, up)``, RoPE is the same rotate-half form; an expert's ``w_gate`` / ``w_up`` /
``w_down`` are the transposes of transformers' per-expert ``w1`` / ``w3`` / ``w2`` (Mixtral) or
``gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen3-MoE), or slices of the fused ``gate_up_proj`` that
transformers 5 keeps in memory. A model using something distlab cannot express (biases, another activation,
shared experts, a RoPE type other than default / llama3, ...) is refused with a message naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from distlab.model import checkpoint
from distlab.model.config import ModelConfig

SUPPORTED = ("llama", "qwen3", "mixtral", "qwen3_moe")


def _refuse(feature: str, model_type: str):
    raise ValueError(f"this {model_type} model uses {feature}, which distlab cannot express; not converted")


def _rope(hf: dict, model_type: str) -> tuple[float, dict | None]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return float(theta), {"rope_type": "llama3", **{k: params[k] for k in keys}}
    _refuse(f"RoPE type {kind!r}", model_type)


def config_from_hf(hf: dict) -> ModelConfig:
    """The ``ModelConfig`` of a transformers ``config.json`` (a dict); ValueError naming what cannot be kept."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type {kind!r} is not one distlab converts ({', '.join(SUPPORTED)})")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(f"the activation {hf['hidden_act']!r} (distlab's MLP is SwiGLU)", kind)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            _refuse(flag.replace("_", " ") + "es", kind)
    if hf.get("sliding_window") and hf.get("use_sliding_window", kind == "mistral"):
        _refuse("a sliding window in the model itself", kind)
    theta, scaling = _rope(hf, kind)
    heads = hf["num_attention_heads"]
    moe = {}
    if kind == "mixtral":
        moe = {"moe_experts": hf["num_local_experts"], "moe_topk": hf["num_experts_per_tok"], "moe_renormalize": True}
        ffn = hf["intermediate_size"]
    elif kind == "qwen3_moe":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            _refuse("dense layers between the MoE ones (mlp_only_layers / decoder_sparse_step)", kind)
        moe = {"moe_experts": hf.get("num_experts", hf.get("num_local_experts")), "moe_topk": hf["num_experts_per_tok"],
               "moe_renormalize": bool(hf.get("norm_topk_prob", False))}
        ffn = hf["moe_intermediate_size"]
    else:
        ffn = hf["intermediate_size"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return ModelConfig(vocab=hf["vocab_size"], layers=hf["num_hidden_layers"], hidden=hf["hidden_size"], heads=heads,
                       kv_heads=hf.get("num_key_value_heads") or heads, ffn=ffn, rope_base=theta,
                       rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       head_dim=None if head_dim * heads == hf["hidden_size"] else head_dim,
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_scaling=scaling,
                       qk_norm=kind in ("qwen3", "qwen3_moe"), **moe)


def hf_config(cfg: ModelConfig) -> dict:
    """A transformers ``config.json`` (dict) for ``cfg``: llama / qwen3 dense, mixtral / qwen3_moe MoE."""
    if cfg.moe_score != "softmax" or cfg.moe_bias_rate:
        raise ValueError("a sigmoid router or aux-loss-free bias has no transformers model type here; not converted")
    if cfg.moe_experts:
        kind = "qwen3_moe" if cfg.qk_norm or not cfg.moe_renormalize else "mixtral"
        if kind == "mixtral" and not cfg.moe_renormalize:
            raise ValueError("Mixtral renormalises its top-k weights; this model does not")
    else:
        kind = "qwen3" if cfg.qk_norm else "llama"
    if kind == "qwen3_moe" and not cfg.qk_norm:
        raise ValueError("Qwen3-MoE normalises q and k per head (qk_norm); this model does not, and Mixtral "
                         "renormalises its top-k weights: no transformers model type fits")
    rope = {"rope_theta": cfg.rope_base, "rope_type": "default", **(cfg.rope_scaling or {})}
    out = {"architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                              "qwen3_moe": "Qwen3MoeForCausalLM"}[kind]], "model_type": kind,
           "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dims_per_head,
           "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
           "rope_parameters": rope, "rope_theta": cfg.rope_base, "attention_bias": False, "torch_dtype": "float32",
           "max_position_embeddings": 1 << 17}
    if kind == "mixtral":
        out.update(intermediate_size=cfg.ffn, num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_topk,
                   router_jitter_noise=0.0, sliding_window=None, output_router_logits=False)
    elif kind == "qwen3_moe":
        out.update(intermediate_size=cfg.ffn, moe_intermediate_size=cfg.ffn, num_experts=cfg.moe_experts,
                   num_experts_per_tok=cfg.moe_topk, norm_topk_prob=cfg.moe_renormalize, decoder_sparse_step=1,
                   mlp_only_layers=[], use_sliding_window=False, output_router_logits=False)
    else:
        out.update(intermediate_size=cfg.ffn, mlp_bias=False)
    if kind in ("qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None)
    return out


# ----------------------------------------------------------------------------------------- tensor names
def _expert_weights(hf: dict, prefix: str, e: int, kind: str):
    """(gate, up, down) of expert ``e`` in transformers' (out, in) orientation, from the per-expert names
    written to disk or the fused tensors transformers 5 keeps in memory."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in hf:
        gate, up = hf[fused][e].chunk(2, 0)
        return gate, up, hf[f"{prefix}.experts.down_proj"][e]
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    return tuple(hf[f"{prefix}.experts.{e}.{n}.weight"] for n in names)


def from_hf_state(hf: dict, cfg: ModelConfig, kind: str) -> dict:
    """distlab's one-device state dict (names and shapes of ``Llama(cfg)``) from transformers' tensors."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.layers):
        p, b = f"model.layers.{i}", f"blocks.{i}"
        att = f"{p}.self_attn"
        out[f"{b}.qkv.weight"] = torch.cat([hf[f"{att}.{n}_proj.weight"] for n in "qkv"], 0)
        out[f"{b}.o.weight"] = hf[f"{att}.o_proj.weight"]
        out[f"{b}.norm1.weight"] = hf[f"{p}.input_layernorm.weight"]
        out[f"{b}.norm2.weight"] = hf[f"{p}.post_attention_layernorm.weight"]
        if cfg.qk_norm:
            out[f"{b}.q_norm.weight"], out[f"{b}.k_norm.weight"] = hf[f"{att}.q_norm.weight"], hf[f"{att}.k_norm.weight"]
        if cfg.moe_experts:
            m = next(f"{p}.{name}" for name in ("mlp", "block_sparse_moe") if f"{p}.{name}.gate.weight" in hf)
            out[f"{b}.moe.router.weight"] = hf[f"{m}.gate.weight"]
            experts = [_expert_weights(hf, m, e, kind) for e in range(cfg.moe_experts)]
            out[f"{b}.moe.w_gate"] = torch.stack([g.t() for g, _, _ in experts])
            out[f"{b}.moe.w_up"] = torch.stack([u.t() for _, u, _ in experts])
            out[f"{b}.moe.w_down"] = torch.stack([d.t() for _, _, d in experts])
            out[f"{b}.moe.router.bias"] = torch.zeros(cfg.moe_experts)
            out[f"{b}.moe.router.logit_offset"] = torch.zeros(cfg.moe_experts)
        else:
            out[f"{b}.gate_up.weight"] = torch.cat([hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]], 0)
            out[f"{b}.down.weight"] = hf[f"{p}.mlp.down_proj.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state(state: dict, cfg: ModelConfig, kind: str) -> dict:
    """transformers' on-disk tensors (what ``save_pretrained`` writes) from distlab's one-device state dict."""
    d = cfg.dims_per_head
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    for i in range(cfg.layers):
        p, b = f"model.layers.{i}", f"blocks.{i}"
        q, k, v = state[f"{b}.qkv.weight"].split([cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d], 0)
        out.update({f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
                    f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": state[f"{b}.o.weight"],
                    f"{p}.input_layernorm.weight": state[f"{b}.norm1.weight"],
                    f"{p}.post_attention_layernorm.weight": state[f"{b}.norm2.weight"]})
        if cfg.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = state[f"{b}.q_norm.weight"]
            out[f"{p}.self_attn.k_norm.weight"] = state[f"{b}.k_norm.weight"]
        if cfg.moe_experts:
            m = f"{p}.block_sparse_moe" if kind == "mixtral" else f"{p}.mlp"
            names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            out[f"{m}.gate.weight"] = state[f"{b}.moe.router.weight"]
            for e in range(cfg.moe_experts):
                for name, w in zip(names, ("w_gate", "w_up", "w_down")):
                    out[f"{m}.experts.{e}.{name}.weight"] = state[f"{b}.moe.{w}"][e].t()
        else:
            gate, up = state[f"{b}.gate_up.weight"].chunk(2, 0)
            out.update({f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
                        f"{p}.mlp.down_proj.weight": state[f"{b}.down.weight"]})
    return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------------------------ folders
def _safetensors():
    return checkpoint._safetensors()


def read_hf(folder) -> tuple[dict, dict]:
    """(config dict, every tensor) of a transformers folder: ``model.safetensors`` or indexed shards."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"{folder!r} has no config.json: not a transformers model folder")
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{folder!r} has no model.safetensors (nor an index of shards); .bin pickles are not read")
    tensors = {}
    for name in files:
        tensors.update(_safetensors().load_file(os.path.join(folder, name)))
    return hf, tensors


def from_hf(folder, target) -> ModelConfig:
    """Convert a transformers folder into a weights-only distlab checkpoint at ``target``."""
    from distlab.model.llama import Llama

    hf, tensors = read_hf(folder)
    cfg = config_from_hf(hf)
    try:
        state = from_hf_state(tensors, cfg, hf["model_type"])
    except KeyError as e:
        raise ValueError(f"{folder!r}: the tensor {e.args[0]} that a {hf['model_type']} model of this config "
                         "needs is missing") from None
    want = Llama(cfg, device="meta").state_dict()
    checkpoint.check_tensor_names(folder, "the converted weights", state, checkpoint.saved_names(want, cfg))
    checkpoint.write_folder(target, 0, cfg, {k: v.float() for k, v in state.items()})
    return cfg


def to_hf(source, target, cfg: ModelConfig | None = None) -> str:
    """Write a distlab checkpoint as a transformers folder (float32); returns its model type."""
    cfg = cfg or checkpoint.saved_config(source)
    model = checkpoint.load_weights(source, cfg)
    hf = hf_config(cfg)
    state = {k: v for k, v in model.state_dict().items()}
    os.makedirs(target, exist_ok=True)
    _safetensors().save_file(to_hf_state(state, cfg, hf["model_type"]), os.path.join(target, "model.safetensors"),
                             metadata={"format": "pt"})
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    return hf["model_type"]


def main(argv=None):
    from distlab.bench import StudyParser

    p = StudyParser(prog="python -m distlab.model.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--from-hf", metavar="DIR", help="a transformers model folder (config.json + safetensors)")
    p.add_argument("--to", metavar="CKPT", help="the distlab checkpoint folder to write (e.g. ckpt/llama/step_0)")
    p.add_argument("--from", dest="source", metavar="CKPT", help="a distlab checkpoint folder")
    p.add_argument("--to-hf", metavar="DIR", help="the transformers folder to write")
    a = p.parse_args(argv)
    if bool(a.from_hf) == bool(a.source) or bool(a.from_hf) != bool(a.to) or bool(a.source) != bool(a.to_hf):
        raise ValueError("give --from-hf DIR --to CKPT, or --from CKPT --to-hf DIR")
    if a.from_hf:
        cfg = from_hf(a.from_hf, a.to)
        print(f"wrote {a.to}: {json.dumps(dataclasses.asdict(cfg))}")
    else:
        kind = to_hf(a.source, a.to_hf)
        print(f"wrote {a.to_hf} ({kind})")


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
