"""A FA4 ring rank's dQ finished in one pass: its row sets' float32 accumulators read in FA4's tile order,
summed, scaled and written once in q's dtype (#24; knob ``DISTLAB_FA4_RING_DQ_FUSED``, on by default: H100 S8192,
the slowest rank's f+b 75.2 -> 76.8% GPU clock, 74.7 -> 76.2% wall, ``docs/PERF.md``).

    TRITON_INTERPRET=1 python -m pytest -q tests/test_fa4_ring_backward.py -k dq_finish   # CPU, the interpreter
    python -m distlab.kernels.triton_dq_finish --json dq_finish.json   # FA4 on an sm90+ GPU: the sweep, timed

``FA4RingBackward`` keeps one float32 dQ accumulator per row set of the rank's blocks (zigzag's middle ranks
have three: all rows causal, all rows, the second half), each in the layout of its own FA4 kernel's row tile
(64 rows causal, 80 not, at head_dim 128; each tile's values stored in the order the MMA's threads hold them).
``dq()`` converts each with FA4's postprocess and adds the parts in q's dtype: on the H100 at S8192 (rank 1,
``docs/PERF.md``) three postprocesses and two adds, ~45 µs of GPU time and five launches after the last main
kernel. Here one kernel reads every set's accumulator where it holds a row, adds in float32 and rounds once.

The tile order is not written down anywhere this code can read for the sm90 kernels, so it is *measured*:
``window_order`` runs the recorded postprocess once on an accumulator of ``WINDOW`` rows whose values are the
digits of each element's own offset, four bits a pass (exact in bf16), and reads back where each landed.
``WINDOW`` is a multiple of every tile height FA4 uses (64, 80, 128; 4 and 6 for the CPU's stand-ins), so a
row's offset is ``(row // WINDOW) * WINDOW * dim + order[row % WINDOW, d]`` whatever the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distlab.kernels.launch import CachedLaunch, cdiv, knob, num_warps, pointer_key

WINDOW = 1920   # lcm(64, 80, 128, 6): rows over which a tile order is measured and repeats
MAX_SETS = 3   # FA4RingBackward._dq_fusable asks for no more
ROWS, WARPS = 16, 4   # rows a program, warps: the defaults (``main`` sweeps them)
_ORDERS: dict = {}


class TileOrderUnknown(RuntimeError):
    """A postprocess whose tile order ``window_order`` cannot read (``FA4RingBackward.dq`` falls back)."""


def window_order(post, dim: int, dtype, device):
    """``(WINDOW * dim,)`` int32: the accumulator offset that FA4's postprocess ``post`` (``(fn, args)``,
    recorded) reads for each (row, d) of a ``WINDOW``-row block, measured once per postprocess. Raises
    ``TileOrderUnknown`` if it takes more tensors or what comes back is not a permutation."""
    fn, args = post
    key = (id(fn), dim, dtype, device)
    if key in _ORDERS:
        return _ORDERS[key][1]
    if any(isinstance(a, torch.Tensor) for a in args[3:]):
        raise TileOrderUnknown("window_order: the postprocess takes tensors beyond its accumulator and output")
    size = WINDOW * dim
    offsets = torch.arange(size, device=device, dtype=torch.int64)
    got = torch.zeros(size, dtype=torch.int64, device=device)
    for shift in range(0, max(size - 1, 1).bit_length(), 4):   # one 4-bit digit a pass: exact in any float
        acc = ((offsets >> shift) & 15).to(torch.float32).view(1, 1, size)
        out = torch.empty(1, WINDOW, 1, dim, dtype=dtype, device=device)
        fn(acc, out, 1.0, *args[3:])
        got += out.reshape(size).float().round().long() << shift
    if not torch.equal(torch.sort(got).values, offsets):
        raise TileOrderUnknown("window_order: FA4's postprocess did not move each accumulator value to one place")
    order = got.to(torch.int32)
    _ORDERS[key] = (fn, order)   # fn held: its id stays its own
    return order


def identity_order(dim: int, device):
    """The ``window_order`` of a head-major float32 buffer ``(batch, heads, rows · dim)`` whose rows are in order
    (``FA4RingBackward._dq_early``'s partial sum): offset = row · dim + d."""
    key = ("identity", dim, device)
    if key not in _ORDERS:
        _ORDERS[key] = (None, torch.arange(WINDOW * dim, dtype=torch.int32, device=device))
    return _ORDERS[key][1]


@triton.jit
def _dq_finish_kernel(OUT, A0, P0, A1, P1, A2, P2, scale, so_b, so_r, so_h,
                      sb0, sh0, st0, n0, g0, sb1, sh1, st1, n1, g1, sb2, sh2, st2, n2, g2, rows,
                      H: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, BR: tl.constexpr, SETS: tl.constexpr,
                      WIN: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    d = tl.arange(0, DB)[None, :]
    dmask = (r < rows) & (d < D)
    acc = tl.zeros([BR, DB], dtype=tl.float32)
    for s in tl.static_range(SETS):
        if s == 0:
            A, P, sb, sh, st, n, g = A0, P0, sb0, sh0, st0, n0, g0
        elif s == 1:
            A, P, sb, sh, st, n, g = A1, P1, sb1, sh1, st1, n1, g1
        else:
            A, P, sb, sh, st, n, g = A2, P2, sb2, sh2, st2, n2, g2
        local = r - st
        inside = dmask & (local >= 0) & (local < n)
        row = (h % g) * n + local   # a folded set: q head h's rows follow its kv head's earlier q heads'
        row = tl.where(inside, row, 0)
        off = tl.load(P + (row % WIN) * D + d, mask=inside, other=0).to(tl.int64)
        off += (row // WIN).to(tl.int64) * (WIN * D)
        acc += tl.load(A + b * sb + (h // g).to(tl.int64) * sh + off, mask=inside, other=0.0)
    out = OUT + b * so_b + r.to(tl.int64) * so_r + h.to(tl.int64) * so_h + d
    tl.store(out, (acc * scale).to(OUT.dtype.element_ty), mask=dmask)


_LAUNCH = CachedLaunch(_dq_finish_kernel)


def dq_finish(out, sets, scale: float, rows_per_program: int | None = None, warps: int | None = None):
    """``out`` (batch, rows, heads, dim; last dimension contiguous) = ``scale`` × the sum, per row, of the sets
    that hold it. ``sets``: up to ``MAX_SETS`` of ``(accum, order, start, n, group)`` — ``accum`` (batch,
    acc_heads, rows_padded · dim) float32 with a contiguous last dimension, ``order`` its ``window_order``,
    rows ``start`` … ``start + n`` of ``out`` (``start`` below 0: a set whose rows begin before ``out``'s, as
    ``FA4RingBackward._dq_early`` cuts a row range out), ``group`` q heads per accumulator head (1; G where folded).
    ``rows_per_program`` / ``warps``: knobs ``KERNEL_DQ_ROWS`` / ``KERNEL_WARPS``, else ``ROWS`` / ``WARPS``
    (the sweep of ``main``)."""
    if not 1 <= len(sets) <= MAX_SETS:
        raise ValueError(f"dq_finish: 1 to {MAX_SETS} row sets, got {len(sets)}")
    rows_per_program = rows_per_program or knob("DQ_ROWS", ROWS)
    batch, rows, heads, dim = out.shape
    if out.stride(-1) != 1 or any(a.stride(-1) != 1 or a.dtype != torch.float32 for a, *_ in sets):
        raise ValueError("dq_finish: float32 accumulators and an output, each with a contiguous last dimension")
    per = []
    for accum, order, start, n, group in list(sets) + [sets[0]] * (MAX_SETS - len(sets)):
        per.append((accum, order, (accum.stride(0), accum.stride(1), start, n, group)))
    args = (out, per[0][0], per[0][1], per[1][0], per[1][1], per[2][0], per[2][1], float(scale),
            out.stride(0), out.stride(1), out.stride(2), *per[0][2], *per[1][2], *per[2][2], rows)
    meta = dict(H=heads, D=dim, DB=1 << (dim - 1).bit_length(), BR=rows_per_program, SETS=len(sets), WIN=WINDOW,
                num_warps=warps or num_warps(WARPS))
    key = tuple(pointer_key(a) for a in args[:7]) + args[7:] + tuple(meta.values())   # strides: in args[7:]
    _LAUNCH(key, (cdiv(rows, rows_per_program), batch * heads), args, meta)
    return out


def _rank_sets(rows, heads, kv_heads, dim, device):
    """A zigzag middle rank's three row sets at shard length ``rows`` (all rows causal, all rows, the second
    half), each with FA4's recorded dQ postprocess and a random accumulator in its layout."""
    from distlab.kernels import fa4_ring_backward as frb

    sets = []
    for start, causal in ((0, True), (0, False), (rows // 2, False)):
        rec = frb._record(1, rows - start, rows, heads, kv_heads, dim, torch.bfloat16, device, causal, dim ** -0.5)
        accum = torch.randn(rec[3]["dq_accum"], device=device)
        sets.append((accum, rec[2][0], start, rows - start))
    return sets


def main(argv=None):
    """The one-kernel finish against FA4's postprocesses at a W=8 zigzag middle rank's shapes (three row sets),
    over rows a program and warps; GPU and wall clocks, GB/s of the bytes it must move."""
    from distlab.bench import StudyParser, UsageError, add_common_args, device_of, positive_int, write_json
    from distlab.kernels import fa4
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.kernels.bench import bandwidth_cells, bandwidth_row, copy_bandwidth

    p = StudyParser(prog="python -m distlab.kernels.triton_dq_finish", description=main.__doc__.split("\n")[0])
    p.add_argument("--shard", type=positive_int, nargs="+", default=[1024, 4096], help="rows (S8192, S32768 at W=8)")
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[8, 16, 32, 64], help="rows a program")
    p.add_argument("--warps", type=positive_int, nargs="+", default=[2, 4, 8])
    add_common_args(p, iters=50, warmup=5, dtype=False, gpu_tool=True)
    a = p.parse_args(argv)
    dev = device_of(a, "the dQ finish sweep", gpu_tool=True, cpu_hint="its CPU check: TRITON_INTERPRET=1 python "
                    "-m pytest -q tests/test_fa4_ring_backward.py -k dq_finish")
    if not fa4.runs_on(dev, torch.bfloat16):
        raise UsageError("the dQ finish sweep reads FA4's accumulators: it needs flash-attn-4 (the fa4 extra) "
                         "on an sm90+ GPU")
    copy = copy_bandwidth(dev, a.iters, a.warmup)
    dim, results = 128, []
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; heads {a.heads} (kv {a.kv_heads}), head_dim {dim}, bf16")
    print(f"{'shard':>6} {'finish':<16} {'GPU us':>8} {'wall us':>8} {'GB/s':>7} {'% copy':>7} {'max err':>9}")
    for rows in a.shard:
        sets = _rank_sets(rows, a.heads, a.kv_heads, dim, dev)
        fused = [(acc, window_order(post, dim, torch.bfloat16, dev), start, n, 1) for acc, post, start, n in sets]
        scale = sets[0][1][1][2]
        out = torch.empty(1, rows, a.heads, dim, dtype=torch.bfloat16, device=dev)
        moved = sum(n * a.heads * dim * 4 for *_, n in sets) + out.numel() * out.element_size()
        parts = [(acc, post, start, start + n, out[:, start:start + n], False) for acc, post, start, n in sets]
        want = frb.postprocessed_dq(out, parts).float()
        cases = {"postprocesses": lambda: frb.postprocessed_dq(out, parts)}   # FA4RingBackward.dq's fallback
        for r in a.rows:
            for w in a.warps:
                cases[f"one kernel {r}x{w}"] = lambda r=r, w=w: dq_finish(out, fused, scale, r, w)
        for name, fn in cases.items():
            err = (fn().float() - want).abs().max().item()
            row = {"shard": rows, "finish": name, **bandwidth_row(fn, moved, copy, a.iters, a.warmup, dev),
                   "max_err": err}
            results.append(row)
            print(f"{rows:>6} {name:<16} {bandwidth_cells(row)} {err:>9.1e}", flush=True)
    if a.json:
        write_json(a.json, {"copy_GB_s": copy / 1e9, "heads": a.heads, "kv_heads": a.kv_heads, "rows": results})


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
