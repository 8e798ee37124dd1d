"""The MoE study: router, dispatch, experts and combine timed apart, the load per expert, bytes moved.

    distlab run --nproc 4 -m distlab.moe --experts 8 --topk 2 --hidden 256 --ffn 512 --tokens 2048 --check
    torchrun --nproc-per-node 8 -m distlab.moe --experts 8 --topk 2 --hidden 4096 --ffn 14336 --tokens 4096
    python -m distlab.moe --sweep 0,0.5,1,2,4 --plot skew.png --json skew.json   # TFLOP/s vs imbalance

Each rank routes ``--tokens`` tokens of its own. ``--skew α`` adds ``−α·log(e+1)`` to expert e's router
logit, a Zipf-like preference that piles tokens onto the first experts (α = 0: the router's own spread).
Per phase the slowest rank's time is reported (each phase is synchronised, so the sum is a little slower
than the un-instrumented forward, which is reported too), the tokens-per-expert histogram over the whole
group, the bytes each rank sent in the all-to-alls, and the experts' TFLOP/s (three GEMMs of
2·rows·hidden·ffn each). ``--sweep`` runs several skews and writes TFLOP/s against the load imbalance
(max/mean tokens per expert) as JSON and a PNG.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from distlab import comm
from distlab.moe.dispatch import combine, dispatch
from distlab.moe.layer import MoE, MoEReference
from distlab.profiling import profile_steps
from distlab.bench import (DTYPES, StudyParser, add_common_args, nonnegative_int, positive_float, positive_int, progress,
                           pyplot, resolve_device, write_json)
from distlab.runtime import init_runtime, shutdown
from distlab.kernels.grouped_gemm import BACKENDS, resolve as resolve_grouped_backend


def parse_args(argv=None):
    p = StudyParser(prog="python -m distlab.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=positive_int, default=8)
    p.add_argument("--topk", type=positive_int, default=2)
    p.add_argument("--hidden", type=positive_int, default=None, help="default 4096 on GPU, 256 on CPU")
    p.add_argument("--ffn", type=positive_int, default=None, help="default 14336 on GPU, 512 on CPU")
    p.add_argument("--tokens", type=nonnegative_int, default=None, help="tokens per rank (default 4096 GPU, 2048 CPU)")
    p.add_argument("--skew", type=float, default=0.0)
    p.add_argument("--sweep", default=None, help="comma-separated skews")
    p.add_argument("--capacity-factor", type=positive_float, default=None)
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="grouped GEMM backend")
    p.add_argument("--check", action="store_true")
    add_common_args(p, iters=3, warmup=False, dtypes=("float32", "bfloat16"), plot=True, profile=True,
                    profile_dir="traces/moe")
    a = p.parse_args(argv)
    gpu = resolve_device(a.device).type == "cuda"
    for name, g, c in (("hidden", 4096, 256), ("ffn", 14336, 512), ("tokens", 4096, 2048),
                       ("dtype", "bfloat16", "float32")):
        if getattr(a, name) is None:
            setattr(a, name, g if gpu else c)
    if a.sweep is not None:
        try:
            a.sweep = [float(s) for s in a.sweep.split(",")]
        except ValueError:
            p.error(f"--sweep {a.sweep!r}: give comma-separated numbers, e.g. 0,0.5,1,2")
    return a


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def phases(layer, x, dev):
    """One forward with each phase timed (synchronised between phases)."""
    t = [time.perf_counter()]
    weights, experts, _, counts = layer.router(x)
    _sync(dev)
    t.append(time.perf_counter())
    rows, state = dispatch(x, experts, weights, layer.num_experts, layer.group, layer.capacity_factor)
    _sync(dev)
    t.append(time.perf_counter())
    y = layer.experts(rows, state.tokens_per_expert)
    _sync(dev)
    t.append(time.perf_counter())
    combine(y, state, layer.group)
    _sync(dev)
    t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:])], counts, state


def measure(args, rt, skew):
    dev, dtype = rt.device, DTYPES[args.dtype]
    torch.manual_seed(0)
    ref = MoEReference(args.hidden, args.ffn, args.experts, args.topk, device=dev, dtype=dtype)
    with torch.no_grad():
        ref.router.logit_offset.copy_(-skew * torch.log(torch.arange(1, args.experts + 1, device=dev).float()))
    layer = MoE.from_reference(ref, None, args.backend, args.capacity_factor)
    layer.router.logit_offset.copy_(ref.router.logit_offset)
    g = torch.Generator(device="cpu").manual_seed(1000 + rt.rank)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(dev, dtype).requires_grad_(True)
    times, fwd, fb = [], [], []
    for i in range(args.iters + 1):
        torch.distributed.barrier()
        ph, counts, state = phases(layer, x.detach(), dev)
        torch.distributed.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            layer(x)
        _sync(dev)
        t1 = time.perf_counter()
        layer(x).float().square().mean().backward()
        _sync(dev)
        t2 = time.perf_counter()
        if i:  # the first round is the warm-up
            times.append(ph)
            fwd.append(t1 - t0)
            fb.append(t2 - t1)
    with comm.CommLog() as log:
        with torch.no_grad():
            layer(x)
    # the phases of the round whose instrumented total is the median, so they add up to that total
    mid = sorted(range(len(times)), key=lambda i: sum(times[i]))[len(times) // 2]
    mine = torch.tensor([[*times[mid], statistics.median(fwd), statistics.median(fb), sum(state.tokens_per_expert)]],
                        dtype=torch.float64)
    per_rank = comm.all_gather_raw(mine, None, 0)
    slowest = per_rank[per_rank[:, :4].sum(1).argmax()]      # one rank's phases: they add up to its total
    total = comm.all_reduce_raw(counts.to(torch.int64))
    rows = slowest[6].item()
    expert_flops = 3 * 2 * rows * args.hidden * args.ffn
    result = {"skew": skew, "phases_s": dict(zip(("router", "dispatch", "experts", "combine"), slowest[:4].tolist())),
              "instrumented_fwd_s": slowest[:4].sum().item(),
              "fwd_s": per_rank[:, 4].max().item(), "fwd_bwd_s": per_rank[:, 5].max().item(),
              "tokens_per_expert": total.tolist(),
              "imbalance": (total.max() / total.float().mean().clamp_min(1e-30)).item(),
              "bytes_sent_fwd": log.total_bytes(),
              "a2a_calls_fwd": log.calls["all_to_all"], "dropped": state.dropped,
              "expert_tflops": expert_flops / slowest[2].item() / 1e12}   # that rank's rows over its experts time
    if args.profile != "none":
        result["trace"] = profile_steps(lambda: layer(x).float().square().mean().backward(), args.profile,
                                        f"{args.profile_dir}/skew{skew}", rt.rank)
    if args.check:
        xs = comm.all_gather_raw(x.detach(), None, 0)
        out = layer(x.detach())
        ref64 = ref.double() if dev.type == "cpu" else ref
        # capacity applies per rank: the reference drops the same assignments with one chunk per rank
        want = ref64(xs.to(ref64.w_gate.dtype), capacity_factor=args.capacity_factor,
                     chunks=rt.world_size)[rt.rank * args.tokens:(rt.rank + 1) * args.tokens]
        err = torch.tensor([((out.double() - want.double()).abs().max() / want.double().abs().max()).item()])
        torch.distributed.all_reduce(err, op=torch.distributed.ReduceOp.MAX)
        result["max_rel_error"] = err.item()
        result["check_passed"] = err.item() < (1e-5 if dtype == torch.float32 else 3e-2)
    return result


def histogram(counts, width=40) -> list[str]:
    top = max(max(counts), 1)
    return [f"  expert {e:>3} {c:>8} {'#' * round(width * c / top)}" for e, c in enumerate(counts)]


def main(argv=None):
    args = parse_args(argv)
    rt = init_runtime(device=args.device)
    if args.experts % rt.world_size or not 1 <= args.topk <= args.experts:
        raise ValueError(f"{args.experts} experts over {rt.world_size} ranks with top-{args.topk} is not a valid "
                         f"configuration (experts must divide by the EP size; 1 <= top-k <= experts)")
    resolve_grouped_backend(args.backend, torch.empty(0, device=rt.device, dtype=DTYPES[args.dtype]))
    skews = args.sweep or [args.skew]
    results = [measure(args, rt, s) for s in progress(skews, "moe skew")]
    if rt.is_main:
        print(f"MoE, EP={rt.world_size}, {rt.device}: {args.experts} experts, top-{args.topk}, hidden {args.hidden}, "
              f"ffn {args.ffn}, {args.tokens} tokens/rank, {args.dtype}, grouped GEMM backend {args.backend}")
        for r in results:
            ph = r["phases_s"]
            print(f"\nskew {r['skew']}: router {ph['router'] * 1e3:.2f} ms · dispatch {ph['dispatch'] * 1e3:.2f} ms · "
                  f"experts {ph['experts'] * 1e3:.2f} ms ({r['expert_tflops']:.2f} TFLOP/s) · combine "
                  f"{ph['combine'] * 1e3:.2f} ms = {r['instrumented_fwd_s'] * 1e3:.2f} ms (the slowest rank's phases, "
                  f"synchronised between them)")
            print(f"un-instrumented, slowest rank: forward {r['fwd_s'] * 1e3:.2f} ms, forward+backward "
                  f"{r['fwd_bwd_s'] * 1e3:.2f} ms")
            print(f"all-to-alls per rank, forward: {r['a2a_calls_fwd']} calls, {r['bytes_sent_fwd'] / 1e6:.3f} MB sent; "
                  f"dropped assignments: {r['dropped']}; imbalance max/mean {r['imbalance']:.2f}")
            print("\n".join(histogram(r["tokens_per_expert"])))
            if "max_rel_error" in r:
                print(f"check vs one device: max rel error {r['max_rel_error']:.2e}: "
                      f"{'PASS' if r['check_passed'] else 'FAIL'}")
        if args.json:
            write_json(args.json, {"args": vars(args), "ep": rt.world_size, "device": str(rt.device), "results": results})
        if args.plot:
            plot(results, args.plot, f"MoE experts: EP={rt.world_size}, {args.experts} experts top-{args.topk}, "
                                     f"hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens/rank, {args.dtype}, "
                                     f"{rt.device.type}, backend {args.backend}")
    shutdown()
    if args.check and not all(r["check_passed"] for r in results):
        sys.exit(1)


def plot(results, path, title):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["imbalance"] for r in results], [r["expert_tflops"] for r in results], marker="o")
    for r in results:
        ax.annotate(f"skew {r['skew']}", (r["imbalance"], r["expert_tflops"]))
    ax.set_xlabel("tokens per expert, max / mean")
    ax.set_ylabel("experts' TFLOP/s (slowest rank)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
