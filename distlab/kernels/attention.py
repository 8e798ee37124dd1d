"""Attention forward/backward that return and consume the log-sum-exp (LSE).

    python -m distlab.kernels.bench --seq 8192 --heads 32 --head-dim 128 --causal   # GPU benchmark of the backends

Context-parallel attention computes attention block by block and merges the partial results through the
LSE, so every backend here returns ``(out, lse)`` and its backward takes the *final* ``out`` and ``lse``
(the merged ones, not the block's own): with the global LSE, a block's probabilities
``P = exp(q k^T * scale - lse)`` are already normalised over every block, and the block's gradients add up
to the gradient of the whole attention.

Layout: ``q`` is ``(batch, seq_q, heads, head_dim)``, ``k``/``v`` are ``(batch, seq_k, kv_heads, head_dim)``
with ``kv_heads`` dividing ``heads`` (GQA: query head ``h`` reads kv head ``h // (heads // kv_heads)``).
``lse`` is float32 ``(batch, heads, seq_q)`` (float64 for float64 inputs). ``causal=True`` needs
``seq_q == seq_k`` and lets query ``i`` see keys ``j <= i``.

Backends (``backend=``):

- ``torch``: plain PyTorch, any device and dtype; computes in float32 (float64 for float64 inputs) and
  never holds more than one block of query rows' scores (``block_bytes``).
- ``sdpa-cudnn``, ``sdpa-flash``, ``sdpa-efficient``: PyTorch's LSE-returning SDPA ops and their backward
  ops (CUDA only; cuDNN and flash take fp16/bf16, efficient fp32 — see ``_SDPA_DTYPES``).
- ``triton``: distlab's own FA2-style kernel (``distlab.kernels.triton_attention``): fp16/bf16 on CUDA (fp32/fp16 on
  CPU under ``TRITON_INTERPRET=1``, the tests' path), head_dim a power of two; it can also accumulate into a running
  (out, LSE), which the ring uses to skip its merge launches. Never picked by ``auto`` for dense attention.
- ``fa4``: FlashAttention-4 (``distlab.kernels.fa4``, the ``fa4`` extra): fp16/bf16 on sm90+ GPUs; with a mask,
  FA4's variable-length path where the mask is FA4 sequences (``distlab.kernels.fa4_varlen``), else the masked
  Triton kernel.
- ``auto``: the fastest present for the tensors given: FA4 when importable on sm90+, else cuDNN for
  fp16/bf16 on CUDA, then flash; efficient for fp32 on CUDA; ``torch`` on CPU and for float64; the masked
  Triton kernel for packed documents and windows on CUDA, FA4's varlen path there when importable
  (``masked_auto``; a packed ring in the balanced layout keeps the Triton kernel, ``distlab.cp.ring``).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from distlab.kernels.launch import triton_runs_on

BACKENDS = ("auto", "torch", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "triton", "fa4")
MASK_BACKENDS = ("torch", "triton", "fa4")   # backends that take a KeyMask (documents, windows); SDPA's ops cannot
_SDPA_DTYPES = {
    "sdpa-cudnn": (torch.float16, torch.bfloat16),
    "sdpa-flash": (torch.float16, torch.bfloat16),
    # fp32 only: in fp16/bf16 its backward, given the merged out/LSE of a key block with seq_q != seq_k,
    # returned dq of 1e31/NaN on the H200 (torch 2.11); cuDNN and flash are faster there anyway
    "sdpa-efficient": (torch.float32,),
}


# ---------------------------------------------------------------------------------------------------------
# validation and backend choice
# ---------------------------------------------------------------------------------------------------------
def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise ValueError with a clear message unless q, k, v are a valid (bshd, GQA) attention input. What
    passed is remembered by shapes, dtypes and devices (the checks cost ~8 µs of host time a call, #24)."""
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal)
    except AttributeError:   # not tensors: the checks below say so
        key = None
    if key is not None and key in _CHECKED:
        return
    _check_qkv(q, k, v, causal)
    if key is not None:
        if len(_CHECKED) >= 4096:
            _CHECKED.clear()
        _CHECKED.add(key)


