"""The Triton kernels of ``kernels/`` against their plain-PyTorch references, on any device.

    TRITON_INTERPRET=1 python tests/kernel_checks.py attention rmsnorm rope swiglu merge emulate   # CPU
    python tests/kernel_checks.py --device cuda --dtype bfloat16 attention ...                     # GPU

``tests/test_triton_kernels.py`` runs the CPU half in a subprocess (the interpreter must be switched on
before the kernels are defined, and an out-of-bounds access there kills the process) and the GPU half in
process. Every float tensor the kernels allocate is poisoned with NaN first (``torch.empty`` is wrapped),
so an element a kernel forgets to write fails the check. Prints ``OK <name>`` per passing check.
"""

from __future__ import annotations

import argparse
import sys

import torch

from distlab import knobs

_empty, _empty_like = torch.empty, torch.empty_like


def _poison(t):
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30) if t.dtype != torch.bool else True)


def poison_allocations():
    torch.empty = lambda *a, **k: _poison(_empty(*a, **k))
    torch.empty_like = lambda *a, **k: _poison(_empty_like(*a, **k))


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not torch.isnan(a).any(), "NaN in the result (an unwritten element?)"
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]


def rand(*shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


# ----------------------------------------------------------------------------------------------------------
def check_attention(device, dtype, big=False):
    from distlab.kernels.attention import attention_backward, attention_forward
    from distlab.kernels.triton_attention import flash_forward
    from distlab.kernels.triton_attention_backward import flash_backward

    cases = [(2, 37, 37, 4, 2, 16, True), (1, 50, 23, 2, 1, 32, False), (1, 64, 64, 4, 4, 64, True),
             (1, 33, 70, 6, 2, 16, False), (1, 100, 100, 2, 1, 32, True)]
    if big:
        cases = [(2, 1000, 1000, 8, 2, 64, True), (1, 768, 1280, 8, 8, 128, False), (1, 2048, 2048, 16, 4, 128, True)]
    for i, (b, sq, sk, h, hk, d, causal) in enumerate(cases):
        q, k, v = (rand(b, n, hh, d, dtype=dtype, device=device, seed=i * 3 + j)
                   for j, (n, hh) in enumerate([(sq, h), (sk, hk), (sk, hk)]))
        dout = rand(b, sq, h, d, dtype=dtype, device=device, seed=99)
        ro, rl = attention_forward(q.double(), k.double(), v.double(), causal, backend="torch")
        grads = attention_backward(dout.double(), q.double(), k.double(), v.double(), ro, rl, causal, backend="torch")
        # GQA: per-kv-head and per-q-head dK/dV programs; dQ from its own kernel or added atomically by dK/dV's;
        # tiles through pointers, TMA descriptors in every kernel, or the default (forward only); dQ added by
        # pointer atomics or TMA reduce-adds. On CPU float32 goes through every path on cases 0 and 3 (odd GQA
        # shapes, causal and not) and the default one elsewhere; float16 (the dtypes' rounding, not the
        # indexing) through the default one and the atomics on those two cases
        paths = (("kernel", "0"), ("kernel", "1"), ("kernel", "fwd"), ("atomic", "0"), ("tma-reduce", "dkv"))
        if device.type == "cpu" and dtype != torch.float32:
            paths = (("kernel", "fwd"), ("atomic", "0"))
        if device.type == "cpu" and i not in (0, 3):
            paths = (("kernel", "fwd"),)
        modes = [(sp, m, t) for sp in ((False, True) if h > hk else (None,)) for m, t in paths]
        for split, dq_mode, tma in modes:
            knobs.set(TRITON_ATTN_DQ_MODE=dq_mode, TRITON_ATTN_TMA=tma)
            o, lse = flash_forward(q, k, v, causal)
            got = (o, lse, *flash_backward(dout, q, k, v, o, lse, causal, split_groups=split))
            for name, g_, w in zip(("out", "lse", "dq", "dk", "dv"), got, (ro, rl, *grads)):
                err = rel(g_, w)
                assert err < tol(dtype) * (4 if name in ("dq", "dk", "dv") else 1), (i, split, dq_mode, tma, name, err)
        if h > hk:   # a later ring step: dK/dV added into the float32 accumulators it received (dkv_into)
            received = [0.1 * rand(b, sk, hk, d, dtype=torch.float32, device=device, seed=7 + j) for j in range(2)]
            want = [r.double() + g for r, g in zip(received, grads[1:])]
            # per kv head and split: added (split: the partials summed) by the dQ kernel's programs, or after
            # (per kv head: two add_; split: the sum's own launch)
            for split, split_sum in ((False, "dq"), (False, "kernel"), (True, "dq"), (True, "kernel")):
                knobs.set(TRITON_ATTN_SPLIT_SUM=split_sum, TRITON_ATTN_DQ_MODE="kernel",
                                  TRITON_ATTN_TMA="fwd")
                acc = [r.clone() for r in received]
                dq_, dk_, dv_ = flash_backward(dout, q, k, v, o, lse, causal, split_groups=split,
                                               dkv_into=lambda: acc)
                assert dk_ is acc[0] and dv_ is acc[1]
                for name, g_, w in (("dq", dq_, grads[0]), ("dk", dk_, want[0]), ("dv", dv_, want[1])):
                    assert rel(g_, w) < tol(dtype) * 4, (i, split, split_sum, "dkv_into", name, rel(g_, w))
            # the ring's first step: dQ written into a float32 buffer that holds garbage (dq_add=False), dK/dV
            # written to float32 views, the split partials summed by the dQ kernel or by their own launch
            from distlab.kernels.triton_attention_backward import backward_rows

            for split, split_sum in ((False, "dq"), (True, "dq"), (True, "kernel")):
                knobs.set(TRITON_ATTN_SPLIT_SUM=split_sum)
                dq_, dk_, dv_ = (torch.empty(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
                flash_backward(dout, q, k, v, None, None, causal, split_groups=split, rows=backward_rows(dout, o, lse),
                               dq_acc=dq_, dk_out=dk_, dv_out=dv_, dq_add=False)
                for name, g_, w in (("dq", dq_, grads[0]), ("dk", dk_, grads[1]), ("dv", dv_, grads[2])):
                    assert rel(g_, w) < tol(dtype) * 4, (i, split, split_sum, "first step", name, rel(g_, w))
            knobs.unset("TRITON_ATTN_SPLIT_SUM")
    knobs.unset("TRITON_ATTN_DQ_MODE")
    knobs.unset("TRITON_ATTN_TMA")
    # through the backend registry, and strided inputs (a slice of a fused qkv)
    b, s, h, hk, d = 1, 24, 4, 2, 16 if not big else 128
    qkv = rand(b, s, (h + 2 * hk) * d, dtype=dtype, device=device).view(b, s, h + 2 * hk, d)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:]
    ro, rl = attention_forward(q.double(), k.double(), v.double(), True, backend="torch")
    for tma in ("0", "1"):
        knobs.set(TRITON_ATTN_TMA=tma)
        o, lse = attention_forward(q, k, v, True, backend="triton")
        assert rel(o, ro) < tol(dtype) and rel(lse, rl) < tol(dtype), tma
    knobs.unset("TRITON_ATTN_TMA")
    # the row max is taken before scaling (one FMA per score), so a negative scale must be handled too
    for fma in ("1", "0"):
        knobs.set(TRITON_ATTN_FMA=fma)
        for scale in (-0.3, 0.7):
            ro, rl = attention_forward(q.double(), k.double(), v.double(), True, scale, backend="torch")
            o, lse = flash_forward(q, k, v, True, scale)
            assert rel(o, ro) < tol(dtype) and rel(lse, rl) < tol(dtype), (fma, scale, rel(o, ro), rel(lse, rl))
    knobs.unset("TRITON_ATTN_FMA")
    print("OK attention")


def check_attention_accumulate(device, dtype, big=False):
    """Key blocks accumulated into float32 running results equal attention over all keys; a block that
    covers only some query rows (a zigzag half block) accumulates into a view. K/V are slices of a longer
    sequence (batch stride ≠ seq · token stride), through pointers and through TMA descriptors."""
    # on CPU float16 (the dtype's rounding, not the indexing: float32 runs both) through the descriptors only
    for tma in ("0", "1") if device.type == "cuda" or dtype == torch.float32 else ("1",):
        knobs.set(TRITON_ATTN_TMA=tma)
        _accumulate_blocks(device, dtype, big)
    knobs.unset("TRITON_ATTN_TMA")
    print("OK accumulate")


def _accumulate_blocks(device, dtype, big):
    from distlab.kernels.attention import attention_forward
    from distlab.kernels.triton_attention import flash_forward

    b, sq, h, hk, d = (2, 40, 4, 2, 32) if not big else (1, 1024, 8, 2, 128)
    q = rand(b, sq, h, d, dtype=dtype, device=device, seed=1)
    k = rand(b, 3 * sq, hk, d, dtype=dtype, device=device, seed=2)
    v = rand(b, 3 * sq, hk, d, dtype=dtype, device=device, seed=3)
    out = torch.empty(b, sq, h, d, dtype=torch.float32, device=device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=device)
    flash_forward(q, k[:, :sq], v[:, :sq], False, None, out, lse)            # writes, poisoned buffers
    flash_forward(q, k[:, sq:2 * sq], v[:, sq:2 * sq], False, None, out, lse, accumulate=True)
    half = sq // 2                                  # rows [half, sq) also see the third block
    flash_forward(q[:, half:], k[:, 2 * sq:], v[:, 2 * sq:], False, None, out[:, half:], lse[:, :, half:],
                  accumulate=True)
    qd, kd, vd = q.double(), k.double(), v.double()
    top, top_l = attention_forward(qd[:, :half], kd[:, :2 * sq], vd[:, :2 * sq], backend="torch")
    bot, bot_l = attention_forward(qd[:, half:], kd, vd, backend="torch")
    assert rel(out[:, :half], top) < tol(dtype) and rel(out[:, half:], bot) < tol(dtype)
    assert rel(lse[:, :, :half], top_l) < tol(dtype) and rel(lse[:, :, half:], bot_l) < tol(dtype)
    # causal diagonal block first, then a full earlier block: a ring step's pattern
    out2 = torch.empty(b, sq, h, d, dtype=torch.float32, device=device)
    lse2 = torch.empty(b, h, sq, dtype=torch.float32, device=device)
    flash_forward(q, k[:, sq:2 * sq], v[:, sq:2 * sq], True, None, out2, lse2)
    flash_forward(q, k[:, :sq], v[:, :sq], False, None, out2, lse2, accumulate=True)
    mask = torch.ones(sq, 2 * sq, dtype=torch.bool, device="cpu").tril(sq)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd.cpu(), kd[:, :2 * sq].repeat_interleave(h // hk, 2).cpu()) / d ** 0.5
    want = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1),
                        vd[:, :2 * sq].repeat_interleave(h // hk, 2).cpu())
    assert rel(out2, want) < tol(dtype)
    # the same two steps writing final rows in q's dtype: rows [3, sq - 5) by the first (non-accumulating)
    # block's kernel, the rest of them by the second's; a ring's last block for those rows
    out3 = torch.empty(b, sq, h, d, dtype=torch.float32, device=device)
    lse3 = torch.empty(b, h, sq, dtype=torch.float32, device=device)
    final = torch.empty(b, sq, h, d, dtype=dtype, device=device)
    flash_forward(q, k[:, sq:2 * sq], v[:, sq:2 * sq], True, None, out3, lse3, final_out=final, final_rows=(3, sq - 5))
    assert torch.isnan(out3[:, 3:sq - 5]).all() and not torch.isnan(out3[:, :3]).any()   # final rows skip out
    first = final[:, 3:sq - 5].clone()
    flash_forward(q[:, :3], k[:, :sq], v[:, :sq], False, None, out3[:, :3], lse3[:, :, :3], accumulate=True,
                  final_out=final[:, :3], final_rows=(0, 3))
    flash_forward(q[:, sq - 5:], k[:, :sq], v[:, :sq], False, None, out3[:, sq - 5:], lse3[:, :, sq - 5:],
                  accumulate=True, final_out=final[:, sq - 5:], final_rows=(0, 5))
    diag = attention_forward(qd, kd[:, sq:2 * sq], vd[:, sq:2 * sq], True, backend="torch")[0]
    rows = [*range(3), *range(sq - 5, sq)]
    assert rel(first, diag[:, 3:sq - 5]) < tol(dtype)
    assert rel(final[:, rows], want[:, rows]) < tol(dtype) and rel(lse3[:, :, rows], lse2[:, :, rows]) < tol(dtype)
    _two_blocks_per_launch(q, k, v, want, lse2, diag, dtype)
    _more_blocks_per_launch(q, k, v, dtype)


def _two_blocks_per_launch(q, k, v, want, want_lse, diag, dtype):
    """``flash_forward_blocks``: two ring steps in one launch. (a) the causal diagonal block over every row
    with an earlier block over a tail of the rows, fresh buffers, the tail final in q's dtype; (b) two
    blocks accumulated onto a running result, the first over a tail only; (c) two tail blocks: rows before
    the tail are not touched."""
    from distlab.kernels.attention import attention_forward
    from distlab.kernels.triton_attention import blocks_fit_one_launch, flash_forward, flash_forward_blocks, tile_config

    b, sq, h, d = q.shape
    bm = tile_config("FWD", q.device, d)[0]
    lo = bm * max(1, (sq // 2) // bm)                               # a tile boundary near the middle
    assert 0 < lo < sq, (lo, sq)
    early, diag_kv, late = (slice(0, sq), slice(sq, 2 * sq), slice(2 * sq, 3 * sq))
    f32 = dict(dtype=torch.float32, device=q.device)
    out, lse = torch.empty(b, sq, h, d, **f32), torch.empty(b, h, sq, **f32)
    final = torch.empty(b, sq, h, d, dtype=dtype, device=q.device)
    blocks = [(0, sq, k[:, diag_kv], v[:, diag_kv], True), (lo, sq, k[:, early], v[:, early], False)]
    assert blocks_fit_one_launch(q, blocks)
    flash_forward_blocks(q, blocks, None, out, lse, final_out=final, final_rows=(lo, sq))
    assert torch.isnan(out[:, lo:]).all()                          # final rows went to `final` only
    assert rel(out[:, :lo], diag[:, :lo]) < tol(dtype) and rel(final[:, lo:], want[:, lo:]) < tol(dtype)
    assert rel(lse[:, :, lo:], want_lse[:, :, lo:]) < tol(dtype)
    qd, kd, vd = q.double(), k.double(), v.double()
    # (b) running result of the early block; + late over the tail and the diagonal keys (unmasked) over all
    out, lse = flash_forward(q, k[:, early], v[:, early], False, None, torch.empty(b, sq, h, d, **f32),
                             torch.empty(b, h, sq, **f32))
    flash_forward_blocks(q, [(lo, sq, k[:, late], v[:, late], False), (0, sq, k[:, diag_kv], v[:, diag_kv], False)],
                         None, out, lse, accumulate=True)
    head = attention_forward(qd[:, :lo], kd[:, :2 * sq], vd[:, :2 * sq], backend="torch")
    tail = attention_forward(qd[:, lo:], kd, vd, backend="torch")
    assert rel(out[:, :lo], head[0]) < tol(dtype) and rel(out[:, lo:], tail[0]) < tol(dtype)
    assert rel(lse[:, :, :lo], head[1]) < tol(dtype) and rel(lse[:, :, lo:], tail[1]) < tol(dtype)
    # (c) two tail blocks onto the early block's result: the head rows keep it
    out, lse = flash_forward(q, k[:, early], v[:, early], False, None, torch.empty(b, sq, h, d, **f32),
                             torch.empty(b, h, sq, **f32))
    kept = out[:, :lo].clone()
    flash_forward_blocks(q, [(lo, sq, k[:, diag_kv], v[:, diag_kv], False), (lo, sq, k[:, late], v[:, late], False)],
                         None, out, lse, accumulate=True)
    assert torch.equal(out[:, :lo], kept) and rel(out[:, lo:], tail[0]) < tol(dtype)
    assert not blocks_fit_one_launch(q, [blocks[0], (lo + 1, sq, k[:, early], v[:, early], False)])
    assert not blocks_fit_one_launch(q, [blocks[1], blocks[0]])    # only the first block may be causal


def _blocks_reference(q, blocks):
    """Float64 attention of each query row over the keys of every block that covers it (``(lo, hi, k, v,
    causal)``, a causal block's keys j <= row), through one masked softmax; rows no block covers are NaN."""
    b, sq, h, d = q.shape
    cols = [kb.shape[1] for _, _, kb, _, _ in blocks]
    mask = torch.zeros(sq, sum(cols), dtype=torch.bool)
    for i, (lo, hi, _, _, causal) in enumerate(blocks):
        at = sum(cols[:i])
        mask[lo:hi, at:at + cols[i]] = True
        if causal:
            mask[:, at:at + cols[i]] &= torch.ones(sq, cols[i], dtype=torch.bool).tril()
    groups = h // blocks[0][2].shape[2]
    k = torch.cat([kb for _, _, kb, _, _ in blocks], 1).double().cpu().repeat_interleave(groups, 2)
    v = torch.cat([vb for _, _, _, vb, _ in blocks], 1).double().cpu().repeat_interleave(groups, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double().cpu(), k) / d ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return out, scores.logsumexp(-1)


def _more_blocks_per_launch(q, k, v, dtype):
    """``flash_forward_blocks`` with three and four blocks (ring steps) in one launch: (d) the causal
    diagonal block and three later blocks over all rows or a tail, fresh buffers, the tail final in q's
    dtype; (e) three later blocks accumulated onto a running result; (f) later blocks whose K/V are
    strided differently do not fit one launch (one set of strides is passed for them)."""
    from distlab.kernels.triton_attention import MAX_BLOCKS, blocks_fit_one_launch, flash_forward, flash_forward_blocks, tile_config

    b, sq, h, d = q.shape
    lo = tile_config("FWD", q.device, d)[0] * max(1, (sq // 2) // tile_config("FWD", q.device, d)[0])
    early, diag_kv, late = (slice(0, sq), slice(sq, 2 * sq), slice(2 * sq, 3 * sq))
    f32 = dict(dtype=torch.float32, device=q.device)
    blocks = [(0, sq, k[:, diag_kv], v[:, diag_kv], True), (lo, sq, k[:, early], v[:, early], False),
              (0, sq, k[:, late], v[:, late], False), (lo, sq, k[:, diag_kv], v[:, diag_kv], False)]
    assert len(blocks) == MAX_BLOCKS and blocks_fit_one_launch(q, blocks)
    out, lse = torch.empty(b, sq, h, d, **f32), torch.empty(b, h, sq, **f32)
    final = torch.empty(b, sq, h, d, dtype=dtype, device=q.device)
    flash_forward_blocks(q, blocks, None, out, lse, final_out=final, final_rows=(lo, sq))
    want, want_lse = _blocks_reference(q, blocks)
    assert torch.isnan(out[:, lo:]).all()                          # final rows went to `final` only
    assert rel(out[:, :lo], want[:, :lo]) < tol(dtype) and rel(final[:, lo:], want[:, lo:]) < tol(dtype)
    assert rel(lse, want_lse) < tol(dtype)
    # (e) the early block's running result, then three blocks in one accumulating launch
    out, lse = flash_forward(q, k[:, early], v[:, early], False, None, torch.empty(b, sq, h, d, **f32),
                             torch.empty(b, h, sq, **f32))
    three = [(lo, sq, k[:, late], v[:, late], False), (0, sq, k[:, diag_kv], v[:, diag_kv], False),
             (lo, sq, k[:, early], v[:, early], False)]
    flash_forward_blocks(q, three, None, out, lse, accumulate=True)
    want, want_lse = _blocks_reference(q, [(0, sq, k[:, early], v[:, early], False)] + three)
    assert rel(out, want) < tol(dtype) and rel(lse, want_lse) < tol(dtype)
    # (f) one later block's K/V a slice of a longer-token-stride tensor: refused (and every block too many)
    wide = torch.cat([k[:, early], k[:, early]], 2)[:, :, :k.shape[2]]
    assert not blocks_fit_one_launch(q, [blocks[0], blocks[1], (0, sq, wide, v[:, late], False)])
    assert not blocks_fit_one_launch(q, blocks + [blocks[1]])


def check_rmsnorm(device, dtype, big=False):
    from distlab.kernels.rmsnorm import rmsnorm_residual, rmsnorm_residual_reference

    cases = ((7, 100, True, "1"), (5, 64, False, "2"), (3, 130, True, "4"), (4, 2, True, "1"), (7, 100, True, "4"))
    for rows, n, residual, per in cases:            # per: rows per forward program (a ragged last program)
        knobs.set(KERNEL_RMSNORM_ROWS=per)
        shape = (2, rows, n) if not big else (4, 1024, 4096 + n)
        x = rand(*shape, dtype=dtype, device=device, seed=1).requires_grad_(True)
        r = rand(*shape, dtype=dtype, device=device, seed=2).requires_grad_(True) if residual else None
        w = (1 + 0.3 * rand(shape[-1], dtype=torch.float32, device=device, seed=3)).requires_grad_(True)
        dy, dh = rand(*shape, dtype=dtype, device=device, seed=4), rand(*shape, dtype=dtype, device=device, seed=5)
        results = []
        for fn in (rmsnorm_residual, rmsnorm_residual_reference):
            for t in (x, r, w):
                if t is not None:
                    t.grad = None
            y, h = fn(x, r, w)
            (y.float() * dy.float()).sum().backward(retain_graph=True) if not residual else \
                ((y.float() * dy.float()).sum() + (h.float() * dh.float()).sum()).backward()
            results.append((y.detach(), h.detach(), x.grad.clone(), w.grad.clone(), None if r is None else r.grad.clone()))
        for name, a, b in zip(("y", "h", "dx", "dw", "dres"), *results):
            if b is not None:
                assert rel(a, b) < tol(dtype) * 2, (name, rel(a, b))
    knobs.unset("KERNEL_RMSNORM_ROWS")
    print("OK rmsnorm")


def check_rope(device, dtype, big=False):
    from distlab.tp.block import rope
    from distlab.kernels.rope import rope_qk, rope_tables

    b, s, hq, hk, d = (2, 11, 3, 1, 16) if not big else (2, 4096, 32, 8, 128)
    positions = torch.randperm(4 * s, generator=torch.Generator().manual_seed(0))[:s]   # a CP shard's positions
    q = rand(b, s, hq, d, dtype=dtype, device=device, seed=1).requires_grad_(True)
    k = rand(b, s, hk, d, dtype=dtype, device=device, seed=2).requires_grad_(True)
    cos, sin = rope_tables(positions, d, 10000.0, device)
    dq_, dk_ = rand(*q.shape, dtype=dtype, device=device, seed=3), rand(*k.shape, dtype=dtype, device=device, seed=4)
    rq, rk = rope(q, positions=positions.to(device)), rope(k, positions=positions.to(device))
    ((rq.float() * dq_.float()).sum() + (rk.float() * dk_.float()).sum()).backward()
    want = rq, rk, q.grad.clone(), k.grad.clone()
    for per in ("1", "4"):                          # tokens per program; 4 leaves a ragged last program
        knobs.set(KERNEL_ROPE_TOKENS=per)
        q.grad = k.grad = None
        qo, ko = rope_qk(q, k, cos, sin)
        ((qo.float() * dq_.float()).sum() + (ko.float() * dk_.float()).sum()).backward()
        for name, a, w in zip(("q", "k", "dq", "dk"), (qo, ko, q.grad, k.grad), want):
            assert rel(a, w) < tol(dtype), (per, name, rel(a, w))
    knobs.unset("KERNEL_ROPE_TOKENS")
    print("OK rope")


def check_swiglu(device, dtype, big=False):
    from distlab.kernels.swiglu import swiglu, swiglu_reference

    shape = (3, 5, 2 * 37) if not big else (4096, 2 * 14336)
    gu = rand(*shape, dtype=dtype, device=device, seed=1).requires_grad_(True)
    dy = rand(*shape[:-1], shape[-1] // 2, dtype=dtype, device=device, seed=2)
    got = swiglu(gu)
    got.backward(dy)
    g1 = gu.grad.clone()
    gu.grad = None
    want = swiglu_reference(gu.float())
    want.backward(dy.float())
    assert rel(got, want) < tol(dtype) and rel(g1, gu.grad) < tol(dtype) * 2, (rel(got, want), rel(g1, gu.grad))
    print("OK swiglu")


def check_merge(device, dtype, big=False):
    from distlab.kernels.lse_merge import merge_into
    from distlab.kernels.lse_merge import lse_merge_

    b, s, h, d = (2, 45, 3, 16) if not big else (1, 4096, 32, 128)
    out = rand(b, s, h, d, dtype=torch.float32, device=device, seed=1)
    lse = rand(b, h, s, dtype=torch.float32, device=device, seed=2)
    bo = rand(b, s // 2, h, d, dtype=dtype, device=device, seed=3)
    bl = rand(b, h, s // 2, dtype=torch.float32, device=device, seed=4)
    lse[:, 0, :5] = float("-inf")                    # running rows that saw nothing yet
    bl[:, 1, :3] = float("-inf")                     # block rows with no visible key (their out is garbage)
    bo[:, :3, 1] = float("nan")
    lse[:, 2, :2] = bl[:, 2, :2] = float("-inf")     # rows empty on both sides stay empty
    bl[:, 0, 5], bl[:, 0, 6] = float("nan"), float("inf")   # the inputs' NaN and inf: those rows come out NaN
    want_o, want_l = merge_into(out.clone(), lse.clone(), bo, bl, slice(s - s // 2, s))
    rows = slice(s - s // 2, s)
    lse_merge_(out[:, rows], lse[:, :, rows], bo, bl)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_l))
    assert torch.equal(torch.isnan(out), torch.isnan(want_o)) and torch.isnan(out[:, rows.start + 6, 0]).all()
    fin = torch.isfinite(want_l)
    ok = ~torch.isnan(want_o)
    assert (lse[fin] - want_l[fin]).abs().max() < 1e-5 and rel(out[ok], want_o[ok]) < 1e-5
    check_merge_blocks(device, dtype, big)
    print("OK merge")


def check_merge_blocks(device, dtype, big=False):
    """``lse_merge_blocks_`` (several blocks in one launch, as a ring of cuDNN/FA4 blocks merges) equals
    ``merge_into`` one block after another: blocks of all rows and of a tail, rows no block sees, empty and
    NaN/inf rows; into a running result, into new buffers, and into a final output in the block's dtype."""
    from distlab.kernels.lse_merge import lse_merge_blocks_, merge_blocks_reference

    b, s, h, d = (2, 45, 3, 16) if not big else (1, 4096, 32, 128)
    spans = [(0, s), (s // 3, s), (0, s - 5), (s - s // 2, s)]

    def blocks(seed):
        out = []
        for i, (lo, hi) in enumerate(spans):
            bo = rand(b, hi - lo, h, d, dtype=dtype, device=device, seed=seed + 2 * i)
            bl = rand(b, h, hi - lo, dtype=torch.float32, device=device, seed=seed + 2 * i + 1) + 2.0 * i
            bl[:, 1, :3] = float("-inf")   # rows this block has no key for (garbage output)
            bo[:, :3, 1] = float("nan")
            out.append((bo, bl, lo, hi))
        return out

    for n in (1, 2, 4):
        for has_acc in (True, False):
            for to_final in (False, True):
                got_o = rand(b, s, h, d, dtype=torch.float32, device=device, seed=11)
                got_l = rand(b, h, s, dtype=torch.float32, device=device, seed=12)
                got_l[:, 0, :4], got_o[:, :4, 0] = float("-inf"), 0.0   # rows that saw nothing yet: 0
                if has_acc:
                    got_l[:, 2, 7] = got_o[:, 7, 2] = float("nan")   # a row already NaN stays NaN
                blks = blocks(20 + n)[:n]
                if n == 4:
                    blks[3][1][:, 0, 2] = float("inf")   # an infinite score: that row comes out NaN
                if n == 1 and has_acc:
                    blks = [(blks[0][0][:, s - 20:], blks[0][1][:, :, s - 20:], s - 20, s)]   # a tail only
                want_o, want_l = merge_blocks_reference(got_o if has_acc else None, got_l, blks, (b, s, h, d))
                final = torch.empty(b, s, h, d, dtype=dtype, device=device) if to_final else None
                res_o, res_l = lse_merge_blocks_(got_o, got_l, blks, has_acc=has_acc, final=final)
                assert res_o is (final if to_final else got_o) and res_l is got_l
                # NaN or +inf LSE alike (the reference keeps +inf where a score was infinite; the kernels NaN)
                assert torch.equal(torch.isfinite(res_l), torch.isfinite(want_l)), (n, has_acc, to_final)
                assert torch.equal(torch.isneginf(res_l), torch.isneginf(want_l)), (n, has_acc, to_final)
                assert torch.equal(torch.isnan(res_o), torch.isnan(want_o)), (n, has_acc, to_final)
                fin, ok = torch.isfinite(want_l), ~torch.isnan(want_o)
                tol_o = 1e-5 if res_o.dtype == torch.float32 else 1e-2
                assert (res_l[fin] - want_l[fin]).abs().max() < 1e-5, (n, has_acc, to_final)
                assert rel(res_o[ok].float(), want_o[ok]) < tol_o, (n, has_acc, to_final, rel(res_o[ok].float(), want_o[ok]))


def check_emulate(device, dtype, big=False):
    """One rank's ring schedule on one device (triton backend) equals the rows of full attention it owns:
    the output, and dQ (which depends on those rows' dO only). On a GPU also replayed as a CUDA graph, and
    with the accumulating forwards launched as programmatic dependents (``DISTLAB_TRITON_ATTN_PDL=1``). A
    backend that cannot accumulate (``torch`` on CPU, ``sdpa-cudnn`` on a GPU) merges its block results
    four at a time (``lse_merge_blocks_``): a ring of more than four blocks, so two merges."""
    from distlab.cp.emulate import emulate_rank
    from distlab.kernels.attention import attention_backward, attention_forward

    # on CPU a shard of 64 rows: zigzag's half blocks start on a 32-row query tile, so steps can share a launch
    world, seq, h, hk, d = (3, 192, 2, 1, 16) if not big else (8, 8192, 8, 2, 128)
    modes = [(False, "0")] if device.type != "cuda" else [(False, "0"), (True, "0"), (True, "1"), (False, "1")]
    # step groups: one step a launch; 0 | 1 | 2 3 | ... (n=2); up to four steps a launch (n=4, the GPU's W=8:
    # 0 | 1 | 2 3 | 4 5 6 7); every step in one launch (CPU, W=3: the causal block + two more). On a GPU every
    # combination; on CPU each layout and end rank once, each grouping at least once (tests/test_ring.py runs
    # the groupings on real gloo ranks)
    cases = [(layout, rank, mode, n, "triton", world) for layout in ("zigzag", "contiguous")
             for rank in (0, world - 1) for mode in modes for n in (1, 2, 4)]
    cases += [("zigzag", 3, modes[0], 1, "sdpa-cudnn", world), ("contiguous", 7, modes[0], 4, "sdpa-cudnn", world),
              ("zigzag", 7, modes[0], 4, "sdpa-cudnn", world)]   # fused blocks on K/V received in place (landing)
    if not big:
        one = modes[0]
        cases = [("zigzag", 0, one, (world,), "triton", world), ("zigzag", world - 1, one, 1, "triton", world),
                 ("contiguous", 0, one, 2, "triton", world), ("contiguous", world - 1, one, (world,), "triton", world),
                 ("zigzag", 1, one, 1, "torch", 6), ("contiguous", 5, one, 2, "torch", 6),
                 ("zigzag", 5, one, 2, "torch", 6)]
    for layout, rank, (graphs, pdl), n, backend, w in cases:
        knobs.set(TRITON_ATTN_PDL=pdl)
        res = emulate_rank(w, seq, h, hk, d, rank, layout, True, backend, dtype, device,
                           keep_output=True, graphs=graphs, iters=1, warmup=int(big), steps_per_launch=n)
        q, k, v = (res[x].double() for x in "qkv")
        rows = res["rows"].to(q.device)
        full, lse = attention_forward(q, k, v, True, backend="torch")
        dout = torch.zeros_like(q)
        dout[:, rows] = res["dout"].double()
        dq = attention_backward(dout, q, k, v, full, lse, True, backend="torch")[0]
        case = (layout, rank, graphs, pdl, n, backend, w)
        assert rel(res["out"], full[:, rows]) < tol(dtype) * 2, (case, rel(res["out"], full[:, rows]))
        assert rel(res["dq"], dq[:, rows]) < tol(dtype) * 4, (case, rel(res["dq"], dq[:, rows]))
    knobs.unset("TRITON_ATTN_PDL")
    print("OK emulate")


def check_masked(device, dtype, big=False):
    """The masked Triton attention (documents, windows, a ring block's positions, rows that see nothing, a
    query tile straddling two far documents) against the torch backend's masked loop, forward and backward,
    GQA; the float64 torch result is the reference. Also: a query tile whose rows see no key writes out 0
    and LSE -inf."""
    from distlab.kernels.attention import attention_backward, attention_forward
    from distlab.kernels.masks import document_mask

    t, d, h, hk = (96, 16, 4, 2) if not big else (8192, 128, 32, 8)
    lens = [1, 30, 0, 40, 25] if not big else [1, 3000, 0, 2500, 2691]
    cu = torch.tensor([0] + lens).cumsum(0)
    cases = [  # (q positions, k positions, causal, window): whole sequence; a ring block; a later rank's keys
        (torch.arange(t), torch.arange(t), True, None), (torch.arange(t), torch.arange(t), True, 7 if not big else 1000),
        (torch.arange(t), torch.arange(t), False, None),
        (torch.cat([torch.arange(t // 4), torch.arange(3 * t // 4, t)]), torch.arange(t // 4, t // 2), True, None),
        (torch.arange(t // 2), torch.arange(t // 2, t), True, None),
        (torch.arange(t // 3), torch.arange(t), True, None),   # rows that see some keys only: dK/dV on those
        # all-gather's rows of a balanced rank: two documents far apart, a query tile straddling them, whose keys
        # in between no row sees (``key_gaps``: skipped)
        (torch.cat([torch.arange(24), torch.arange(80, t)]) if not big else
         torch.cat([torch.arange(1000), torch.arange(6000, t)]), torch.arange(t), True, None)]
    if device.type == "cpu" and dtype != torch.float32:   # float16 on the CPU checks the dtype's rounding, not
        cases = [cases[i] for i in (1, 3, 6)]             # the indexing (float32 runs every case): a window,
    for i, (qp, kp, causal, window) in enumerate(cases):  # a ring block, a straddling query tile
        mask = document_mask(qp, kp, cu, causal, window, t).to(device)
        q = rand(2, len(qp), h, d, dtype=dtype, device=device, seed=i)
        k = rand(2, len(kp), hk, d, dtype=dtype, device=device, seed=10 + i)
        v = rand(2, len(kp), hk, d, dtype=dtype, device=device, seed=20 + i)
        do = rand(2, len(qp), h, d, dtype=dtype, device=device, seed=30 + i)
        q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
        out_w, lse_w = attention_forward(q64, k64, v64, mask=mask, backend="torch")
        grads_w = attention_backward(do64, q64, k64, v64, out_w, lse_w, mask=mask, backend="torch")
        out, lse = attention_forward(q, k, v, mask=mask, backend="triton")
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_w)), (i, "rows without keys")
        assert rel(out, out_w) < tol(dtype), (i, rel(out, out_w))
        grads = attention_backward(do, q, k, v, out_w.to(dtype), lse_w.float(), mask=mask, backend="triton")
        for name, g, w in zip(("dq", "dk", "dv"), grads, grads_w):
            assert rel(g, w) < tol(dtype) * 4, (i, name, rel(g, w))
        # a ring's step: the keys in two blocks, each merged inside the kernel into float32 running results
        # that are a view of some rows of larger buffers (as a packed ring's row runs are)
        from distlab.kernels.triton_masked_attention import masked_forward

        out_run = torch.full((2, len(qp) + 3, h, d), float("nan"), device=device)
        lse_run = torch.full((2, h, len(qp) + 3), float("nan"), device=device)
        out_run[:, 3:], lse_run[:, :, 3:] = 0.0, float("-inf")
        half = len(kp) // 2
        for part in (slice(0, half), slice(half, len(kp))):
            m = document_mask(qp, kp[part], cu, causal, window, t).to(device)
            masked_forward(q, k[:, part], v[:, part], m, d ** -0.5, out_run[:, 3:], lse_run[:, :, 3:],
                           accumulate=True)
        assert torch.equal(torch.isinf(lse_run[:, :, 3:]), torch.isinf(lse_w)), (i, "accumulate: rows without keys")
        assert rel(out_run[:, 3:], out_w) < tol(dtype), (i, "accumulate", rel(out_run[:, 3:], out_w))
        finite = torch.isfinite(lse_w)
        assert not finite.any() or (lse_run[:, :, 3:][finite] - lse_w[finite]).abs().max() < tol(dtype), (i, "lse")
        assert torch.isnan(out_run[:, :3]).all() and torch.isnan(lse_run[:, :, :3]).all(), "rows outside the view"
        # ordered (a packed ring): unfilled (NaN) running buffers, each row started by its first block and
        # written in q's dtype to a final output by its last
        run = torch.full((2, len(qp), h, d), float("nan"), device=device)
        run_lse = torch.full((2, h, len(qp)), float("nan"), device=device)
        final = torch.full((2, len(qp), h, d), float("nan"), dtype=dtype, device=device)
        first = torch.zeros(len(qp), dtype=torch.int32, device=device)
        for number, part in enumerate((slice(0, half), slice(half, len(kp)))):
            m = document_mask(qp, kp[part], cu, causal, window, t).to(device)
            masked_forward(q, k[:, part], v[:, part], m, d ** -0.5, run, run_lse, accumulate=True,
                           order=(first, first + 1, number), final_out=final)
        assert rel(final, out_w) < tol(dtype), (i, "ordered", rel(final, out_w))
        assert torch.equal(torch.isinf(run_lse), torch.isinf(lse_w)), (i, "ordered: rows without keys")
        # and its backward: dQ of both blocks added into one float32 view, dK/dV of each into its own
        from distlab.kernels.triton_masked_attention import masked_backward, masked_backward_rows

        rows = masked_backward_rows(do, out_w.to(dtype), lse_w.float())
        dq_run = torch.full((2, len(qp) + 3, h, d), float("nan"), device=device)
        dq_run[:, 3:] = 0.0
        for part in (slice(0, half), slice(half, len(kp))):
            m = document_mask(qp, kp[part], cu, causal, window, t).to(device)
            dk_acc = torch.zeros(k[:, part].shape, device=device)
            dv_acc = torch.zeros_like(dk_acc)
            masked_backward(do, q, k[:, part], v[:, part], None, None, m, d ** -0.5, rows=rows, dq_acc=dq_run[:, 3:],
                            dk_acc=dk_acc, dv_acc=dv_acc)
            for name, g, w in (("dk", dk_acc, grads_w[1][:, part]), ("dv", dv_acc, grads_w[2][:, part])):
                assert rel(g, w) < tol(dtype) * 4, (i, "accumulate", name, rel(g, w))
        assert rel(dq_run[:, 3:], grads_w[0]) < tol(dtype) * 4, (i, "accumulate dq", rel(dq_run[:, 3:], grads_w[0]))
        assert torch.isnan(dq_run[:, :3]).all(), "dq rows outside the view"
    print("OK masked")


def check_packed_ring(device, dtype, big=False):
    """Every rank's packed ring schedule (``distlab.cp.ring_packed``'s own forward and backward, all K/V
    resident: ``distlab.cp.emulate.ResidentRing``) on the ``triton`` backend — kernels merging and adding in
    place, ring blocks longest tiles first, on CUDA the backward's dQ on a second stream (the defaults) —
    against the float64 torch backend, zigzag and balanced, also with the forward on two streams (its merge
    order differs: not bit for bit) and with the forward by launch groups (``distlab.cp.packed_groups``: the
    ring's default, 0 | 1 2 3 | 4 5 6 7 at W=8; 0 | 1 2 at W=3); and the backward on one stream and on four,
    bit for bit the same as on two (a missing stream sync would show)."""
    from distlab.cp.documents import Documents, parse_docs
    from distlab.cp.emulate import ResidentRing
    from distlab.cp.layout import shard_positions
    from distlab.cp.ring_packed import _backward, _forward, step_blocks

    t, d, h, hk, world = (96, 16, 4, 2, 3) if not big else (16384, 128, 32, 8, 8)
    docs = Documents.from_args(t, parse_docs(f"lognormal:mean={t // 6},seed=0", t), True, None)
    q, do = (rand(1, t, h, d, dtype=dtype, device=device, seed=s) for s in (1, 2))
    k, v = (rand(1, t, hk, d, dtype=dtype, device=device, seed=s) for s in (3, 4))

    def schedule(backend, r, pos, blocks, cast):
        kv = [tuple(cast(x[:, pos[(r - s) % world].to(device)]).contiguous() for x in (k, v)) for s in range(world)]
        qr, dr = (cast(x[:, pos[r].to(device)]).contiguous() for x in (q, do))
        out, lse = _forward(qr, *kv[0], ResidentRing(world, r, kv), blocks, None, backend)
        return (out, lse, *_backward(dr, qr, *kv[0], out, lse, ResidentRing(world, r, kv), blocks, None, backend))

    for layout in ("zigzag", "balanced"):
        pos = [shard_positions(t, world, r, layout, docs.cu_seqlens) for r in range(world)]
        for r in range(world):
            blocks = step_blocks(docs, pos, r, device)
            grouped = step_blocks(docs, pos, r, device, steps_per_launch=4 if world > 3 else (1, 2))
            want = schedule("torch", r, pos, blocks, lambda x: x.double())
            got = {}
            for fwd, bwd in (("1", "2"), ("1", "1"), ("1", "4"), ("2", "2"), ("groups", "4")):
                with knobs.override(PACKED_FWD_STREAMS="1" if fwd == "groups" else fwd, PACKED_BWD_STREAMS=bwd):
                    got[fwd, bwd] = schedule("triton", r, pos, grouped if fwd == "groups" else blocks, lambda x: x)
            for (fwd, bwd), result in got.items():
                for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), result, want):
                    if name == "lse":
                        finite = torch.isfinite(w)
                        assert torch.equal(torch.isinf(g), torch.isinf(w)), (layout, r, "rows without keys")
                        g, w = g[finite], w[finite]
                    err = rel(g, w)
                    assert err < tol(dtype) * (1 if name in ("out", "lse") else 4), (layout, r, fwd, bwd, name, err)
            for bwd in ("1", "4"):   # the same forward: the backward's streams change no bit
                assert all(torch.equal(a, b) for a, b in zip(got["1", "2"], got["1", bwd])), (layout, r, "2 vs", bwd)
    print("OK packed_ring")


def check_copies(device, dtype, big=False):
    """The one-pass sum of FA4's dK/dV over key copies (``copies_sum_``) equals the torch path's
    ``_copies_summed`` bit for bit: sequences reading overlapping key ranges (rows read once, twice, three
    times, never), keys through a permutation (all-gather's arrival order), outputs that are strided views of a
    head group (their other heads untouched), heads and (on the CPU) a head_dim not a power of two."""
    from distlab.kernels.fa4 import _copies_summed
    from distlab.kernels.fa4_varlen import VarlenSpec, _copies_by_row, _read_through, _with_key_copies
    from distlab.kernels.triton_copies_sum import copies_sum_

    n_k, heads, dim, total = (45, 3, 16, 5) if not big else (65536, 4, 128, 8)
    ka, kb = ((torch.tensor([0, 0, 5, 8, 30]), torch.tensor([10, 14, 20, 12, 40])) if not big else
              (torch.arange(0, 60000, 3000), torch.arange(0, 60000, 3000) + 7000))
    one = torch.tensor([1], dtype=torch.int32)
    base = VarlenSpec(cu_q=one, cu_k=one, used_q=None, used_k=None, max_q=1, max_k=1, causal=True, window=None,
                      unseen=None, keys_left_out=False)
    order = torch.randperm(n_k, generator=torch.Generator().manual_seed(3))
    spec = _copies_by_row(_read_through(_with_key_copies(base, ka, kb), order), n_k)
    counts = torch.bincount(spec.key_index, minlength=n_k)
    assert {0, 1, 2, 3} <= set(counts.tolist()), counts   # rows read never, once, twice, three times
    spec = spec.to(device)
    packed = spec.key_index.numel()
    for dim in (dim,) if big else (dim, 24):
        dk, dv = (rand(packed, heads, dim, dtype=dtype, device=device, seed=s) for s in (5, 6))
        like = torch.zeros(n_k, heads, dim, dtype=dtype, device=device)
        want_k, want_v = (_copies_summed(d, like, spec, torch.empty_like(like)[None])[0] for d in (dk, dv))
        whole = rand(n_k, 2, total, dim, dtype=dtype, device=device, seed=7)   # a scatter buffer: (rows, k|v, h, d)
        before = whole.clone()
        out_k, out_v = whole[:, 0, 1:1 + heads], whole[:, 1, 1:1 + heads]
        copies_sum_(dk, dv, out_k, out_v, spec.copy_order, spec.copy_start)
        if device.type == "cpu":   # the same float32 additions in the same order
            assert torch.equal(out_k, want_k) and torch.equal(out_v, want_v), (dim, rel(out_k, want_k), rel(out_v, want_v))
        else:                      # CUDA's index_add_ adds a row's third copy in any order: one rounding apart at most
            assert rel(out_k, want_k) < tol(dtype) / 10 and rel(out_v, want_v) < tol(dtype) / 10
        assert torch.equal(whole[:, :, :1], before[:, :, :1]) and torch.equal(whole[:, :, 1 + heads:], before[:, :, 1 + heads:])
    if device.type == "cpu":
        _copies_through_the_fa4_wrapper(dtype)
    print("OK copies")


def _copies_through_the_fa4_wrapper(dtype):
    """``fa4_masked_backward`` on a balanced all-gather rank (keys read as copies), FA4's varlen rule standing in
    for FA4 (``tests/test_fa4_varlen.py``): the one Triton pass (the default, where Triton runs: here the
    interpreter) equals the torch path (knob ``FA4_COPIES_KERNEL=0``) bit for bit, new tensors and into views."""
    from distlab.cp.documents import Documents, parse_docs
    from distlab.kernels import fa4, triton_copies_sum
    from distlab.kernels.fa4_varlen import varlen_spec
    from test_fa4_varlen import _FA4VarlenSemantics, _balanced_rank_with_shared_keys

    docs = Documents.from_args(192, parse_docs("lognormal:mean=48,seed=0", 192), True, None)   # small: interpreted
    mask = docs.mask(_balanced_rank_with_shared_keys(docs), torch.arange(docs.total))
    spec = varlen_spec(mask)
    assert spec.key_index is not None
    fake = _FA4VarlenSemantics()
    fa4._interface = lambda: fake
    launches = []
    kernel = triton_copies_sum.copies_sum_
    triton_copies_sum.copies_sum_ = lambda *a: launches.append(1) or kernel(*a)
    q, out, dout = (rand(1, mask.q_lo.numel(), 4, 16, dtype=dtype, device="cpu", seed=s) for s in (1, 2, 3))
    k, v = (rand(1, docs.total, 2, 16, dtype=dtype, device="cpu", seed=s) for s in (4, 5))
    lse = rand(1, 4, q.shape[1], dtype=torch.float32, device="cpu", seed=6).abs() + 3.0
    with knobs.override(FA4_COPIES_KERNEL="0"):
        want = fa4.fa4_masked_backward(dout, q, k, v, out, lse, spec, 0.25)
    got = fa4.fa4_masked_backward(dout, q, k, v, out, lse, spec, 0.25)
    into = [torch.full((1, t.shape[1], 3, 16), float("nan"), dtype=dtype)[:, :, 1:1 + t.shape[2]] for t in (q, k, v)]
    into[0] = torch.full_like(q, float("nan"))
    viewed = fa4.fa4_masked_backward(dout, q, k, v, out, lse, spec, 0.25, into=tuple(into))
    assert all(g is t for g, t in zip(viewed, into)) and len(launches) == 2   # the torch path launched none
    for name, w, g, h in zip(("dq", "dk", "dv"), want, got, viewed):
        assert torch.equal(g, w) and torch.equal(h, w), (name, rel(g, w), rel(h, w))


CHECKS = {"attention": check_attention, "accumulate": check_attention_accumulate, "rmsnorm": check_rmsnorm,
          "rope": check_rope, "swiglu": check_swiglu, "merge": check_merge, "emulate": check_emulate,
          "masked": check_masked, "packed_ring": check_packed_ring, "copies": check_copies}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="+", choices=list(CHECKS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--big", action="store_true", help="real sizes (GPU)")
    a = p.parse_args(argv)
    poison_allocations()
    for name in a.names:
        CHECKS[name](torch.device(a.device), getattr(torch, a.dtype), a.big)


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    main()
