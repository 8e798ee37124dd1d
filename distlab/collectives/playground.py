"""A collectives playground that reads like nccl-tests: size sweep, algbw/busbw, #wrong, both placements.

    distlab run --nproc 8 -m distlab.collectives --op all -b 8 -e 1G -f 2 --json c.json --plot c.png
    torchrun --nproc-per-node 8 -m distlab.collectives --op all_reduce --algo Ring --proto Simple
    distlab run --nproc 4 -m distlab.collectives --op all -e 1M          # CPU: gloo, correctness only

The sweep takes nccl-tests' own flags: ``-b/--minbytes``, ``-e/--maxbytes``, ``-f/--stepfactor``,
``-n/--iters``, ``-w/--warmup_iters``, ``-c/--check 0|1``, ``-d/--datatype`` (float, half, bfloat16,
double, int32, or fp32/bf16/... as every distlab study spells them).

Conventions follow nccl-tests so numbers can be compared line by line:

- ``size`` is the bytes of the largest buffer: the buffer for all_reduce and broadcast, the gathered
  output for all_gather, the input for reduce_scatter and all_to_all, the message for sendrecv; counts are
  rounded down to a multiple of the world size where the op splits its buffer.
- ``algbw = size / time`` and ``busbw = algbw × factor`` with GB = 1e9 bytes; factors: all_reduce
  2(n−1)/n; all_gather, reduce_scatter, all_to_all (n−1)/n; broadcast and sendrecv 1.
- ``time`` is the mean of ``--iters`` back-to-back calls after ``--warmup`` (CUDA events on GPU), the max
  over ranks.
- ``#wrong`` counts wrong elements over all ranks after one checked call, with integer-valued inputs
  (rank r, element i holds 1 + (3r + i) mod 7) so every sum is exact in every dtype, bf16 included.
- Placements: out-of-place uses separate buffers; in-place uses nccl-tests' aliasing (all_gather's input
  is this rank's slice of the output, reduce_scatter's output is this rank's slice of the input,
  all_reduce and broadcast reuse one buffer). torch has no in-place all_to_all or sendrecv: ``n/a``.

``--algo``/``--proto`` set ``NCCL_ALGO``/``NCCL_PROTO`` before the process group starts (refused on gloo,
which has neither). On gloo (CPU) the sweep runs too, labelled correctness-only: its times are not NCCL's.
Before allocating, the sweep's largest buffers are checked against the memory free on the device (on a
CPU, shared by every local rank).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from distlab.comm import COLLECTIVES, bus_factor
from distlab.bench import (StudyParser, check_memory, dtype_arg, fmt_bytes, nonnegative_int,
                           positive_int, pyplot, to_dtype, write_json)

OPS = COLLECTIVES
NCCL_TYPE_NAMES = {"float32": "float", "float16": "half", "bfloat16": "bfloat16", "float64": "double", "int32": "int32"}


def bandwidths(op: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9) for ``size_bytes`` moved by ``op`` in ``seconds`` on ``n`` ranks."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, n)


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``64K``, ``1M``, ``1G`` (powers of 2, as nccl-tests reads them)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("B")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with K, M or G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return value


def datatype(text: str) -> str:
    """nccl-tests' type names (float, half, bfloat16, double, int32) or distlab's spellings -> canonical."""
    if text.lower() == "int32":
        return "int32"
    return dtype_arg()(text)


def torch_dtype(name: str) -> torch.dtype:
    return torch.int32 if name == "int32" else to_dtype(name)


def sweep_sizes(lo: int, hi: int, factor: int) -> list[int]:
    if lo > hi:
        raise ValueError(f"-b/--minbytes {lo} is larger than -e/--maxbytes {hi}: nothing to sweep")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def peak_bytes(op: str, size: int, n: int) -> int:
    """This rank's buffers for one case of ``op`` at ``size`` bytes: input, output, its fresh copy and the
    float64 expected result (4 bytes per 8-byte element in the worst dtype ratio, counted generously)."""
    inp = size if op != "all_gather" else size // n
    return 3 * inp + size + 2 * size


def pattern(rank: int, count: int, dtype, device) -> torch.Tensor:
    """Integer-valued input of rank ``rank``: 1 + (3·rank + i) mod 7 (exact sums in any dtype)."""
    return (1 + (3 * rank + torch.arange(count, device=device)) % 7).to(dtype)


def _gather_fn():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Case:
    """Buffers, the call and the expected result of one op at one count and placement on this rank."""

    def __init__(self, op, count, dtype, device, rank, n, in_place, corrupt=False):
        self.op, self.rank, self.n = op, rank, n
        per = count // n
        if op == "all_reduce":
            self.inp = pattern(rank, count, dtype, device)
            self.out = self.inp if in_place else torch.empty_like(self.inp)
            self.want = sum(pattern(r, count, torch.float64, device) for r in range(n))
        elif op == "all_gather":
            self.out = torch.empty(per * n, dtype=dtype, device=device)
            self.inp = self.out[rank * per:(rank + 1) * per] if in_place else torch.empty(per, dtype=dtype, device=device)
            self.inp.copy_(pattern(rank, per, dtype, device))
            self.want = torch.cat([pattern(r, per, torch.float64, device) for r in range(n)])
        elif op == "reduce_scatter":
            self.inp = pattern(rank, per * n, dtype, device)
            self.out = self.inp[rank * per:(rank + 1) * per] if in_place else torch.empty(per, dtype=dtype, device=device)
            self.want = sum(pattern(r, per * n, torch.float64, device) for r in range(n))[rank * per:(rank + 1) * per]
        elif op == "all_to_all":
            self.inp = pattern(rank, per * n, dtype, device)
            self.out = torch.empty_like(self.inp)
            self.want = torch.cat([pattern(r, per * n, torch.float64, device)[rank * per:(rank + 1) * per]
                                   for r in range(n)])
        elif op == "broadcast":
            self.inp = pattern(rank, count, dtype, device)
            self.out = self.inp
            self.want = pattern(0, count, torch.float64, device)
        elif op == "sendrecv":
            self.inp = pattern(rank, count, dtype, device)
            self.out = torch.empty_like(self.inp)
            self.want = pattern((rank - 1) % n, count, torch.float64, device)
        self.in_place = in_place
        if corrupt:  # a deliberately wrong input on this rank, to show that #wrong can fire
            self.inp.view(-1)[0] += 1
        self.fresh = self.inp.clone()

    def reset(self):
        self.inp.copy_(self.fresh)

    def __call__(self):
        op, n = self.op, self.n
        if op == "all_reduce":
            if self.out is not self.inp:
                self.out.copy_(self.inp)       # torch's all_reduce is in-place: the copy is part of out-of-place
            dist.all_reduce(self.out)
        elif op == "all_gather":
            _gather_fn()(self.out, self.inp)
        elif op == "reduce_scatter":
            _scatter_fn()(self.out, self.inp)
        elif op == "all_to_all":
            dist.all_to_all_single(self.out, self.inp)
        elif op == "broadcast":
            dist.broadcast(self.out, 0)
        elif op == "sendrecv":
            ops = [dist.P2POp(dist.isend, self.inp, (self.rank + 1) % n), dist.P2POp(dist.irecv, self.out, (self.rank - 1) % n)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def wrong(self) -> int:
        return int((self.out.double() != self.want).sum().item())


def size_bytes(op, count, elem, n):
    per = count // n
    return (per * n if op in ("all_gather", "reduce_scatter", "all_to_all") else count) * elem


def time_case(case, iters, warmup, device) -> float:
    for _ in range(warmup):
        case()
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        for _ in range(iters):
            case()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / iters
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        case()
    return (time.perf_counter() - t0) / iters


def sweep(op, sizes, dtype, device, iters, warmup, check=True, corrupt_rank=-1):
    """Rows of the table for ``op``: one per size, both placements; every rank returns the same rows."""
    rank, n = dist.get_rank(), dist.get_world_size()
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for size in sizes:
        count = max(1, size // elem)
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            count = max(n, count // n * n)
        row = {"op": op, "size": size_bytes(op, count, elem, n), "count": count,
               "type": NCCL_TYPE_NAMES[str(dtype).split(".")[-1]]}
        if rows and row["size"] == rows[-1]["size"]:
            continue   # sizes below one element per rank round to the same buffer: one row, not several
        for placement in ("out", "in"):
            if placement == "in" and op in ("all_to_all", "sendrecv"):
                row[placement] = None
                continue
            case = Case(op, count, dtype, device, rank, n, placement == "in", corrupt=(rank == corrupt_rank))
            wrong = -1
            if check:
                case()
                wrong = case.wrong()
                case.reset()
            seconds = time_case(case, iters, warmup, device)
            stats = torch.tensor([seconds, max(wrong, 0)], dtype=torch.float64, device=device)
            t = stats[:1].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            w = stats[1:].clone()
            dist.all_reduce(w)
            algbw, busbw = bandwidths(op, row["size"], t.item(), n)
            row[placement] = {"time_us": t.item() * 1e6, "algbw": algbw, "busbw": busbw,
                              "wrong": int(w.item()) if check else None}
        rows.append(row)
    return rows


def format_table(rows, title) -> str:
    def cells(p):
        if p is None:
            return f"{'n/a':>8} {'':>7} {'':>7} {'':>6}"
        wrong = "N/A" if p["wrong"] is None else str(p["wrong"])
        return f"{p['time_us']:>8.1f} {p['algbw']:>7.2f} {p['busbw']:>7.2f} {wrong:>6}"

    lines = [f"# {title}",
             f"#{'':>12} {'':>12} {'':>8}   {'out-of-place':^32}   {'in-place':^32}",
             f"#{'size':>12} {'count':>12} {'type':>8}   {'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
             f"   {'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>6}",
             f"#{'(B)':>12} {'(elements)':>12} {'':>8}   {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
             f"   {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"]
    for r in rows:
        lines.append(f" {r['size']:>12} {r['count']:>12} {r['type']:>8}   {cells(r['out'])}   {cells(r['in'])}")
    placements = [p for r in rows for p in (r["out"], r["in"]) if p is not None]
    wrong = sum(p["wrong"] or 0 for p in placements)
    avg = sum(p["busbw"] for p in placements) / max(1, len(placements))
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {avg:.4f}")
    return "\n".join(lines)


def plot(results, path, title):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for op, rows in results.items():
        ax.plot([r["size"] for r in rows], [r["out"]["busbw"] for r in rows], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw, out-of-place (GB/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv=None):
    p = StudyParser(prog="python -m distlab.collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="all", help=f"one of {', '.join(OPS)}, a comma list, or all")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size in bytes (K/M/G suffixes)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=None,
                   help="largest size (default: 1G on GPU, 1M on CPU)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step (>= 2)")
    p.add_argument("-d", "--datatype", "--dtype", dest="dtype", type=datatype, default="float32",
                   help="float (fp32), half, bfloat16, double, int32")
    p.add_argument("-n", "--iters", type=positive_int, default=None, help="timed calls per size (default: 20 GPU, 5 CPU)")
    p.add_argument("-w", "--warmup_iters", dest="warmup", type=nonnegative_int, default=5)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="1: count #wrong (default), 0: skip")
    p.add_argument("--algo", default=None, help="NCCL_ALGO (e.g. Ring, Tree) for this run")
    p.add_argument("--proto", default=None, help="NCCL_PROTO (e.g. Simple, LL, LL128) for this run")
    p.add_argument("--device", default=None)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--profile", choices=("none", "torch", "nsys"), default="none",
                   help="trace a few calls of each op at the largest size")
    p.add_argument("--profile-dir", default="traces/collectives")
    p.add_argument("--corrupt-rank", type=int, default=-1, help=argparse.SUPPRESS)  # shows #wrong firing
    args = p.parse_args(argv)
    ops = OPS if args.op == "all" else tuple(args.op.split(","))
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        p.error(f"--op: unknown {', '.join(unknown)} (choose from {', '.join(OPS)}, or all)")
    if args.stepfactor < 2:
        p.error(f"-f/--stepfactor {args.stepfactor}: the size must grow, use 2 or more")
    args.ops = ops
    return args


def main(argv=None):
    args = parse_args(argv)
    from distlab.bench import resolve_device
    from distlab.runtime import init_runtime, shutdown

    if (args.algo or args.proto) and resolve_device(args.device).type != "cuda":
        raise ValueError("--algo/--proto set NCCL_ALGO/NCCL_PROTO, and this run uses gloo (no GPU), which has "
                         "neither; drop them, or run on GPUs")
    if args.algo:
        os.environ["NCCL_ALGO"] = args.algo      # before the process group (and NCCL) starts
    if args.proto:
        os.environ["NCCL_PROTO"] = args.proto
    rt = init_runtime(device=args.device)
    gpu = rt.device.type == "cuda"
    hi = args.maxbytes or (2**30 if gpu else 2**20)
    sizes = sweep_sizes(args.minbytes, hi, args.stepfactor)
    check_memory(max(peak_bytes(op, hi, rt.world_size) for op in args.ops), rt.device,
                 f"the sweep up to {fmt_bytes(hi)} ({', '.join(args.ops)})")
    iters = args.iters or (20 if gpu else 5)
    dtype = torch_dtype(args.dtype)
    results = {}
    for op in args.ops:
        results[op] = sweep(op, sizes, dtype, rt.device, iters, args.warmup, bool(args.check), args.corrupt_rank)
        if args.profile != "none":
            from distlab.profiling import phase, profile_steps

            count = results[op][-1]["count"]
            case = Case(op, count, dtype, rt.device, rt.rank, rt.world_size, in_place=False)

            def traced(case=case, op=op):
                with phase(f"comm.{op}"):
                    case()

            profile_steps(traced, args.profile, os.path.join(args.profile_dir, op), rt.rank)
    if rt.is_main:
        label = (f"nccl{' NCCL_ALGO=' + args.algo if args.algo else ''}{' NCCL_PROTO=' + args.proto if args.proto else ''}"
                 if rt.backend == "nccl" else "gloo")
        if rt.backend != "nccl":
            print("# gloo on CPU: a correctness check (#wrong); its times are not NCCL's")
        for op, rows in results.items():
            print(format_table(rows, f"{op}, {rt.world_size} ranks, {rt.device.type}, {label}"))
            print()
        if args.json:
            write_json(args.json, {"world_size": rt.world_size, "backend": rt.backend, "device": str(rt.device),
                                   "args": vars(args), "results": results})
        if args.plot:
            plot(results, args.plot, f"busbw, {rt.world_size} ranks, {rt.device.type} ({label}), {args.dtype}")
    wrong = sum((p or {}).get("wrong") or 0 for rows in results.values() for r in rows for p in (r["out"], r["in"]))
    shutdown()
    if wrong:
        sys.exit(1)
