"""The Llama block on one device, and the same block tensor-parallel (with or without SP).

    distlab run --nproc 4 -m distlab.tp --hidden 256 --ffn 512 --heads 8 --kv-heads 4 --seq 256 --sp --check

    x ─ RMSNorm ─ QKV (column) ─ RoPE ─ attention (causal, GQA) ─ O (row) ─ + ─ RMSNorm ─ gate/up (column)
      └──────────────────────────────────────────────────────────────────┘   ─ SiLU(gate)·up ─ down (row) ─ +

Tensor parallel: each rank keeps H/tp q heads (and their kv heads) of the fused QKV projection, the matching
columns of O, and F/tp of the gate/up and down projections; one all-reduce after O and one after down
(forward), one after each column layer's input grad (backward). With ``sequence_parallel`` the residual
stream and the norms are sharded along the sequence; the all-reduces become an all-gather before each
column layer and a reduce-scatter after each row layer; ``async_tp`` runs those as ring steps overlapped
with chunked GEMMs (``distlab.tp.async_tp``).

GQA with fewer kv heads than TP ranks: each rank needs one kv head, so kv head j is replicated on the
tp/kv ranks that hold its q heads. Those copies are one parameter: ``sync_replicated_kv_grads()`` sums
their gradients over the TP group (an all-reduce of a zero-padded tensor), which a training step calls
before the optimizer, as it does for data-parallel gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distlab import comm
from distlab.tp.linear import ColumnParallelLinear, RowParallelLinear, shard_rows
from distlab.tp.norm import RMSNorm, rms_norm
from distlab.kernels.attention import attention
from distlab.kernels.masks import document_mask


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling) -> None:
    """None, or Llama 3.1's ``{"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}``; anything else is a ValueError naming it."""
    if scaling is None:
        return
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope_scaling: distlab knows rope_type 'llama3' (Llama 3.1) only; got {scaling!r}")
    missing = [k for k in ROPE_SCALING_KEYS if k not in scaling]
    if missing or not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling llama3 needs {', '.join(ROPE_SCALING_KEYS)} with high_freq_factor > "
                         f"low_freq_factor; got {scaling!r}")


def rope_frequencies(d, base=10000.0, scaling=None, device=None, dtype=torch.float32):
    """The d/2 inverse frequencies ``base^(-2i/d)``; with Llama 3.1 scaling, wavelengths longer than
    ``original / low_freq_factor`` slowed by ``factor``, shorter than ``original / high_freq_factor`` kept,
    and those between blended linearly in ``original / wavelength``."""
    inv = base ** (-torch.arange(0, d, 2, device=device, dtype=dtype) / d)
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    blend = (original / wavelength - low) / (high - low)           # 0 at the long end, 1 at the short end
    slowed = torch.where(wavelength > original / low, inv / factor, inv)
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, (1 - blend) * inv / factor + blend * inv, slowed)