_CHECKED: set = set()


def _check_qkv(q, k, v, causal) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim); got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point; got {t.dtype}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (a shape without data); attention needs real tensors")
        if 0 in (t.shape[0], t.shape[2], t.shape[3]):
            raise ValueError(f"{name} {tuple(t.shape)} is empty: batch, heads and head_dim must be >= 1")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs seq_q == seq_k; got {q.shape[1]} and {k.shape[1]}")


def check_mask(mask, q, k, causal) -> None:
    if mask is None:
        return
    if causal:
        raise ValueError("give causal=False with a mask: the KeyMask already holds causality")
    if mask.q_lo.shape != (q.shape[1],) or mask.q_hi.shape != (q.shape[1],) or mask.k_pos.shape != (k.shape[1],):
        raise ValueError(f"mask: q_lo/q_hi need ({q.shape[1]},) and k_pos ({k.shape[1]},); got "
                         f"{tuple(mask.q_lo.shape)}, {tuple(mask.q_hi.shape)}, {tuple(mask.k_pos.shape)}")


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Backends that can run on this device and dtype, fastest first (``torch`` always last). Cached per
    (device, dtype, TRITON_INTERPRET): the device queries behind it cost host time on every call."""
    return list(_available(torch.device(device), dtype, os.environ.get("TRITON_INTERPRET")))


@functools.lru_cache(maxsize=64)
def _available(device: torch.device, dtype: torch.dtype, _interpret) -> tuple[str, ...]:
    from distlab.kernels import fa4

    names = ["fa4"] if fa4.runs_on(device, dtype) else []   # FlashAttention-4: the fastest on sm90+
    if device.type == "cuda":
        for name in ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient"):
            if dtype in _SDPA_DTYPES[name] and _sdpa_op_present(name):
                names.append(name)
    if triton_runs_on(device) and (dtype in (torch.float16, torch.bfloat16) or
                                   (dtype == torch.float32 and device.type != "cuda")):
        names.append("triton")
    return tuple(names + ["torch"])


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype, masked: bool = False) -> str:
    """Map ``auto`` to a concrete backend, and refuse one that cannot run here with a clear message.
    ``masked``: the attention has documents or a window (a ``KeyMask``), which only ``MASK_BACKENDS`` take."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return _resolve(backend, torch.device(device), dtype, masked, os.environ.get("TRITON_INTERPRET"))


def masked_auto(present, device_type: str) -> str:
    """``auto`` under a mask: FA4's variable-length path where importable (H200, a 64k pack of lognormal
    documents: 2.64 / 9.99 ms fwd / fwd+bwd against the masked Triton kernel's 6.21 / 32.92, docs/PERF.md;
    masks FA4 cannot express run on the masked Triton kernel), else the masked Triton kernel on CUDA (it
    skips what the mask removes), else the first present (torch's loop, the reference)."""
    if "fa4" in present:
        return "fa4"
    if "triton" in present and device_type == "cuda":
        return "triton"
    return next(n for n in present if n != "triton")


@functools.lru_cache(maxsize=256)
def _resolve(backend, device, dtype, masked, _interpret) -> str:
    present = available_backends(device, dtype)
    if masked:
        present = [n for n in present if n in MASK_BACKENDS]
        if backend not in ("auto", *MASK_BACKENDS):
            raise ValueError(f"attention backend {backend!r} cannot express packed documents or windows; "
                             f"backends that can: {', '.join(MASK_BACKENDS)} (or auto)")
    if backend == "auto":
        return masked_auto(present, torch.device(device).type) if masked else next(n for n in present if n != "triton")
    if backend not in present:
        if backend == "fa4":
            from distlab.kernels import fa4

            raise ValueError(f"attention backend 'fa4' (FlashAttention-4) cannot run here: "
                             f"{fa4.why_not(device, dtype)}; present here: {', '.join(present)}")
        raise ValueError(f"attention backend {backend!r} cannot run {dtype} on {torch.device(device).type}; "
                         f"present here: {', '.join(present)}")
    return backend


