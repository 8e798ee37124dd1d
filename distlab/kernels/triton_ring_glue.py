"""A folding FA4 ring's glue passes in Triton (#24): the q heads folded into rows (Q, out and dO in one launch),
the float32 dK/dV accumulator += a block's bf16 share, vectorized (knob ``DISTLAB_FA4_RING_GLUE``), and an
unfolded block's float32 scratch finished straight into that accumulator (knob ``DISTLAB_FA4_RING_DKV_FINISH``).

    TRITON_INTERPRET=1 python -m pytest -q tests/test_fa4_ring_backward.py -k glue   # CPU, the interpreter
    python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 4 --timeline   # H100/H200: in place

Where they come from: a folding ring (``FA4_RING_FOLD``, S32768 at W=8) runs its unmasked half-shard row set as
MHA over the kv heads (``fa4_ring_backward.fold_heads``), so its Q, out and dO are copied once a backward with
each kv head's q heads stacked as rows; torch's permuted copy moved them at ~1.3 TB/s on the H100 (rank 4,
2048 rows, 32 heads: 3 × 25 µs, ``docs/perf/h100_2026-12-07d/origins``). A folded ring's travelling dK/dV is a
float32 ``(2, B, keys, Hkv, D)`` tensor and every block's share arrives in bf16: torch adds mixed dtypes, and a
share cut out of a fused block (two runs of keys, dK's and dV's) with its non-vectorized loop, ~2.1 TB/s
(a 4096-key add 38–41 µs, seven a backward, the last group's four after every kernel).

The folding ring's other blocks (causal, or row sets too long to fold) run as GQA into float32 scratch in
FA4's accumulator layout; each was converted to bf16 by two FA4 postprocesses on the compute stream, then added
(rank 4: six postprocesses, 64 µs, and the own block's copy to float32, 24 µs).

Here the fold is one program per (rows, q head, batch) tile copying all three tensors, each row's head_dim
contiguous on both sides; the add treats both tensors as rows of one contiguous run (dK's and dV's), loads the
share in its dtype and adds in float32 — the same sum torch computes, bit for bit. The finish reads the scratch
in FA4's tile order, measured once through its postprocesses (``triton_dq_finish.window_order``), scales dK
as the postprocess does and adds into (or writes) the accumulator's key range — one pass where there were
three, on the side stream with the other adds, and no rounding to bf16 between.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distlab.kernels.launch import CachedLaunch, cdiv, launch_keyed

FOLD_ROWS, ADD_BLOCK = 32, 2048   # rows a fold program copies; elements an add program adds


@triton.jit
def _fold_kernel(S0, S1, S2, O, sb, sr, sh, rows, HKV, one,
                 N: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BR: tl.constexpr):
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h, g = head // G, head % G
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)[:, None]
    d = tl.arange(0, D)[None, :]
    inside = (r < rows) & (d < D)
    src = b * sb + r * sr + head * sh + d
    dst = (b * G * rows + g * rows + r) * (HKV * D) + h * D + d   # (B, G·rows, Hkv, D), contiguous
    for i in tl.static_range(N):
        if i == 0:
            S = S0
        elif i == 1:
            S = S1
        else:
            S = S2
        tl.store(O + i * one + dst, tl.load(S + src, mask=inside), mask=inside)


@triton.jit
def _add_kernel(ACC, PART, sa, sp, C, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = c < C
    acc = tl.load(ACC + row * sa + c, mask=inside)
    part = tl.load(PART + row * sp + c, mask=inside).to(tl.float32)
    tl.store(ACC + row * sa + c, acc + part, mask=inside)


@triton.jit
def _dkv_finish_kernel(ACC, SCR, ORDER, scale_k, scale_v, a2, ab, ar, ah, s2, sb, sh, n, HKV,
                       ADD: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, WIN: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    bh = tl.program_id(1)
    b, h = (bh // HKV).to(tl.int64), (bh % HKV).to(tl.int64)
    which = tl.program_id(2)   # 0: dK, 1: dV
    d = tl.arange(0, D)[None, :]
    inside = (r < n) & (d < D)
    row = tl.where(inside, r, 0)
    off = tl.load(ORDER + which * (WIN * D) + (row % WIN) * D + d, mask=inside, other=0).to(tl.int64)
    off += (row // WIN).to(tl.int64) * (WIN * D)
    val = tl.load(SCR + which * s2 + b * sb + h * sh + off, mask=inside, other=0.0)
    val = val * tl.where(which == 0, scale_k, scale_v)
    dst = ACC + which * a2 + b * ab + row.to(tl.int64) * ar + h * ah + d
    if ADD:
        val += tl.load(dst, mask=inside, other=0.0)
    tl.store(dst, val, mask=inside)


_FOLD = CachedLaunch(_fold_kernel)
_ADD = CachedLaunch(_add_kernel)
_FINISH = CachedLaunch(_dkv_finish_kernel)
FINISH_ROWS = 32   # key rows a dK/dV finish program reads
_ORDERS: dict = {}   # dkv_orders' stacked orders (the functions held: their ids stay their own)


def fold_takes(tensors, kv_heads: int) -> bool:
    """``fold_heads_`` applies: one to three (B, rows, H, D) tensors of one shape, dtype and strides, head_dim a
    power of two and contiguous, H a multiple of ``kv_heads``."""
    t = tensors[0]
    d = t.shape[-1]
    return (1 <= len(tensors) <= 3 and t.ndim == 4 and t.shape[2] % kv_heads == 0 and d & (d - 1) == 0
            and t.stride(-1) == 1 and all(x.shape == t.shape and x.stride() == t.stride() and x.dtype == t.dtype
                                          and x.device == t.device for x in tensors))


def fold_heads_(tensors, kv_heads: int, checked: bool = False):
    """``fa4_ring_backward.fold_heads`` of each tensor (``fold_takes``), in one launch: ``(B, rows, H, D)`` ->
    ``(B, G·rows, kv_heads, D)`` contiguous, kv head h's q heads hG … hG+G−1 stacked as rows. Returns a list
    of views into one buffer. ``checked``: the caller has asked ``fold_takes`` already."""
    if not checked and not fold_takes(tensors, kv_heads):
        raise ValueError("fold_heads_: 1-3 tensors (B, rows, H, D) of one shape, dtype and strides, D a power of two")
    t = tensors[0]
    b, rows, heads, dim = t.shape
    group = heads // kv_heads
    out = torch.empty((len(tensors), b, group * rows, kv_heads, dim), dtype=t.dtype, device=t.device)
    srcs = (*tensors, *(t,) * (3 - len(tensors)))
    launch_keyed(_FOLD, (cdiv(rows, FOLD_ROWS), heads, b), (*srcs, out),
                 (t.stride(0), t.stride(1), t.stride(2), rows, kv_heads, t.numel()),   # the outputs one after another
                 dict(N=len(tensors), G=group, D=dim, BR=FOLD_ROWS, num_warps=4))
    return list(out.unbind(0))


def _run_start(t) -> int:
    """The first dimension of ``t``'s largest contiguous tail."""
    run, i = 1, t.ndim
    while i > 0 and (t.shape[i - 1] == 1 or t.stride(i - 1) == run):
        run *= t.shape[i - 1]
        i -= 1
    return i