def rope(x, base=10000.0, offset=0, positions=None, scaling=None):
    """Rotary position embedding (rotate-half form) on ``(batch, seq, heads, head_dim)``, computed in float32
    (float64 for float64 inputs). ``positions`` (seq,) gives each token's position (a CP shard's tokens are
    not 0..s-1), or (batch, seq) one per row (packed documents: positions restart in each document); by
    default ``offset + arange(seq)``. ``scaling``: Llama 3.1's (``rope_frequencies``)."""
    b, s, h, d = x.shape
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = rope_frequencies(d, base, scaling, x.device, ct)
    pos = torch.arange(offset, offset + s, device=x.device) if positions is None else positions.to(x.device)
    ang = pos.to(ct)[..., None] * inv                                  # (s, d/2) or (b, s, d/2)
    ang = ang if ang.dim() == 3 else ang[None]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x1, x2 = x.to(ct)[..., : d // 2], x.to(ct)[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class _Residual:
    """What both blocks share: the MLP (SwiGLU, or the MoE put in its place) and the two residual branches."""

    def mlp(self, x):
        if self.moe is not None:
            return self.moe(x)
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)

    def positioned(self, q, k, positions, norm_weight=lambda n: n.weight):
        """q, k (b, s, heads, d) after the per-head RMSNorm (``qk_norm``) and RoPE."""
        if self.q_norm is not None:
            q = rms_norm(q, norm_weight(self.q_norm), self.q_norm.eps)
            k = rms_norm(k, norm_weight(self.k_norm), self.k_norm.eps)
        return (rope(q, self.rope_base, positions=positions, scaling=self.rope_scaling),
                rope(k, self.rope_base, positions=positions, scaling=self.rope_scaling))

    def attn(self, x, positions=None, docs=None, cache=None):
        """The attention branch on the normed ``x``: projections, RoPE, the attention child, the output
        projection (split so activation checkpointing can leave the attention core out of a recompute)."""
        q, k, v = self.project_qkv(x, positions)
        return self.project_out(self.attend(q, k, v, docs, cache))

    def project_out(self, a):
        return self.o(a.reshape(*a.shape[:2], -1))

    def attend(self, q, k, v, docs=None, cache=None):
        """The attention child module on (q, k, v) after RoPE: row by row for packed ``docs``; through
        ``cache.attend(q, k, v, attention)`` when a KV cache takes part (``distlab.infer``)."""
        if cache is not None:   # a prefill of packed prompts attends inside each of them
            return cache.attend(q, k, v, lambda q, k, v: packed_attention(self.attention, q, k, v, docs))
        return packed_attention(self.attention, q, k, v, docs)

    def forward(self, x, positions=None, docs=None, cache=None):
        """``positions``: RoPE positions, (seq,) or (batch, seq); ``docs``: packed documents, one cu_seqlens
        per batch row (attention stays inside each document); ``cache``: this block's KV cache (decode)."""
        h = x + self.attn(self.norm1(x), positions, docs, cache)
        return h + self.mlp(self.norm2(h))


def packed_attention(attend, q, k, v, docs):
    """``attend(q, k, v, cu_seqlens)`` row by row (each row packs its own documents), or on the whole batch."""
    if docs is None:
        return attend(q, k, v, None)
    return torch.cat([attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], cu) for i, cu in enumerate(docs)])


def local_attention(q, k, v, cu_seqlens=None):
    """Causal attention on one device, inside documents when ``cu_seqlens`` is given."""
    if cu_seqlens is None:
        return attention(q, k, v, causal=True)
    pos = torch.arange(q.shape[1])
    return attention(q, k, v, mask=document_mask(pos, pos, cu_seqlens, True, None, q.shape[1]).to(q.device))


class LocalAttention(torch.nn.Module):
    """``local_attention`` as a block's attention child (no parameters): the one-device and TP-only case;
    context parallelism puts ``distlab.model.parallel.ContextAttention`` in its place at construction."""

    def forward(self, q, k, v, cu_seqlens=None):
        return local_attention(q, k, v, cu_seqlens)


class LlamaBlock(_Residual, torch.nn.Module):
    """The one-device reference block (full weights, plain ``nn.Linear``)."""

    def __init__(self, hidden, ffn, heads, kv_heads, rope_base=10000.0, eps=1e-6, device=None, dtype=None,
                 moe=None, head_dim=None, rope_scaling=None, qk_norm=False):
        """``moe``: a module mapping (batch, seq, hidden) to the same shape (``distlab.moe.MoEReference`` or the
        expert-parallel ``distlab.moe.MoE``) used in place of the SwiGLU MLP. ``head_dim``: default hidden /
        heads; ``rope_scaling``: Llama 3.1's (``rope_frequencies``); ``qk_norm``: RMSNorm of q and k per head
        before RoPE (Qwen3)."""
        super().__init__()
        if (head_dim is None and hidden % heads) or heads % kv_heads:
            raise ValueError(f"hidden {hidden} must split into {heads} heads, and heads into {kv_heads} kv heads")
        check_rope_scaling(rope_scaling)
        self.hidden, self.ffn, self.heads, self.kv_heads = hidden, ffn, heads, kv_heads
        self.head_dim, self.rope_base, self.rope_scaling = head_dim or hidden // heads, rope_base, rope_scaling
        kw = {"device": device, "dtype": dtype}
        self.norm1, self.norm2 = RMSNorm(hidden, eps, **kw), RMSNorm(hidden, eps, **kw)
        self.q_norm = RMSNorm(self.head_dim, eps, **kw) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, **kw) if qk_norm else None
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False, **kw)
        self.o = torch.nn.Linear(heads * self.head_dim, hidden, bias=False, **kw)
        self.attention = LocalAttention()
        self.moe = moe   # in place of the SwiGLU MLP, which is then not built
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False, **kw) if moe is None else None
        self.down = torch.nn.Linear(ffn, hidden, bias=False, **kw) if moe is None else None

    def project_qkv(self, x, positions=None):
        """(q, k, v) as (b, s, heads, d), q and k after RoPE."""
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, k = self.positioned(q.view(b, s, -1, d), k.view(b, s, -1, d), positions)
        return q, k, v.view(b, s, -1, d)