def _sdpa_op_present(name: str) -> bool:
    op = {"sdpa-cudnn": "_scaled_dot_product_cudnn_attention", "sdpa-flash": "_scaled_dot_product_flash_attention",
          "sdpa-efficient": "_scaled_dot_product_efficient_attention"}[name]
    if not hasattr(torch.ops.aten, op):
        return False
    if name == "sdpa-cudnn":
        return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if name == "sdpa-flash":
        return torch.cuda.get_device_capability() >= (8, 0)
    return True


# ---------------------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------------------
def attention_forward(q, k, v, causal=False, softmax_scale=None, backend="auto", mask=None, into=None, keep=None):
    """Return ``(out, lse)``: ``out`` like ``q`` in q's dtype, ``lse`` float32 ``(batch, heads, seq_q)``.

    ``mask``: a ``distlab.kernels.masks.KeyMask`` (documents, windows, a ring block's positions) instead of
    ``causal``; a row that sees no key gets out 0 and LSE -inf. Backends that take one: ``MASK_BACKENDS``.
    ``into``: ``(out, lse)``, tensors of the results' shapes (views, say; None for one allocated) that the
    results are written into and returned as: FA4's varlen path writes there itself, the others copy
    (all-gather CP's kv-head groups land in the whole heads' tensors).
    ``keep``: a dict the backend may fill with what its backward would otherwise make again (FA4's varlen
    path: its copies of keys that several sequences share); give it to ``attention_backward(kept=...)`` of
    the same q, k, v and mask."""
    check_qkv(q, k, v, causal)
    check_mask(mask, q, k, causal)
    backend = resolve_backend(backend, q.device, q.dtype, masked=mask is not None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if into is None:
        return _forward(q, k, v, causal, scale, backend, mask, (None, None), keep)
    _check_into(into, ((q.shape, q.dtype), ((q.shape[0], q.shape[2], q.shape[1]), None)))
    return _written(into, _forward(q, k, v, causal, scale, backend, mask, into, keep))


def _forward(q, k, v, causal, scale, backend, mask, into, keep=None):
    """The backend's ``(out, lse)`` of checked arguments; FA4's varlen path writes them into ``into`` itself."""
    if backend == "torch":
        return _torch_forward(q, k, v, causal, scale, mask)
    if backend == "triton":
        if mask is not None:
            from distlab.kernels.triton_masked_attention import masked_forward

            return masked_forward(q, k, v, mask, scale)
        from distlab.kernels.triton_attention import flash_forward

        return flash_forward(q, k, v, causal, scale)
    if backend == "fa4":
        from distlab.kernels.fa4 import fa4_forward, fa4_masked_forward

        if mask is None:
            return fa4_forward(q, k, v, causal, scale)
        spec = _fa4_varlen(q, mask)
        if spec is not None:
            return fa4_masked_forward(q, k, v, spec, scale, into=into, keep=keep)
        return attention_forward(q, k, v, False, scale, _fa4_mask_fallback(q), mask)
    return _sdpa_forward(backend, q, k, v, causal, scale)


def attention_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=None, backend="auto", mask=None,
                       into=None, kept=None):
    """Return ``(dq, dk, dv)`` in the inputs' dtype, given the final ``out`` and ``lse`` (see module doc);
    ``into``: ``(dq, dk, dv)`` to write them into, as ``attention_forward``'s; ``kept``: the dict
    ``attention_forward(keep=...)`` filled for the same q, k, v and mask (or None)."""
    check_qkv(q, k, v, causal)
    check_mask(mask, q, k, causal)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if lse.shape != (q.shape[0], q.shape[2], q.shape[1]):
        raise ValueError(f"lse must be (batch, heads, seq_q) = {(q.shape[0], q.shape[2], q.shape[1])}; "
                         f"got {tuple(lse.shape)}")
    backend = resolve_backend(backend, q.device, q.dtype, masked=mask is not None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if into is None:
        return _backward(dout, q, k, v, out, lse, causal, scale, backend, mask, (None, None, None), kept)
    _check_into(into, ((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)))
    return _written(into, _backward(dout, q, k, v, out, lse, causal, scale, backend, mask, into, kept))


def _backward(dout, q, k, v, out, lse, causal, scale, backend, mask, into, kept=None):
    """The backend's ``(dq, dk, dv)`` of checked arguments; FA4's varlen path writes them into ``into`` itself."""
    if backend == "torch":
        return _torch_backward(dout, q, k, v, out, lse, causal, scale, mask)
    if backend == "triton":
        if mask is not None:
            from distlab.kernels.triton_masked_attention import masked_backward

            return masked_backward(dout, q, k, v, out, lse, mask, scale)
        from distlab.kernels.triton_attention_backward import flash_backward

        return flash_backward(dout, q, k, v, out, lse, causal, scale)
    if backend == "fa4":
        from distlab.kernels.fa4 import fa4_backward, fa4_masked_backward

        if mask is None:
            return fa4_backward(dout, q, k, v, out, lse, causal, scale)
        spec = _fa4_varlen(q, mask)
        if spec is not None:
            return fa4_masked_backward(dout, q, k, v, out, lse, spec, scale, into=into, kept=kept)
        return attention_backward(dout, q, k, v, out, lse, False, scale, _fa4_mask_fallback(q), mask)
    return _sdpa_backward(backend, dout, q, k, v, out, lse, causal, scale)


def _check_into(into, wanted):
    if len(into) != len(wanted):
        raise ValueError(f"into must hold {len(wanted)} tensors (or None); got {len(into)}")
    for t, (shape, dtype) in zip(into, wanted):
        if t is not None and (tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype)):
            raise ValueError(f"into: a tensor {tuple(t.shape)} {t.dtype} where the result is {tuple(shape)}"
                             + (f" {dtype}" if dtype is not None else ""))


