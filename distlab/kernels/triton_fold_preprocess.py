"""A folded row set's fold and FA4's backward preprocess in one Triton pass (#24; knob
``DISTLAB_FA4_RING_FOLD_PRE``).

    TRITON_INTERPRET=1 python -m pytest -q tests/test_fa4_ring_backward.py -k fold_pre   # CPU, the interpreter
    python -m distlab.kernels.triton_fold_preprocess   # H100/H200: the pass against the fold + FA4's preprocess
    python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 6 --timeline   # H100/H200: in place

A folding FA4 ring (``fa4_ring_backward``, ``FA4_RING_FOLD``) runs an unmasked row set as MHA over the kv heads,
each kv head's G q heads stacked as rows. Before its blocks it ran two passes over the set's rows: the fold
(``triton_ring_glue.fold_heads_``: Q, out and dO copied into the folded layout) and FA4's preprocess on the
folded tensors (per folded row: delta = rowsum(out · dO) in float32, the LSE times log2(e), the float32 dQ
accumulator zeroed). Out is read by the preprocess only, so folding it is a copy nobody reads again, and the
preprocess reads out and dO a second time. H100, S32768, W=8, rank 6 with every unmasked set folded
(``docs/perf/h100_2026-12-07j/fold33``): fold 71.8 + preprocess 55.1 µs for the 4096-row set, 35.9 + 28.5 for
the 2048-row one, on the compute stream between the main kernels.

Here one program per (rows, q head, batch) tile reads Q, out and dO once, writes the folded Q and dO, the
rows' delta and log2-scaled LSE into FA4's ``(B, Hkv, padded rows)`` buffers and zeroes their rows of dQ's
accumulator ``(B, Hkv, padded rows · D)``; the first row tile of each kv head also writes the padding rows
(up to FA4's row tile) as FA4's preprocess does: delta 0, LSE +inf, dQ 0. Bytes: read 3, write 2 tensors and
the float32 accumulator, against read 3 + write 3 and read 2 + write the accumulator. H100 (docs/PERF.md, 35th
session): 85.2 µs for a 4096-row set against 124.4 for the fold and FA4's preprocess.

``preprocess_sets_`` does it for several row sets of one shard in the same launch (knob
``DISTLAB_FA4_RING_PRE_ONCE``): up to two folded sets (zigzag's middle ranks fold every row and the second half)
and the shard's rows unfolded (the causal block's set, which FA4's preprocess served), q, out and dO read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distlab.kernels.launch import CachedLaunch, cdiv, launch_keyed
from distlab.kernels.triton_ring_glue import fold_takes

ROWS = 32          # rows of one q head a program folds
PAD_ROWS = 128     # the most padding rows FA4's buffers have past the folded rows (its row tile: 64 or 80)


@triton.jit
def _fold_pre_kernel(Q, O, DO, LSE, QF0, DPS0, L20, DQ0, QF1, DPS1, L21, DQ1, DPSU, L2U, DQU,
                     sb, sr, sh, lb, lh, ls, rows, HKV, st0, n0, pad0, one0, st1, n1, pad1, one1, padu,
                     G: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, PAD: tl.constexpr,
                     FOLDED: tl.constexpr, UNFOLDED: tl.constexpr, ZERO: tl.constexpr):
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h, g = head // G, head % G
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    d = tl.arange(0, D)
    inside = r < rows
    src = b * sb + r[:, None] * sr + head * sh + d[None, :]
    do = tl.load(DO + src, mask=inside[:, None], other=0.0)
    o = tl.load(O + src, mask=inside[:, None], other=0.0)
    acc_t = DQU.dtype.element_ty
    delta = tl.sum(o.to(acc_t) * do.to(acc_t), axis=1)
    lse = tl.load(LSE + b * lb + head * lh + r * ls, mask=inside, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    if FOLDED > 0:
        q = tl.load(Q + src, mask=inside[:, None])
    for t in tl.static_range(FOLDED):   # each folded row set: its rows of the source, folded
        if t == 0:
            QF, DPS, L2, DQ, st, n, padded, one = QF0, DPS0, L20, DQ0, st0, n0, pad0, one0
        else:
            QF, DPS, L2, DQ, st, n, padded, one = QF1, DPS1, L21, DQ1, st1, n1, pad1, one1
        local = r - st
        mine = inside & (local >= 0) & (local < n)
        folded = g * n + local                               # the row in the folded set
        dst = (b * G * n + folded)[:, None] * (HKV * D) + h * D + d[None, :]
        tl.store(QF + dst, q, mask=mine[:, None])
        tl.store(QF + one + dst, do, mask=mine[:, None])
        at = (b * HKV + h) * padded + folded                 # (B, Hkv, padded) buffers
        tl.store(DPS + at, delta, mask=mine)
        tl.store(L2 + at, lse2, mask=mine)
        if ZERO:   # else the caller zeroes the folded sets' accumulators (beside other work)
            tl.store(DQ + at[:, None] * D + d[None, :], tl.zeros([BR, D], dtype=acc_t), mask=mine[:, None])
        if (tl.program_id(0) == 0) & (g == 0):               # the padding rows past G·n, once per kv head
            for i in tl.static_range(PAD // BR):
                pad = G * n + i * BR + tl.arange(0, BR).to(tl.int64)
                live = pad < padded
                pat = (b * HKV + h) * padded + pad
                tl.store(DPS + pat, tl.zeros([BR], dtype=acc_t), mask=live)
                tl.store(L2 + pat, tl.full([BR], float("inf"), dtype=acc_t), mask=live)
                if ZERO:
                    tl.store(DQ + pat[:, None] * D + d[None, :], tl.zeros([BR, D], dtype=acc_t), mask=live[:, None])
    if UNFOLDED:   # the whole source's rows as an unfolded set: FA4's preprocess of them, (B, H, padded) buffers
        at = (b * HKV * G + head) * padu + r
        tl.store(DPSU + at, delta, mask=inside)
        tl.store(L2U + at, lse2, mask=inside)
        tl.store(DQU + at[:, None] * D + d[None, :], tl.zeros([BR, D], dtype=acc_t), mask=inside[:, None])
        if tl.program_id(0) == 0:                            # the padding rows past the source's, per head
            for i in tl.static_range(PAD // BR):
                pad = rows + i * BR + tl.arange(0, BR).to(tl.int64)
                live = pad < padu
                pat = (b * HKV * G + head) * padu + pad
                tl.store(DPSU + pat, tl.zeros([BR], dtype=acc_t), mask=live)
                tl.store(L2U + pat, tl.full([BR], float("inf"), dtype=acc_t), mask=live)
                tl.store(DQU + pat[:, None] * D + d[None, :], tl.zeros([BR, D], dtype=acc_t), mask=live[:, None])


_FOLD_PRE = CachedLaunch(_fold_pre_kernel)
MAX_FOLDED = 2   # folded row sets one pass writes (zigzag's ranks have at most two: every row, the second half)


def _bufs_take(bufs, b, heads, rows, dim, device) -> bool:
    """FA4's preprocess buffers of a set of ``rows`` rows over ``heads`` heads: delta and LSE log2 ``(B, heads,
    padded)``, dQ's accumulator ``(B, heads, padded · D)``, contiguous, padded at most ``PAD_ROWS`` past."""
    dpsum, lse2, dq = bufs
    padded = dpsum.shape[-1]
    return (dpsum.shape == lse2.shape == (b, heads, padded) and dq.shape == (b, heads, padded * dim)
            and 0 <= padded - rows <= PAD_ROWS and dpsum.dtype == lse2.dtype == dq.dtype
            and all(t.is_contiguous() and t.device == device for t in bufs))


