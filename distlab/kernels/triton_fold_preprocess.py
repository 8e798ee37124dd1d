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
the float32 accumulator, against read 3 + write 3 and read 2 + write the accumulator.
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
def _fold_pre_kernel(Q, O, DO, LSE, QF, DPSUM, LSE2, DQ, sb, sr, sh, lb, lh, ls, rows, HKV, padded, one,
                     G: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, PAD: tl.constexpr):
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h, g = head // G, head % G
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    d = tl.arange(0, D)
    inside = r < rows
    src = b * sb + r[:, None] * sr + head * sh + d[None, :]
    folded = g * rows + r                                    # the row in the folded set
    dst = (b * G * rows + folded)[:, None] * (HKV * D) + h * D + d[None, :]
    tl.store(QF + dst, tl.load(Q + src, mask=inside[:, None]), mask=inside[:, None])
    do = tl.load(DO + src, mask=inside[:, None], other=0.0)
    tl.store(QF + one + dst, do, mask=inside[:, None])
    o = tl.load(O + src, mask=inside[:, None], other=0.0)
    acc_t = DPSUM.dtype.element_ty
    delta = tl.sum(o.to(acc_t) * do.to(acc_t), axis=1)
    at = (b * HKV + h) * padded + folded                     # (B, Hkv, padded) buffers
    tl.store(DPSUM + at, delta, mask=inside)
    lse = tl.load(LSE + b * lb + head * lh + r * ls, mask=inside, other=0.0)
    tl.store(LSE2 + at, tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634), mask=inside)
    tl.store(DQ + at[:, None] * D + d[None, :], tl.zeros([BR, D], dtype=DQ.dtype.element_ty), mask=inside[:, None])
    if (tl.program_id(0) == 0) & (g == 0):                   # the padding rows past G·rows, once per kv head
        for i in tl.static_range(PAD // BR):
            pad = G * rows + i * BR + tl.arange(0, BR).to(tl.int64)
            live = pad < padded
            pat = (b * HKV + h) * padded + pad
            tl.store(DPSUM + pat, tl.zeros([BR], dtype=acc_t), mask=live)
            tl.store(LSE2 + pat, tl.full([BR], float("inf"), dtype=LSE2.dtype.element_ty), mask=live)
            tl.store(DQ + pat[:, None] * D + d[None, :], tl.zeros([BR, D], dtype=DQ.dtype.element_ty),
                     mask=live[:, None])


_FOLD_PRE = CachedLaunch(_fold_pre_kernel)


def fold_pre_takes(tensors, lse, kv_heads: int, bufs) -> bool:
    """``fold_preprocess_`` applies: q, out and dO ``(B, rows, H, D)`` as ``fold_takes`` wants them, the LSE
    ``(B, H, rows)``, and ``bufs`` = (delta, LSE log2, dQ accumulator) contiguous, ``(B, Hkv, padded)`` twice and
    ``(B, Hkv, padded · D)``, padded at most ``PAD_ROWS`` past the folded rows."""
    if len(tensors) != 3 or not fold_takes(tensors, kv_heads):
        return False
    b, rows, heads, dim = tensors[0].shape
    dpsum, lse2, dq = bufs
    padded = dpsum.shape[-1]
    return (lse.shape == (b, heads, rows) and lse.dtype in (torch.float32, torch.float64)
            and dpsum.shape == lse2.shape == (b, kv_heads, padded) and dq.shape == (b, kv_heads, padded * dim)
            and 0 <= padded - heads // kv_heads * rows <= PAD_ROWS
            and all(t.is_contiguous() and t.device == lse.device == tensors[0].device for t in bufs))


def fold_preprocess_(tensors, lse, kv_heads: int, bufs, checked: bool = False):
    """The fold of q and dO (``fa4_ring_backward.fold_heads``) and FA4's backward preprocess of the folded set
    (``bufs`` = delta, LSE log2, dQ accumulator, written), in one launch (``fold_pre_takes``). Returns
    ``[folded q, folded dO]``, views into one buffer. ``checked``: the caller has asked ``fold_pre_takes``."""
    if not checked and not fold_pre_takes(tensors, lse, kv_heads, bufs):
        raise ValueError("fold_preprocess_: q, out, dO (B, rows, H, D) of one layout, LSE (B, H, rows), and FA4's "
                         "delta, LSE log2 (B, Hkv, padded) and dQ accumulator (B, Hkv, padded·D), contiguous")
    q, out, dout = tensors
    b, rows, heads, dim = q.shape
    group = heads // kv_heads
    folded = torch.empty((2, b, group * rows, kv_heads, dim), dtype=q.dtype, device=q.device)
    dpsum, lse2, dq = bufs
    launch_keyed(_FOLD_PRE, (cdiv(rows, ROWS), heads, b), (q, out, dout, lse, folded, dpsum, lse2, dq),
                 (*q.stride()[:3], *lse.stride(), rows, kv_heads, dpsum.shape[-1], folded[0].numel()),
                 dict(G=group, D=dim, BR=ROWS, PAD=PAD_ROWS, num_warps=4))
    return list(folded.unbind(0))


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