def _written(into, results):
    """``results``, each copied into its ``into`` tensor where one is given and the kernel did not write there."""
    return tuple(r if t is None or r is t else t.copy_(r) for t, r in zip(into, results))


def _fa4_varlen(q, mask):
    """FA4's sequences for ``mask`` (``distlab.kernels.fa4_varlen``), or None: a batch of more than one pack, or a
    mask that is not exactly FA4 sequences (a window cutting across a ring block, say)."""
    from distlab.kernels.fa4_varlen import varlen_spec

    return varlen_spec(mask) if q.shape[0] == 1 else None


def _fa4_mask_fallback(q) -> str:
    """Where ``fa4`` sends a mask FA4's sequences cannot express: the masked Triton kernel, else the reference."""
    return "triton" if "triton" in available_backends(q.device, q.dtype) else "torch"


def attention_reference(q, k, v, causal=False, softmax_scale=None, mask=None):
    """Whole-matrix attention through autograd, in the inputs' dtype: the one-device ground truth for tests.
    With a ``mask``, a row that sees no key gives 0 (as every backend)."""
    check_qkv(q, k, v, causal)
    check_mask(mask, q, k, causal)
    groups = q.shape[2] // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kh = k.repeat_interleave(groups, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(groups, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ kh.transpose(-1, -2) * scale
    if causal:
        n = q.shape[1]
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if mask is not None:
        seen = mask.dense()
        scores = scores.masked_fill(~seen, float("-inf"))
        probs = torch.where(seen.any(-1, keepdim=True), scores.softmax(-1), torch.zeros_like(scores))
        return (probs @ vh).transpose(1, 2)
    return (scores.softmax(-1) @ vh).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------
# plain-PyTorch backend: query blocks against all (visible) keys, GQA without copying K/V
# ---------------------------------------------------------------------------------------------------------
block_bytes = 2 * 2**20  # score memory of one query block (cache-sized: ~3x faster on CPU than 32 MiB)


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_block(q, k) -> int:
    b, sq, h, _ = q.shape
    rows = block_bytes // max(1, b * h * k.shape[1] * 4)
    return int(max(16, min(sq, rows)))