def _as_rows(t, i: int):
    """``(rows, row stride, run)``: ``t`` seen as rows of one contiguous run, the run its dimensions from ``i``
    on (contiguous), the rows every dimension before (one stride for all), or None."""
    if _run_start(t) > i:
        return None
    run = 1
    for n in t.shape[i:]:
        run *= n
    rows, stride = 1, run
    for j in range(i - 1, -1, -1):   # the outer dimensions, innermost first
        if t.shape[j] == 1:
            continue
        if rows == 1:
            rows, stride = t.shape[j], t.stride(j)
        elif t.stride(j) == rows * stride:
            rows *= t.shape[j]
        else:
            return None
    return rows, stride, run


_SPLITS: dict = {}   # (shapes, strides) -> ``_split``'s answer: a ring adds the same layouts every backward


def _split(acc, part):
    """``acc`` and ``part`` (one shape) as ``(rows, acc's row stride, part's, run)``, or None; worked out once per
    pair of layouts (host time: a folded S8192 ring adds seven shares a backward, each 15 µs of Python here
    before it was kept, H100 host_cost 2026-12-07)."""
    key = (acc.shape, acc.stride(), part.stride())
    hit = _SPLITS.get(key, False)
    if hit is not False:
        return hit
    i = max(_run_start(acc), _run_start(part))
    a, p = _as_rows(acc, i), _as_rows(part, i)
    if len(_SPLITS) >= 1024:
        _SPLITS.clear()
    hit = _SPLITS[key] = None if a is None or p is None else (a[0], a[1], p[1], a[2])
    return hit


