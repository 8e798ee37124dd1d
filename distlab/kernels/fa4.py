"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) as a distlab attention backend: ``backend="fa4"``.

    pip install "distlab[fa4]"                              # flash-attn-4[cu13]; sm90 (Hopper) or newer
    python -m distlab.kernels.bench --only attention        # fa4 beside cuDNN and the Triton kernel
    python -m distlab.cp.ring --seq 32768 --backend fa4 --check

The contract of every backend: bshd tensors, GQA without repeating K/V (FA4 packs the q heads of a kv
head itself), causal or full attention; the forward returns (out, LSE) with the LSE float32
``(batch, heads, seq_q)``, and the backward takes the *final* out and LSE, so a ring step calls it on one
key block with the global LSE. ``flash_attn.cute`` is imported on first use, never at distlab's import.
Packed documents and windows (a ``KeyMask``, batch 1): ``fa4_masked_forward``/``_backward`` call FA4's
variable-length path with the sequences ``distlab.kernels.fa4_varlen`` compiles from the mask (exactly, or
not at all: a mask that is not FA4 sequences — a window cutting across a ring block, say — runs on the
masked Triton kernel; ``attention_forward`` decides). ``auto`` takes this path for masks (H200, a 64k pack:
3.3x the masked Triton kernel's fwd+bwd, docs/PERF.md), except a packed ring in the balanced layout.

Host cost (#24): FA4's Python interface spends ~80-120 µs a call (arguments, its compile key, the
scheduler's choices) in front of a kernel that takes ~25 µs at S2048. ``fa4_forward`` records, for each
shape, the compiled kernel FA4 called and its argument list (``_Recorder`` around FA4's compile cache); a
later call with the same shapes, strides, dtypes, alignment, causality and scale calls that compiled
kernel directly with the new q, k, v and freshly allocated out and LSE. A call is recorded only when it is
exactly one kernel whose first five arguments are q, k, v, out, LSE and none of the rest is a tensor (no
scheduler buffers or semaphores to refresh): anything else goes through FA4 every time. Knob
``DISTLAB_FA4_REPLAY=0`` turns it off; the GPU tests compare both ways bit for bit.
"""

from __future__ import annotations

import functools

import torch

from distlab import knobs
from distlab.kernels.launch import triton_runs_on

PACKAGE = "flash-attn-4"
DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _importable() -> bool:
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception:   # ImportError, or a CUDA library it cannot load
        return False
    return True


def runs_on(device, dtype) -> bool:
    """FA4 is importable, and the device is a CUDA GPU of sm90 or newer, and the dtype fp16/bf16."""
    from distlab.kernels.launch import sm_major   # cached per device: a capability query costs host time

    device = device if isinstance(device, torch.device) else torch.device(device)
    return device.type == "cuda" and dtype in DTYPES and sm_major(device) >= 9 and _importable()


def why_not(device, dtype) -> str:
    """What is missing for ``fa4`` here (for the error that refuses it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it runs on CUDA GPUs (sm90+), not {device.type}"
    if dtype not in DTYPES:
        return f"it takes float16 or bfloat16, not {dtype}"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return f"it needs sm90 or newer; this GPU is sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return f"the {PACKAGE} package is not importable (pip install 'distlab[fa4]', or {PACKAGE}[cu13])"


def _interface():
    import flash_attn.cute.interface as interface

    return interface


def fa4_forward(q, k, v, causal, scale):
    """(out, lse): out like q, lse float32 (batch, heads, seq_q)."""
    if knobs.get("FA4_REPLAY") == "0" or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        return out, lse
    device = q.device
    key = _replay_key(q, k, v, causal, scale)
    replay = _REPLAYS.get(key)
    if replay is not None:
        fn, rest, (o_size, o_stride, o_dtype), (l_size, l_stride) = replay
        out = torch.empty_strided(o_size, o_stride, dtype=o_dtype, device=device)
        lse = torch.empty_strided(l_size, l_stride, dtype=torch.float32, device=device)
        if q.requires_grad or k.requires_grad or v.requires_grad:
            q, k, v = q.detach(), k.detach(), v.detach()
        fn(q, k, v, out, lse, *rest)
        REPLAYED[0] += 1
        return out, lse
    interface = _interface()
    recorder = _Recorder(interface._flash_attn_fwd.compile_cache)
    interface._flash_attn_fwd.compile_cache = recorder
    try:
        out, lse, *_ = interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    finally:
        interface._flash_attn_fwd.compile_cache = recorder.cache
    if len(recorder.calls) == 1:
        fn, args = recorder.calls[0]
        same = [isinstance(t, torch.Tensor) and t.data_ptr() == want.data_ptr() and t.shape == want.shape
                and t.stride() == want.stride() for t, want in zip(args[:5], (q, k, v, out, lse))]
        if len(same) == 5 and all(same) and not _holds_tensor(args[5:]):
            _REPLAYS[key] = (fn, args[5:], (out.shape, out.stride(), out.dtype), (lse.shape, lse.stride()))
    return out, lse


def fa4_forward_kept(q, k, v, causal, scale):
    """``fa4_forward`` for a caller that makes the same call again and again (a ring step of a ring shape):
    returns ``(out, lse, again)`` where ``again(q, k, v)`` computes the same shapes into *these* out and lse
    (FA4's compiled kernel called straight: no key, no allocation; each call overwrites the last one's result,
    so the caller must be done reading it — in stream order, on CUDA) and returns them. ``again`` is None when
    the shape is not replayed (``fa4_forward``'s conditions). ``again`` on inputs whose contiguity or 16-byte
    alignment differs from the first call's goes through ``fa4_forward`` (fresh out and lse)."""
    out, lse = fa4_forward(q, k, v, causal, scale)
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return out, lse, None
    key = _replay_key(q, k, v, causal, scale)
    align = key[5:8]
    replay = _REPLAYS.get(key)
    if replay is None or knobs.get("FA4_REPLAY") == "0":
        return out, lse, None
    fn, rest = replay[0], replay[1]

    def again(q, k, v):
        if (q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16) != align or not (
                q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            return fa4_forward(q, k, v, causal, scale)
        if q.requires_grad or k.requires_grad or v.requires_grad:
            q, k, v = q.detach(), k.detach(), v.detach()
        fn(q, k, v, out, lse, *rest)
        REPLAYED[0] += 1
        return out, lse
    return out, lse, again


def _replay_key(q, k, v, causal, scale):
    """What a recorded FA4 forward is kept under: the shapes, dtype, device, 16-byte alignment of q, k and v
    (at 5:8), causality and scale."""
    return (q.shape, k.shape, v.shape, q.dtype, q.device, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
            causal, scale)


_REPLAYS: dict = {}
REPLAYED = [0]   # forward calls that went straight to the compiled kernel (the tests read it)


class _Recorder:
    """Stands in for FA4's compile cache during one call: what it hands out is called through here, so the
    compiled kernel and its arguments are seen."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    def __contains__(self, key):
        return key in self.cache

    def __setitem__(self, key, fn):
        self.cache[key] = fn

    def __getitem__(self, key):
        fn = self.cache[key]

        def call(*args):
            self.calls.append((fn, args))
            return fn(*args)
        return call


def _holds_tensor(x) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(_holds_tensor(y) for y in x)
    return False


def fa4_backward(dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) given the final out and LSE (a ring step passes the global ones)."""
    dq, dk, dv = _interface()._flash_attn_bwd(q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                                              dout.contiguous(), lse.contiguous(), softmax_scale=scale,
                                              causal=causal)[:3]
    return dq, dk, dv


def fa4_masked_forward(q, k, v, spec, scale, into=(None, None), keep=None):
    """(out, lse) of batch-1 q, k, v under the mask ``spec`` (a ``fa4_varlen.VarlenSpec``) compiles to; rows
    that see no key: out 0, LSE −inf. ``into``: (out, lse) for FA4 to write (aligned strided views do; an LSE
    that is not float32 gets a copy). ``keep``: a dict; the sequences' copies of their keys (if they read
    copies) are put there for ``fa4_masked_backward(kept=...)``, which then does not gather them again."""
    k0, v0 = _keys_read(spec, k[0], v[0])
    if keep is not None and spec.key_index is not None and knobs.get("FA4_KEEP_KEY_COPIES") == "1":
        keep["fa4_keys_read"] = (k0, v0)
    out_to, lse_to = into
    lse_here = lse_to is not None and lse_to.dtype == torch.float32
    out, lse, *_ = _interface()._flash_attn_fwd(
        q[0], k0, v0, softmax_scale=scale, return_lse=True, out=None if out_to is None else out_to[0],
        lse=lse_to[0] if lse_here else None, **_varlen_args(spec))
    out = out.unsqueeze(0) if out_to is None else out_to
    if lse_to is None:
        lse = lse.unsqueeze(0)
    else:   # FA4 wrote it there, or (not float32) it is copied there
        lse = lse_to if lse_here else lse_to.copy_(lse.unsqueeze(0))
    if spec.unseen is not None:   # in no sequence: FA4 left them as allocated
        out.index_fill_(1, spec.unseen, 0.0)
        lse.index_fill_(2, spec.unseen, float("-inf"))
    return out, lse


def fa4_masked_backward(dout, q, k, v, out, lse, spec, scale, into=(None, None, None), kept=None):
    """(dq, dk, dv) under ``spec`` given the final out and LSE; rows and keys in no sequence get zeros; the
    dK/dV of keys that several sequences read as copies (``spec.key_index``) summed in float32 (where Triton
    runs, in one pass: ``triton_copies_sum``; else, or with knob ``FA4_COPIES_KERNEL=0``, by torch). ``into``:
    (dq, dk, dv) to write them into (FA4 itself, or the copies' sums). ``kept``: the forward's ``keep`` (its
    copies of the keys, not gathered again: all-gather's rank at 64k, W=8, ~46 µs of gathers on the H100)."""
    # (a head group of all-gather CP's q, out and dO is a strided view, which FA4 takes as it is: contiguous
    # copies cost ~44 µs a tensor at 64k on the H100; knob FA4_MASKED_CONTIGUOUS=1 makes them, for an A/B)
    same = (lambda t: t.contiguous()) if knobs.get("FA4_MASKED_CONTIGUOUS") == "1" else (lambda t: t)
    q0 = same(q[0])
    read = kept.get("fa4_keys_read") if kept is not None else None
    rows = spec.key_index.numel() if spec.key_index is not None else None
    if read is not None and (read[0].shape[0] != rows or read[0].shape[1:] != k.shape[2:]):
        raise ValueError(f"kept: key copies {tuple(read[0].shape)} were not read under this mask "
                         f"({rows} copied key rows of {tuple(k.shape[2:])})")
    k0, v0 = (same(t) for t in (read if read is not None else _keys_read(spec, k[0], v[0])))
    dq_to, dk_to, dv_to = into
    copies = spec.key_index is not None   # FA4 writes the copies' dK/dV, summed into the keys' after
    # FA4 writes the rows and keys of its sequences only: the others are zeroed first
    dq = _zeros_or(dq_to, q0, spec.unseen is not None)
    dk, dv = (_zeros_or(None if copies else to, t, spec.keys_left_out) for to, t in ((dk_to, k0), (dv_to, v0)))
    dq, dk, dv = _interface()._flash_attn_bwd(
        q0, k0, v0, same(out[0]), same(dout[0]), lse[0].contiguous(), softmax_scale=scale,
        dq=dq, dk=dk, dv=dv, **_varlen_args(spec))[:3]
    if not copies:
        return _batch(dq, dq_to), _batch(dk, dk_to), _batch(dv, dv_to)
    dk_sum, dv_sum = (to if to is not None else torch.empty((1,) + tuple(t.shape), dtype=t.dtype, device=t.device)
                      for to, t in ((dk_to, k[0]), (dv_to, v[0])))
    if knobs.get("FA4_COPIES_KERNEL") == "1" and triton_runs_on(dk.device):
        from distlab.kernels import triton_copies_sum

        if triton_copies_sum.takes(dk, dv, dk_sum[0], dv_sum[0]):
            triton_copies_sum.copies_sum_(dk, dv, dk_sum[0], dv_sum[0], spec.copy_order, spec.copy_start)
            return _batch(dq, dq_to), dk_sum, dv_sum
    return _batch(dq, dq_to), _copies_summed(dk, k[0], spec, dk_sum), _copies_summed(dv, v[0], spec, dv_sum)


def _zeros_or(to, like, zeroed):
    """What FA4 writes a gradient into: ``to[0]`` (zeroed if ``zeroed``), else new zeros or None (FA4's own)."""
    if to is not None:
        return to[0].zero_() if zeroed else to[0]
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device) if zeroed else None


def _batch(d, to):
    return to if to is not None else d.unsqueeze(0)


def _copies_summed(d, like, spec, to):
    """``to`` (batch 1, ``like``'s shape and dtype), written with the dK (or dV) of the key rows ``like`` holds,
    from ``d``, FA4's gradient of the packed key rows it read through ``spec.key_index``: each row the sum of its
    copies' in float32 (or wider), in packed order, rounded once; rows not read get zeros. What
    ``triton_copies_sum`` does in one pass where Triton runs (the same additions in the same order)."""
    acc = torch.promote_types(like.dtype, torch.float32)
    to[0].copy_(torch.zeros(like.shape, dtype=acc, device=like.device).index_add_(0, spec.key_index, d.to(acc)))
    return to


def _keys_read(spec, k, v):
    """The K/V rows FA4 reads under ``spec``: ``k``, ``v`` themselves, or each sequence's copy of its keys."""
    if spec.key_index is None:
        return k, v
    return k.index_select(0, spec.key_index), v.index_select(0, spec.key_index)


def _varlen_args(spec) -> dict:
    return dict(cu_seqlens_q=spec.cu_q, cu_seqlens_k=spec.cu_k, seqused_q=spec.used_q, seqused_k=spec.used_k,
                max_seqlen_q=spec.max_q, max_seqlen_k=spec.max_k, causal=spec.causal, window_size_left=spec.window)