class TPLlamaBlock(_Residual, torch.nn.Module):
    """The block sharded over ``group`` (built from a ``LlamaBlock`` so both hold the same numbers)."""

    def __init__(self, ref: LlamaBlock, group=None, sequence_parallel=False, async_tp=False, ep_group=None,
                 attention=None):
        """``ep_group``: with a MoE reference block, its experts are sharded over this expert-parallel group.
        Under TP the EP group must span the TP ranks too: each TP rank routes a distinct share of the tokens
        (its sequence shard under SP; else a 1/tp slice of the replicated tokens, gathered back after).
        ``attention``: the attention child, ``fn(q, k, v, cu_seqlens)`` as a module (default ``LocalAttention``;
        context parallelism gives ``ContextAttention``)."""
        super().__init__()
        tp = comm.group_size(group)
        self.group, self.tp, self.sp = group, tp, sequence_parallel
        heads, kv, d = ref.heads, ref.kv_heads, ref.head_dim
        if heads % tp:
            raise ValueError(f"q heads ({heads}) are not divisible by the tensor-parallel size {tp}")
        if ref.moe is None and ref.ffn % tp:
            raise ValueError(f"ffn ({ref.ffn}) is not divisible by the tensor-parallel size {tp}")
        if kv % tp and tp % kv:
            raise ValueError(f"kv heads ({kv}) and the tensor-parallel size {tp}: one must divide the other")
        self.kv_copies = max(1, tp // kv)                 # ranks sharing one kv head
        self.attention = attention if attention is not None else LocalAttention()
        self.local_heads, self.local_kv = heads // tp, max(1, kv // tp)
        self.head_dim, self.rope_base, self.rope_scaling = d, ref.rope_base, ref.rope_scaling
        self.norm1 = RMSNorm.from_norm(ref.norm1, group, sequence_parallel)
        self.norm2 = RMSNorm.from_norm(ref.norm2, group, sequence_parallel)
        # q/k norms: replicated, applied to this rank's heads: their gradients are summed over tp (copy_to_group)
        self.q_norm = RMSNorm.from_norm(ref.q_norm) if ref.q_norm is not None else None
        self.k_norm = RMSNorm.from_norm(ref.k_norm) if ref.k_norm is not None else None
        # fused QKV, kv heads replicated first when fewer than tp: segments q | k | v split per rank
        wq, wk, wv = ref.qkv.weight.split([heads * d, kv * d, kv * d], 0)
        if self.kv_copies > 1:
            wk = wk.view(kv, d, -1).repeat_interleave(self.kv_copies, 0).reshape(-1, wk.shape[1])
            wv = wv.view(kv, d, -1).repeat_interleave(self.kv_copies, 0).reshape(-1, wv.shape[1])
        full = torch.nn.Linear(ref.hidden, wq.shape[0] + wk.shape[0] + wv.shape[0], bias=False,
                               device=wq.device, dtype=wq.dtype)
        with torch.no_grad():
            full.weight.copy_(torch.cat([wq, wk, wv], 0))
        sp, at = sequence_parallel, async_tp
        self.qkv = ColumnParallelLinear.from_linear(full, group, sequence_parallel=sp, async_tp=at,
                                                    segments=[wq.shape[0], wk.shape[0], wv.shape[0]])
        self.o = RowParallelLinear.from_linear(ref.o, group, sequence_parallel=sp, async_tp=at)
        self.gate_up = self.down = self.moe = None
        if ref.moe is None:
            self.gate_up = ColumnParallelLinear.from_linear(ref.gate_up, group, sequence_parallel=sp, async_tp=at,
                                                            segments=[ref.ffn, ref.ffn])
            self.down = RowParallelLinear.from_linear(ref.down, group, sequence_parallel=sp, async_tp=at)
        if ref.moe is not None:
            from distlab.moe.layer import MoE

            self.moe = MoE.from_reference(ref.moe, ep_group)

    def mlp(self, x):
        if self.moe is None or self.tp == 1 or self.sp:
            return super().mlp(x)
        # tokens replicated over tp: each rank routes a 1/tp slice (its gradient all-gathered backward), and
        # the outputs are gathered back (backward keeps this rank's slice: the rest is replicated compute).
        # Zero rows pad the tokens to a multiple of tp (one decoded token, say); their outputs are dropped,
        # so they add nothing to any gradient.
        b, s, h = x.shape
        pad = -(b * s) % self.tp
        rows = F.pad(x.reshape(b * s, h), (0, 0, 0, pad))
        mine = comm.split_to_group(rows, self.group, 0)
        return comm.gather_from_group(super().mlp(mine), self.group, 0)[:b * s].view(b, s, h)

    def project_qkv(self, x, positions=None):
        """This rank's (q, k, v) heads as (b, s, heads, d) over the full sequence, q and k after RoPE."""
        y = self.qkv(x)                                   # (b, s, local q + 2 local kv heads)·d, full sequence
        b, s, _ = y.shape
        d = self.head_dim
        q, k, v = y.split([self.local_heads * d, self.local_kv * d, self.local_kv * d], -1)
        q, k = self.positioned(q.view(b, s, -1, d), k.view(b, s, -1, d), positions,
                               lambda n: comm.copy_to_group(n.weight, self.group))
        return q, k, v.view(b, s, -1, d)


    def sync_replicated_kv_grads(self):
        """Sum the gradients of kv-head copies over the ranks sharing them (no-op when kv ≥ tp)."""
        if self.kv_copies == 1 or self.qkv.weight.grad is None:
            return
        hq = self.local_heads * self.head_dim
        grad = self.qkv.weight.grad
        kv_rows = grad[hq:]                              # this rank's k and v rows (one kv head each)
        kv_heads = self.tp // self.kv_copies
        mine = comm.group_rank(self.group) // self.kv_copies
        padded = torch.zeros(kv_heads, *kv_rows.shape, dtype=grad.dtype, device=grad.device)
        padded[mine] = kv_rows
        summed = comm.all_reduce_raw(padded, self.group)
        grad[hq:] = summed[mine]

    def sync_router_grads(self):
        """Under TP each rank routed its own share of the tokens: sum the router's gradient over tp."""
        if self.moe is not None and self.tp > 1 and self.moe.router.weight.grad is not None:
            self.moe.router.weight.grad.copy_(comm.all_reduce_raw(self.moe.router.weight.grad, self.group))

    def full_grads(self):
        """Gather every weight's gradient into the one-device layout (for parity checks): a dict by name."""
        return self.full_tensors(lambda p: p.grad)

    def full_tensors(self, get):
        """``get(param)`` (a weight, its gradient, an optimizer state) of every weight, gathered into the
        one-device layout: a dict by layer name (qkv, o, gate_up, down, norm1, norm2)."""
        heads_q = self.local_heads * self.head_dim
        g = get(self.qkv.weight)
        gq = comm.all_gather_raw(g[:heads_q], self.group, 0)
        gk = comm.all_gather_raw(g[heads_q:heads_q + self.local_kv * self.head_dim], self.group, 0)
        gv = comm.all_gather_raw(g[heads_q + self.local_kv * self.head_dim:], self.group, 0)
        if self.kv_copies > 1:  # the copies are equal (grads after sync_replicated_kv_grads): keep one per head
            gk, gv = (t.view(-1, self.kv_copies, self.head_dim, t.shape[-1])[:, 0].reshape(-1, t.shape[-1])
                      for t in (gk, gv))
        mlp = {}
        if self.gate_up is not None:
            gate, up = get(self.gate_up.weight).chunk(2, 0)
            mlp = {"gate_up": torch.cat([comm.all_gather_raw(gate, self.group, 0), comm.all_gather_raw(up, self.group, 0)], 0),
                   "down": comm.all_gather_raw(get(self.down.weight), self.group, 1)}
        return {"qkv": torch.cat([gq, gk, gv], 0),
                "o": comm.all_gather_raw(get(self.o.weight), self.group, 1), **mlp,
                "norm1": get(self.norm1.weight), "norm2": get(self.norm2.weight),
                **({"q_norm": get(self.q_norm.weight), "k_norm": get(self.k_norm.weight)} if self.q_norm else {})}


__all__ = ["LlamaBlock", "LocalAttention", "TPLlamaBlock", "rope", "shard_rows"]