def add_takes(acc, part) -> bool:
    """``add_into_`` applies: a float32 ``acc`` and a float32/bf16/fp16 ``part`` of one shape, each rows of one
    contiguous run, the same rows and runs, on one device."""
    return add_takes_dtypes(acc, part) and _split(acc, part) is not None


def add_takes_dtypes(acc, part) -> bool:
    """``add_takes`` but for the layouts: dtypes, shapes and devices."""
    return (acc.dtype == torch.float32 and part.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and acc.shape == part.shape and acc.device == part.device)


def add_into_(acc, part):
    """``acc += part`` in float32 (``add_takes``): the same values as ``acc.add_(part)``, one vectorized pass."""
    if not try_add_into_(acc, part):
        raise ValueError("add_into_: a float32 acc and a float32/bf16/fp16 part of one shape, rows of one run each")
    return acc


def try_add_into_(acc, part) -> bool:
    """``add_into_`` where ``add_takes`` (the layouts read once); False, and nothing done, where not."""
    split = _split(acc, part) if add_takes_dtypes(acc, part) else None   # same shapes: part's is acc's
    if split is None:
        return False
    if acc.numel() == 0:
        return True
    rows, sa, sp, run = split
    launch_keyed(_ADD, (cdiv(run, ADD_BLOCK), rows), (acc, part), (sa, sp, run),
                 dict(BLOCK=ADD_BLOCK, num_warps=4))
    return True


def dkv_orders(posts, dim: int, dtype, device):
    """``(2, WINDOW·dim)`` int32: the tile orders (``triton_dq_finish.window_order``) of an FA4 block's dK and dV
    postprocesses (``posts``: their recorded ``(fn, args)``); raises ``TileOrderUnknown`` where one cannot be read."""
    from distlab.kernels.triton_dq_finish import window_order

    key = (*(id(fn) for fn, _ in posts), dim, dtype, device)
    if key not in _ORDERS:   # once per process and postprocess pair (each ``FA4RingBackward`` asks: per backward)
        _ORDERS[key] = ([fn for fn, _ in posts], torch.stack([window_order(p, dim, dtype, device) for p in posts]))
    return _ORDERS[key][1]


def dkv_finish_(acc, scratch, orders, scale_k: float, scale_v: float, add: bool):
    """An unfolded FA4 block's dK/dV, from its float32 scratch in FA4's accumulator layout, into the float32
    folded-layout accumulator of a folding ring: ``acc`` (2, B, keys, Hkv, D; a key range of it) ``+=`` (or, with
    ``add`` False, ``=``) the scratch's keys (``scratch``: (2, B, Hkv, keys·D), a key range cut out of a block's
    scratch at a multiple of its tile), dK times ``scale_k``, dV times ``scale_v`` — what FA4's postprocesses
    (``orders``: their ``dkv_orders``) and an add do, without rounding to q's dtype between."""
    from distlab.kernels.triton_dq_finish import WINDOW

    two, b, keys, kv_heads, dim = acc.shape
    if (scratch.shape != (two, b, kv_heads, keys * dim) or acc.dtype != torch.float32 or scratch.dtype != acc.dtype
            or acc.stride(-1) != 1 or scratch.stride(-1) != 1 or dim & (dim - 1) or orders.shape != (2, WINDOW * dim)):
        raise ValueError("dkv_finish_: a float32 acc (2, B, keys, Hkv, D) and scratch (2, B, Hkv, keys·D), last "
                         "dimensions contiguous, D a power of two, orders (2, WINDOW·D)")
    launch_keyed(_FINISH, (cdiv(keys, FINISH_ROWS), b * kv_heads, 2), (acc, scratch, orders),
                 (float(scale_k), float(scale_v), *acc.stride()[:4], *scratch.stride()[:3], keys, kv_heads),
                 dict(ADD=bool(add), D=dim, BR=FINISH_ROWS, WIN=WINDOW, num_warps=4))
    return acc