def _grouped(q, kv_heads, ct):
    """(b, s, h, d) -> (b, kv_heads, groups*s, d) in compute dtype, rows ordered (group, position)."""
    b, s, h, d = q.shape
    g = h // kv_heads
    return q.to(ct).view(b, s, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * s, d)


def _ungrouped(x, s):
    """Inverse of _grouped: (b, kv_heads, groups*s, d) -> (b, s, kv_heads*groups, d)."""
    b, hk, gs, d = x.shape
    g = gs // s
    return x.view(b, hk, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


def _block_scores(qb, kt, scale, causal, start, stop, g):
    """Scores of query rows [start, stop) for all groups vs keys [0, kend); masked above the diagonal."""
    s = qb @ kt * scale                                        # (b, hk, g*(stop-start), kend)
    if causal:
        rows = torch.arange(start, stop, device=s.device).repeat(g)
        cols = torch.arange(kt.shape[-1], device=s.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return s


def _masked_columns(mask, start, stop, g):
    """(key columns, fill) of a row block under a ``KeyMask``: the keys any of its rows sees (a slice or an
    index) and the boolean 'hidden' matrix of those keys, rows in (group, position) order; None: no key."""
    block = mask.rows(start, stop)
    cols = block.key_columns()
    if cols is None:
        return None, None
    return cols, ~block.dense(cols).repeat(g, 1)


def _torch_forward(q, k, v, causal, scale, mask=None):
    b, sq, h, d = q.shape
    hk, g, ct = k.shape[2], h // k.shape[2], _compute_dtype(q.dtype)
    kt = k.to(ct).permute(0, 2, 3, 1)                          # (b, hk, d, sk)
    vv = v.to(ct).permute(0, 2, 1, 3)                          # (b, hk, sk, d)
    out = torch.empty(b, sq, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=ct, device=q.device)
    step = _row_block(q, k)
    for start in range(0, sq, step):
        stop = min(sq, start + step)
        kend = stop if causal else k.shape[1]
        qb = _grouped(q[:, start:stop], hk, ct)
        if mask is not None:   # only the keys some row of the block sees: work follows the visible pairs
            cols, hidden = _masked_columns(mask, start, stop, g)
            if cols is None:
                out[:, start:stop] = 0
                lse[:, :, start:stop] = float("-inf")
                continue
            s = (qb @ kt[..., cols] * scale).masked_fill_(hidden, float("-inf"))
            vb = vv[:, :, cols]
        else:
            s = _block_scores(qb, kt[..., :kend], scale, causal, start, stop, g)
            vb = vv[:, :, :kend]
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = s.sub_(m).exp_()
        denom = p.sum(-1, keepdim=True)
        o = (p @ vb) / denom.clamp_min(torch.finfo(ct).tiny)
        row_lse = (m + denom.log()).squeeze(-1)                 # -inf for a row that sees no key
        out[:, start:stop] = _ungrouped(o, stop - start).to(q.dtype)
        lse[:, :, start:stop] = row_lse.view(b, hk, g, stop - start).reshape(b, h, stop - start)
    return out, lse.float() if ct == torch.float32 else lse


def _torch_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    b, sq, h, d = q.shape
    hk, g, ct = k.shape[2], h // k.shape[2], _compute_dtype(q.dtype)
    kk = k.to(ct).permute(0, 2, 1, 3)                          # (b, hk, sk, d)
    vv = v.to(ct).permute(0, 2, 1, 3)
    dq = torch.empty(b, sq, h, d, dtype=ct, device=q.device)
    dk = torch.zeros(b, hk, k.shape[1], d, dtype=ct, device=q.device)
    dv = torch.zeros_like(dk)
    delta = (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2)  # (b, h, sq): rowsum(dO * O)
    lse = lse.to(ct)
    step = _row_block(q, k)
    for start in range(0, sq, step):
        stop = min(sq, start + step)
        n, kend = stop - start, (stop if causal else k.shape[1])
        qb = _grouped(q[:, start:stop], hk, ct)
        dob = _grouped(dout[:, start:stop], hk, ct)
        lb = lse[:, :, start:stop].reshape(b, hk, g * n, 1)
        db = delta[:, :, start:stop].reshape(b, hk, g * n, 1)
        cols = slice(0, kend)
        if mask is not None:
            cols, hidden = _masked_columns(mask, start, stop, g)
            if cols is None:
                dq[:, start:stop] = 0
                continue
            s = (qb @ kk[:, :, cols].transpose(-1, -2) * scale).masked_fill_(hidden, float("-inf"))
        else:
            s = _block_scores(qb, kk[:, :, :kend].transpose(-1, -2), scale, causal, start, stop, g)
        p = s.sub_(torch.where(lb == float("-inf"), float("inf"), lb)).exp_()   # no key: P = 0; NaN stays
        dv_b = p.transpose(-1, -2) @ dob
        ds = (dob @ vv[:, :, cols].transpose(-1, -2)).sub_(db).mul_(p).mul_(scale)
        dq[:, start:stop] = _ungrouped(ds @ kk[:, :, cols], n)
        dk_b = ds.transpose(-1, -2) @ qb
        if isinstance(cols, slice):
            dv[:, :, cols] += dv_b
            dk[:, :, cols] += dk_b
        else:
            dv.index_add_(2, cols, dv_b)
            dk.index_add_(2, cols, dk_b)
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


# ---------------------------------------------------------------------------------------------------------
# PyTorch SDPA ops (CUDA): these take (b, h, s, d) views and need equal head counts, so GQA repeats K/V
# ---------------------------------------------------------------------------------------------------------
def _repeat_kv(k, v, groups):
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)


def _sum_kv_groups(dk, kv_heads):
    b, s, h, d = dk.shape
    return dk if h == kv_heads else dk.view(b, s, kv_heads, h // kv_heads, d).sum(3)


def _sdpa_forward(backend, q, k, v, causal, scale):
    kr, vr = _repeat_kv(k, v, q.shape[2] // k.shape[2])
    qh, kh, vh = q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2)
    if backend == "sdpa-cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, causal, False,
                                                                 scale=scale)
    elif backend == "sdpa-flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, causal,
                                                                     scale=scale)
    out, lse = res[0], res[1]
    lse = lse.reshape(lse.shape[0], lse.shape[1], -1)[..., : q.shape[1]]  # cuDNN: (b,h,s,1); efficient pads s
    return out.transpose(1, 2), lse.float()