def sets_take(tensors, lse, kv_heads: int, folded, unfolded=None) -> bool:
    """``preprocess_sets_`` applies: q, out and dO ``(B, rows, H, D)`` as ``fold_takes`` wants them, the LSE
    ``(B, H, rows)``; ``folded``: up to ``MAX_FOLDED`` of ``(start, n, bufs)``, rows ``start`` … ``start + n``
    of the source in range, ``bufs`` over G·n rows and the kv heads; ``unfolded``: None or the source's own
    rows' ``bufs`` over the q heads (``_bufs_take``), all of one float dtype."""
    if len(tensors) != 3 or not fold_takes(tensors, kv_heads) or not 0 < len(folded) + bool(unfolded):
        return False
    b, rows, heads, dim = tensors[0].shape
    group, dev = heads // kv_heads, lse.device
    acc = [bufs[0].dtype for *_, bufs in folded] + ([unfolded[0].dtype] if unfolded else [])
    return (lse.shape == (b, heads, rows) and lse.dtype in (torch.float32, torch.float64) and len(set(acc)) == 1
            and len(folded) <= MAX_FOLDED and dev == tensors[0].device
            and all(0 <= start and n > 0 and start + n <= rows and _bufs_take(bufs, b, kv_heads, group * n, dim, dev)
                    for start, n, bufs in folded)
            and (unfolded is None or _bufs_take(unfolded, b, heads, rows, dim, dev)))


