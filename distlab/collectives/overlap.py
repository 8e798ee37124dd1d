"""Overlap study: a GEMM on the compute stream and a collective on its own stream, serial vs overlapped.

    distlab run --nproc 8 -m distlab.collectives.overlap --op all_reduce --size 256M --gemm 8192
    python -m distlab.collectives.overlap --profile torch --profile-dir traces/   # one GPU: NCCL group of 1
    python -m distlab.profiling.overlap traces/trace_rank0.json                   # what the trace shows

Four timings (median of ``--iters``, CUDA events on GPU):

- GEMM alone (``--gemm N``: an N×N×N matmul, ``--gemms`` of them back to back) on the default stream;
- the collective alone (``--op`` on ``--size`` bytes) launched with ``async_op=True`` from a side stream;
- serial: the collective, waited for, then the GEMMs;
- overlapped: the GEMMs queued on the default stream and the collective on the side stream, then both
  waited for. The GEMMs' own time inside this run is timed too. On GPU the GEMMs are queued first
  (``--order gemm-first``): launching a collective costs the CPU a few hundred µs (measured on the H200,
  see docs/PERF.md), so a collective queued first is mostly done before the GEMMs even reach the GPU.

It reports the overlap achieved, ``(T_serial − T_overlapped) / min(T_gemm, T_comm)`` (100% = the shorter
one entirely hidden), and the compute slowdown, ``T_gemm during the collective / T_gemm alone − 1``: NCCL
kernels occupy SMs, so a GEMM running beside them is slower.

With one rank, NCCL skips the work of an in-place all_reduce (no kernel runs), but a send/recv to
itself still runs NCCL's kernel: ``--op sendrecv`` is how to see a real overlap on a single GPU.

Two collectives on one process group serialise even when launched from different streams: a process
group has one NCCL communicator, whose kernels run in order on its internal stream. Overlapping two
collectives needs two process groups (e.g. ``dist.new_group`` with the same ranks). On CPU (gloo) the
collective runs in gloo's threads while the GEMM runs in the caller's; with several processes per core
this shows mechanics, not hardware.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from distlab.collectives.playground import bandwidths, parse_size
from distlab.profiling import phase, profile_steps
from distlab.runtime import init_runtime, shutdown
from distlab.bench import (DTYPES, StudyParser, add_common_args, check_memory, fmt_bytes, positive_int,
                           run_study)

CPU_MAX_GEMM = 2048   # a 2048^3 GEMM is about a second on a 2-core CPU; larger ones are GPU work

OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")


class Clock:
    """Wall time of a callable: CUDA events on GPU (device time), perf_counter on CPU."""

    def __init__(self, device):
        self.gpu = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.gpu:
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            return start.elapsed_time(stop) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def make_collective(op, size, dtype, device, n):
    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(n, size // elem // n * n)
    if op == "all_reduce":
        buf = torch.ones(count, dtype=dtype, device=device)
        return (lambda: dist.all_reduce(buf, async_op=True)), count * elem
    if op == "all_gather":
        inp, out = torch.ones(count // n, dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: fn(out, inp, async_op=True)), count * elem
    if op == "sendrecv":  # ring neighbour exchange; with one rank NCCL still runs its kernel (to itself)
        inp, out = torch.ones(count, dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device)
        rank = dist.get_rank()

        class _Works:
            def __init__(self):
                self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, (rank + 1) % n),
                                                     dist.P2POp(dist.irecv, out, (rank - 1) % n)])

            def wait(self):
                for w in self.works:
                    w.wait()

        return _Works, count * elem
    inp, out = torch.ones(count, dtype=dtype, device=device), torch.empty(count // n, dtype=dtype, device=device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return (lambda: fn(out, inp, async_op=True)), count * elem


def main(argv=None):
    p = StudyParser(prog="python -m distlab.collectives.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=OPS, default="all_reduce")
    p.add_argument("--size", type=parse_size, default=None, help="collective bytes (default 256M on GPU, 8M on CPU)")
    p.add_argument("--gemm", type=positive_int, default=None, help="GEMM size N (default 8192 on GPU, 384 on CPU)")
    p.add_argument("--gemms", type=positive_int, default=None, help="GEMMs per step (default 4 on GPU, 2 on CPU)")
    p.add_argument("--order", choices=("gemm-first", "comm-first"), default="gemm-first",
                   help="GPU launch order in the overlapped run (see above)")
    add_common_args(p, iters=5, warmup=False, dtypes=("bfloat16", "float32"), profile=True,
                    profile_dir="traces/overlap")
    args = p.parse_args(argv)
    rt = init_runtime(device=args.device)
    gpu = rt.device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bfloat16" if gpu else "float32")]
    n = args.gemm or (8192 if gpu else 384)
    gemms = args.gemms or (4 if gpu else 2)
    size = args.size or (256 * 2**20 if gpu else 8 * 2**20)
    if not gpu and n > CPU_MAX_GEMM:
        raise ValueError(f"--gemm {n} is GPU-sized: one {n}^3 GEMM takes {2 * n**3 / 50e9:.0f} s or more on a CPU; "
                         f"use --gemm {CPU_MAX_GEMM} or less here (the CPU default is 384), or run on a GPU")
    check_memory(2 * size + 3 * n * n * dtype.itemsize, rt.device, f"--size {fmt_bytes(size)} with --gemm {n}")
    a = torch.randn(n, n, device=rt.device).to(dtype)
    b = torch.randn(n, n, device=rt.device).to(dtype)
    launch, nbytes = make_collective(args.op, size, dtype, rt.device, rt.world_size)
    side = torch.cuda.Stream() if gpu else None
    clock = Clock(rt.device)

    def gemm():
        with phase("compute.gemm"):
            for _ in range(gemms):
                a @ b

    def post(after_current=True):
        with phase(f"comm.{args.op}"):
            if side is None:
                return launch()
            if after_current:  # the side stream waits for whatever the compute stream queued so far
                side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                return launch()

    def finish(work):
        work.wait()  # on GPU: makes the current stream wait for the collective
        if gpu:
            torch.cuda.current_stream().wait_stream(side)

    def serial():
        finish(post())
        gemm()

    inside = []

    def overlapped():
        if gpu:  # events on the compute stream; no synchronize here, or the GEMMs would wait for the collective
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if args.order == "comm-first":
                work = post()
            else:
                side.wait_stream(torch.cuda.current_stream())   # inputs ready; then GEMMs, then the collective
            start.record()
            gemm()
            stop.record()
            if args.order == "gemm-first":
                work = post(after_current=False)
            inside.append((start, stop))
        else:
            work = post()
            t0 = time.perf_counter()
            gemm()
            inside.append(time.perf_counter() - t0)
        finish(work)

    def median(fn):
        fn()  # warm-up
        if dist.is_initialized():
            dist.barrier()
        return statistics.median(clock(fn) for _ in range(args.iters))

    t_gemm = median(gemm)
    t_comm = median(lambda: finish(post()))
    t_serial = median(serial)
    inside.clear()
    t_over = median(overlapped)
    if gpu:
        torch.cuda.synchronize()
        inside = [a.elapsed_time(b) / 1e3 for a, b in inside]
    t_inside = statistics.median(inside[1:] or inside)
    trace = profile_steps(overlapped, args.profile, args.profile_dir, rt.rank) if args.profile != "none" else None

    times = torch.tensor([t_gemm, t_comm, t_serial, t_over, t_inside], dtype=torch.float64, device=rt.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    t_gemm, t_comm, t_serial, t_over, t_inside = times.tolist()
    hidden = (t_serial - t_over) / min(t_gemm, t_comm)
    flops = 2 * n**3 * gemms
    algbw, busbw = bandwidths(args.op, nbytes, t_comm, rt.world_size)
    result = {"world_size": rt.world_size, "device": str(rt.device), "backend": rt.backend, "args": vars(args),
              "gemm_s": t_gemm, "comm_s": t_comm, "serial_s": t_serial, "overlapped_s": t_over,
              "gemm_during_comm_s": t_inside, "overlap_achieved": hidden, "compute_slowdown": t_inside / t_gemm - 1,
              "gemm_tflops": flops / t_gemm / 1e12, "comm_algbw": algbw, "comm_busbw": busbw, "trace": trace}
    if rt.is_main:
        print(f"overlap: {gemms} x GEMM {n}^3 {str(dtype)[6:]} vs {args.op} of {nbytes / 2**20:.1f} MiB, "
              f"W={rt.world_size}, {rt.device}, {rt.backend}"
              + ("" if gpu else " (CPU: mechanics only, processes share cores)"))
        print(f"  GEMM alone             {t_gemm * 1e3:9.3f} ms  ({result['gemm_tflops']:.1f} TFLOP/s)")
        print(f"  {args.op + ' alone':<22} {t_comm * 1e3:9.3f} ms  (algbw {algbw:.2f} GB/s, busbw {busbw:.2f})")
        print(f"  serial                 {t_serial * 1e3:9.3f} ms")
        print(f"  overlapped             {t_over * 1e3:9.3f} ms")
        print(f"  overlap achieved       {hidden * 100:8.1f} %   of the shorter one hidden")
        print(f"  GEMM beside collective {t_inside * 1e3:9.3f} ms  (compute slowdown {result['compute_slowdown'] * 100:+.1f} %)")
        if trace:
            print(f"  trace per rank in {args.profile_dir}/ (python -m distlab.profiling.overlap {trace})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"wrote {args.json}")
    shutdown()
    return result


if __name__ == "__main__":
    run_study(main)