def _sdpa_backward(backend, dout, q, k, v, out, lse, causal, scale):
    hk = k.shape[2]
    kr, vr = _repeat_kv(k, v, q.shape[2] // hk)
    qh, kh, vh = q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2)
    oh, doh = out.transpose(1, 2), dout.transpose(1, 2)
    sq, sk = q.shape[1], k.shape[1]
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    lse = lse.float().contiguous()
    if backend == "sdpa-cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            doh, qh, kh, vh, oh, lse.unsqueeze(-1), seed, offset, None, None, None, sq, sk, 0.0, causal,
            scale=scale)
    elif backend == "sdpa-flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale)
    else:  # the efficient kernel keeps its LSE padded to a multiple of 32 rows
        lse = torch.nn.functional.pad(lse, (0, -sq % 32))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            doh, qh, kh, vh, None, oh, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, _sum_kv_groups(dk, hk), _sum_kv_groups(dv, hk)


# ---------------------------------------------------------------------------------------------------------
# autograd wrapper: local attention as a differentiable op (used by Ulysses, which needs no merge)
# ---------------------------------------------------------------------------------------------------------
class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, mask):
        out, lse = attention_forward(q, k, v, causal, scale, backend, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, backend, mask)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*attention_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args), None, None, None, None)


def attention(q, k, v, causal=False, softmax_scale=None, backend="auto", mask=None):
    """Differentiable attention through ``attention_forward`` / ``attention_backward``; returns ``out``."""
    check_qkv(q, k, v, causal)
    check_mask(mask, q, k, causal)
    backend = resolve_backend(backend, q.device, q.dtype, masked=mask is not None)
    return _Attention.apply(q, k, v, causal, softmax_scale, backend, mask)