def preprocess_sets_(tensors, lse, kv_heads: int, folded, unfolded=None, checked: bool = False,
                     zero_folded: bool = True):
    """FA4's backward preprocess of several row sets of one shard in one launch (``sets_take``): each folded
    set's fold of q and dO (``fa4_ring_backward.fold_heads`` of its rows) with its delta, LSE log2 and zeroed dQ
    accumulator, and with ``unfolded`` the source rows' own (unfolded) ones — q, out and dO read once. Returns
    ``[folded q, folded dO]`` per folded set, views into one buffer each. ``checked``: ``sets_take`` asked.
    ``zero_folded=False``: the folded sets' dQ accumulators are left as they are (the caller zeroes them, e.g.
    on a side stream: ``FA4RingBackward._preprocess_once``)."""
    if not checked and not sets_take(tensors, lse, kv_heads, folded, unfolded):
        raise ValueError("preprocess_sets_: q, out, dO (B, rows, H, D) of one layout, LSE (B, H, rows), up to "
                         f"{MAX_FOLDED} folded sets (start, n, FA4's delta, LSE log2 (B, Hkv, padded) and dQ "
                         "accumulator (B, Hkv, padded·D)) within the rows, and/or the rows' unfolded buffers")
    q, out, dout = tensors
    b, rows, heads, dim = q.shape
    group = heads // kv_heads
    outs, targets, scalars = [], [], []
    for start, n, bufs in folded:
        buf = torch.empty((2, b, group * n, kv_heads, dim), dtype=q.dtype, device=q.device)
        outs.append(list(buf.unbind(0)))
        targets += [buf, *bufs]
        scalars += [start, n, bufs[0].shape[-1], buf[0].numel()]
    while len(targets) < 4 * MAX_FOLDED:   # absent sets: never read (FOLDED), any tensor of the launch's kind
        targets += targets[-4:] if targets else [q, *unfolded]
        scalars += [0, 0, 0, 0]
    targets += list(unfolded or folded[0][2])
    launch_keyed(_FOLD_PRE, (cdiv(rows, ROWS), heads, b), (q, out, dout, lse, *targets),
                 (*q.stride()[:3], *lse.stride(), rows, kv_heads, *scalars,
                  unfolded[0].shape[-1] if unfolded else 0),
                 dict(G=group, D=dim, BR=ROWS, PAD=PAD_ROWS, FOLDED=len(folded), UNFOLDED=unfolded is not None,
                      ZERO=zero_folded, num_warps=4))
    return outs


def fold_pre_takes(tensors, lse, kv_heads: int, bufs) -> bool:
    """``fold_preprocess_`` applies (``sets_take`` with one folded set: every row of the tensors)."""
    return len(tensors) == 3 and sets_take(tensors, lse, kv_heads, [(0, tensors[0].shape[1], bufs)])