def bench_start(module: str, doc: str, what: str, check: str, argv):
    """A glue benchmark's start (``main`` here and in ``triton_fold_preprocess``): its flags parsed (the rank's
    shard, heads, kv heads), the CUDA device (refused without one, pointing at the CPU check ``-k check``), the
    copy bandwidth, a seeded generator and a W=8 rank's Q, out and dO, bf16, head_dim 128."""
    from distlab.bench import StudyParser, add_common_args, device_of, positive_int
    from distlab.kernels.bench import copy_bandwidth

    p = StudyParser(prog=f"python -m distlab.kernels.{module}", description=doc.split("\n")[0])
    p.add_argument("--shard", type=positive_int, default=4096, help="rows of the rank's shard (S32768 at W=8)")
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    add_common_args(p, iters=50, warmup=5, dtype=False, gpu_tool=True)
    a = p.parse_args(argv)
    dev = device_of(a, what, gpu_tool=True, cpu_hint="its CPU check: TRITON_INTERPRET=1 python -m pytest -q "
                    f"tests/test_fa4_ring_backward.py -k {check}")
    copy = copy_bandwidth(dev, a.iters, a.warmup)
    g = torch.Generator(device=dev).manual_seed(0)
    full = [torch.randn(1, a.shard, a.heads, 128, device=dev, generator=g).to(torch.bfloat16) for _ in range(3)]
    return a, dev, copy, g, full


def main(argv=None):
    """The glue passes against torch's at the W=8 S32768 rank's shapes: the fold of a 2048-row set's Q, out and
    dO (32 heads, 8 kv heads), and a 4096- and a 2048-key bf16 share, cut out of a fused block's result, added
    into the float32 dK/dV; GPU and wall clocks, GB/s of the bytes each must move, the largest difference."""
    from distlab.bench import write_json
    from distlab.kernels.bench import bandwidth_cells, bandwidth_row
    from distlab.kernels.fa4_ring_backward import fold_heads

    a, dev, copy, g, full = bench_start("triton_ring_glue", main.__doc__, "the ring glue benchmark", "glue", argv)
    s, h, kvh, dim, bf16 = a.shard, a.heads, a.kv_heads, 128, torch.bfloat16
    half = [t[:, s // 2:] for t in full]
    acc = torch.randn(2, 1, s, kvh, dim, device=dev, generator=g)
    block = torch.randn(2, 1, 3 * s, kvh, dim, device=dev, generator=g).to(bf16)   # a fused block's dK/dV
    fold_bytes = 2 * sum(t.numel() * t.element_size() for t in half)
    cases = [("fold Q, out, dO", fold_bytes, lambda: [fold_heads(t, kvh) for t in half],
              lambda: fold_heads_(half, kvh))]
    for keys in (s, s // 2):
        view, part = acc[:, :, s - keys:], block[:, :, s:s + keys]
        moved = view.numel() * 8 + part.numel() * 2
        cases.append((f"add {keys} keys", moved, lambda v=view, p=part: v.add_(p),
                      lambda v=view, p=part: add_into_(v, p)))
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; shard {s}, heads {h} (kv {kvh}), head_dim {dim}, bf16")
    print(f"{'pass':<16} {'by':<7} {'GPU us':>8} {'wall us':>8} {'GB/s':>7} {'% copy':>7} {'max diff':>9}")
    results = []
    for name, moved, torch_fn, triton_fn in cases:
        if name.startswith("add"):   # the same adds from the same start: bit for bit
            start = acc.clone()
            torch_fn()
            want = acc.clone()
            acc.copy_(start)
            triton_fn()
            diff = (acc - want).abs().max().item()
        else:
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(torch_fn(), triton_fn()))
        for by, fn in (("torch", torch_fn), ("triton", triton_fn)):
            row = {"pass": name, "by": by, **bandwidth_row(fn, moved, copy, a.iters, a.warmup, dev), "max_diff": diff}
            results.append(row)
            print(f"{name:<16} {by:<7} {bandwidth_cells(row)} {diff:>9.1e}", flush=True)
    if a.json:
        write_json(a.json, {"copy_GB_s": copy / 1e9, "shard": s, "heads": h, "kv_heads": kvh, "rows": results})


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
