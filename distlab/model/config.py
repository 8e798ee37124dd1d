"""Model and run configuration: a dataclass, and named presets in ``configs/NAME.json``.

    python -m distlab.train --config tiny              # configs/tiny.json
    python -m distlab.train --config path/to/run.json
    python -m distlab.train --config ckpt/llama/step_0       # a checkpoint folder: the model it holds
"""

from __future__ import annotations

import dataclasses
import json
import os

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


@dataclasses.dataclass
class ModelConfig:
    vocab: int = 256               # byte-level tokens
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 192
    rope_base: float = 10000.0     # transformers' rope_theta
    moe_experts: int = 0           # 0: dense SwiGLU MLPs; else MoE in every layer
    moe_topk: int = 2
    # the fields below came with Hugging Face checkpoints (#25); each default is the behaviour before it
    rms_norm_eps: float = 1e-6     # Llama 2 / 3 use 1e-5
    head_dim: int | None = None    # None: hidden // heads (Qwen3 sets it apart)
    tie_embeddings: bool = False   # the LM head is the embedding matrix
    rope_scaling: dict | None = None   # Llama 3.1: {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    qk_norm: bool = False          # RMSNorm of q and k per head before RoPE (Qwen3)
    moe_score: str = "softmax"     # the router's score: softmax, or sigmoid (DeepSeek-V3)
    moe_renormalize: bool = True   # top-k weights renormalised to 1 (Mixtral, Qwen3 norm_topk_prob); not: OLMoE
    moe_bias_rate: float = 0.0     # aux-loss-free balancing: the router bias's step per update

    @property
    def dims_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def __post_init__(self):
        if (self.head_dim is None and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads (or give head_dim), and the "
                             f"heads into {self.kv_heads} kv heads")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"head_dim must be >= 1; got {self.head_dim}")
        if self.moe_experts and not 1 <= self.moe_topk <= self.moe_experts:
            raise ValueError(f"moe_topk {self.moe_topk} must be between 1 and moe_experts {self.moe_experts}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0; got {self.rms_norm_eps}")
        if self.moe_score not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_score must be softmax or sigmoid; got {self.moe_score!r}")
        from distlab.tp.block import check_rope_scaling

        check_rope_scaling(self.rope_scaling)


@dataclasses.dataclass
class TrainConfig:
    seq: int = 128
    batch: int = 8                 # sequences per step, over all data-parallel ranks
    steps: int = 200
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup: int = 10
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 0      # 0: only at the end when --checkpoint-dir is given
    label_smoothing: float = 0.0   # as F.cross_entropy's: (1 - e)·NLL + e·mean over the vocabulary of -log p


LAYOUT_KEYS = ("tp", "sp", "ring", "ulysses", "cp_layout")


def _read(name_or_path: str) -> dict:
    if os.path.isdir(name_or_path) and os.path.isfile(os.path.join(name_or_path, "distlab.json")):
        with open(os.path.join(name_or_path, "distlab.json")) as f:   # a checkpoint: the model it holds
            return {"model": json.load(f).get("model", {})}
    path = name_or_path if os.path.exists(name_or_path) else os.path.join(CONFIG_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json")) if os.path.isdir(CONFIG_DIR) else []
        raise ValueError(f"no config {name_or_path!r} (presets: {', '.join(known) or 'none'})")
    with open(path) as f:
        return json.load(f)


def load_layout(name_or_path: str) -> dict:
    """The preset's "layout" section (tp, sp, ring, ulysses, cp_layout); data parallelism takes the rest."""
    layout = _read(name_or_path).get("layout", {})
    unknown = set(layout) - set(LAYOUT_KEYS)
    if unknown:
        raise ValueError(f"unknown layout keys {sorted(unknown)}; use {', '.join(LAYOUT_KEYS)}")
    return layout


def load_config(name_or_path: str) -> tuple[ModelConfig, TrainConfig]:
    """A preset name (``configs/NAME.json``) or a JSON path with "model" and "train" sections."""
    raw = _read(name_or_path)
    return ModelConfig(**raw.get("model", {})), TrainConfig(**raw.get("train", {}))