def fold_preprocess_(tensors, lse, kv_heads: int, bufs, checked: bool = False):
    """The fold of q and dO (``fa4_ring_backward.fold_heads``) and FA4's backward preprocess of the folded set
    (``bufs`` = delta, LSE log2, dQ accumulator, written), in one launch (``fold_pre_takes``). Returns
    ``[folded q, folded dO]``, views into one buffer. ``checked``: the caller has asked ``fold_pre_takes``."""
    if not checked and not fold_pre_takes(tensors, lse, kv_heads, bufs):
        raise ValueError("fold_preprocess_: q, out, dO (B, rows, H, D) of one layout, LSE (B, H, rows), and FA4's "
                         "delta, LSE log2 (B, Hkv, padded) and dQ accumulator (B, Hkv, padded·D), contiguous")
    return preprocess_sets_(tensors, lse, kv_heads, [(0, tensors[0].shape[1], bufs)], None, True)[0]


def main(argv=None):
    """The one pass against the fold and FA4's preprocess at a W=8 S32768 rank's folded row sets (2048 and 4096
    of 4096 rows, 32 q / 8 kv heads, bf16): GPU and wall µs, GB/s of the bytes each must move; FA4 absent, the
    fold alone beside it."""
    from distlab.bench import write_json
    from distlab.kernels import fa4
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.kernels.bench import bandwidth_cells, bandwidth_row
    from distlab.kernels.triton_ring_glue import bench_start, fold_heads_

    a, dev, copy, g, full = bench_start("triton_fold_preprocess", main.__doc__, "the fold-and-preprocess benchmark",
                                        "fold_pre", argv)
    s, h, kvh, dim, bf16 = a.shard, a.heads, a.kv_heads, 128, torch.bfloat16
    with_fa4 = fa4.runs_on(dev, bf16)
    lse = torch.randn(1, h, s, device=dev, generator=g) + 5
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; shard {s}, heads {h} (kv {kvh}), head_dim {dim}, bf16"
          + ("" if with_fa4 else "; FA4 absent: the fold alone against the one pass"))
    print(f"{'rows':>5} {'pass':<26} {'GPU us':>8} {'wall us':>8} {'GB/s':>7} {'% copy':>7}")
    results = []
    for rows in (slice(s // 2, s), slice(0, s)):
        n = rows.stop - rows.start
        tensors = [t[:, rows] for t in full]
        rec = frb._record(1, n * h // kvh, n, kvh, kvh, dim, bf16, dev, False, dim ** -0.5) if with_fa4 else None
        bufs = frb.preprocess_buffers(rec, full[0]) if rec else (
            torch.empty(1, kvh, n * h // kvh, device=dev), torch.empty(1, kvh, n * h // kvh, device=dev),
            torch.empty(1, kvh, n * h // kvh * dim, device=dev))
        tensor_bytes, acc_bytes = tensors[0].numel() * 2, bufs[2].numel() * 4
        cases = [("fold_preprocess_ (one pass)", 3 * tensor_bytes + 2 * tensor_bytes + acc_bytes,
                  lambda: fold_preprocess_(tensors, lse[:, :, rows], kvh, bufs))]
        if rec:
            (pre_fn, pre_args) = rec[0]
            folded_lse = lse[:, :, rows].reshape(1, kvh, -1)

            def two_passes():
                _, o, do = fold_heads_(tensors, kvh)
                pre_fn(o, do, bufs[0], folded_lse, bufs[1], bufs[2], *pre_args[6:])
            cases.append(("fold_heads_ + FA4 preprocess", 6 * tensor_bytes + 2 * tensor_bytes + acc_bytes, two_passes))
        else:
            cases.append(("fold_heads_ (3 tensors)", 6 * tensor_bytes, lambda: fold_heads_(tensors, kvh)))
        for name, moved, fn in cases:
            row = {"rows": n, "pass": name, **bandwidth_row(fn, moved, copy, a.iters, a.warmup, dev)}
            results.append(row)
            print(f"{n:>5} {name:<26} {bandwidth_cells(row)}", flush=True)
    if a.json:
        write_json(a.json, {"copy_GB_s": copy / 1e9, "shard": s, "heads": h, "kv_heads": kvh, "fa4": with_fa4,
                            "rows": results})


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
