"""Ring, zigzag, Ulysses and every USP split of the world size on the same problem, in one table.

    distlab run --nproc 4 -m distlab.cp.compare --seq 8192 --check --plot cp.png --json cp.json
    torchrun --nproc-per-node 8 -m distlab.cp.compare --seq 65536 --heads 32 --kv-heads 8 --head-dim 128
    distlab run --nproc 4 -m distlab.cp.compare --seq 4096 --deepspeed    # + DeepSpeed-Ulysses baseline

Same flags as the ring study (``distlab.cp.study``). Every method runs on the same q, k, v and is timed,
logged and checked the same way; Ulysses appears when W divides the q heads; USP splits U×R run with
1 < U < W (U=1 is the ring rows, U=W the Ulysses row) and the zigzag layout. The table gives the slowest
rank's forward and forward+backward times and TFLOP/s, bytes each rank sent (measured) next to the
``distlab.cp.cost`` model, the efficiency against one device, and with ``--check`` the max relative error
over out, dq, dk, dv.
"""

from __future__ import annotations

import os
import sys

import torch

from distlab.cp.cost import cp_bytes
from distlab.bench import DTYPES, check_memory, progress, pyplot, run_study, write_json
from distlab.cp.study import (CPMethod, build_method, header, make_inputs, measure, memory_estimate,
                              one_device_timing, parse_args, reference_on_rank0, summarize)
from distlab.cp.ulysses import kv_replication
from distlab.runtime import init_runtime, shutdown
from distlab.kernels.attention import attention, resolve_backend


def method_plan(world, heads, kv_heads, packed=False):
    """(algorithm, ulysses, ring, layout) for every method that runs at this world size and head count;
    ``packed`` (documents or a window): the balanced layout too."""
    plan = [("ring", 1, world, "contiguous"), ("ring", 1, world, "zigzag")]
    if packed:
        plan.append(("ring", 1, world, "balanced"))
    plan += [("allgather", 1, world, "zigzag")] + ([("allgather", 1, world, "balanced")] if packed else [])
    if world > 1 and heads % world == 0:
        plan.append(("ulysses", world, 1, "contiguous"))
    plan += [("usp", u, world // u, "zigzag") for u in range(2, world) if world % u == 0 and heads % u == 0]
    return plan


def deepspeed_method(args, world, rank, backend) -> CPMethod:
    """DeepSpeed's DistributedAttention (Ulysses) around the same local kernel, on the same shards."""
    try:
        import deepspeed
    except ImportError:
        raise ValueError("--deepspeed needs DeepSpeed: pip install 'distlab[deepspeed]'") from None
    from deepspeed.sequence.layer import DistributedAttention

    from distlab.cp.layout import gather_sequence, shard_sequence

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # adopts the existing group
    f = kv_replication(args.heads, args.kv_heads, world)   # DeepSpeed splits kv heads too: give it kv' heads
    local = lambda q, k, v, *a, **kw: attention(q, k, v, args.causal, None, backend)  # noqa: E731
    ds = DistributedAttention(local, torch.distributed.group.WORLD, scatter_idx=2, gather_idx=1)

    def attn(q, k, v):
        if f > 1:
            k, v = k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)
        return ds(q, k, v, 0)

    model = cp_bytes("ulysses", args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype],
                     ulysses=world)
    return CPMethod("deepspeed ulysses", attn, lambda x: shard_sequence(x, None, "contiguous"),
                    lambda x: gather_sequence(x, None, "contiguous"), 1.0 / world, model, logged=False)


def table(results, args) -> str:
    lines = ["(sent MB: measured by distlab.comm on the busiest rank, fwd+bwd; n/a: not through distlab.comm; "
             "imbal.: the busiest rank's visible query-key pairs over the mean)",
             f"{'method':<24} {'fwd ms':>9} {'f+b ms':>9} {'fwd TF/s':>9} {'f+b TF/s':>9} {'sent MB':>9} "
             f"{'model MB':>9} {'imbal.':>7} {'eff f+b':>8} {'max err':>9}"]
    for r in results:
        sent = f"{max(x['fwd_bwd_bytes'] for x in r['ranks']) / 1e6:>9.3f}" if r["logged"] else f"{'n/a':>9}"
        err = max(r["max_rel_error"].values()) if "max_rel_error" in r else float("nan")
        eff = r.get("efficiency", {}).get("fwd_bwd", float("nan")) * 100
        lines.append(f"{r['method']:<24} {r['slowest']['fwd_s'] * 1e3:>9.2f} {r['slowest']['fwd_bwd_s'] * 1e3:>9.2f} "
                     f"{r['tflops']['fwd']:>9.3f} {r['tflops']['fwd_bwd']:>9.3f} {sent} "
                     f"{r['model_bytes']['fwd_bwd'] / 1e6:>9.3f} {r['work_imbalance']:>7.3f} {eff:>7.1f}% {err:>9.2e}")
    return "\n".join(lines)


def plot(results, path, title):
    plt = pyplot()
    if plt is None:
        return
    names = [r["method"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [r["slowest"]["fwd_s"] * 1e3 for r in results], 0.4, label="forward")
    ax1.bar([i + 0.2 for i in x], [r["slowest"]["fwd_bwd_s"] * 1e3 for r in results], 0.4, label="forward+backward")
    ax1.set_ylabel("slowest rank, ms")
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [max(y["fwd_bwd_bytes"] for y in r["ranks"]) / 1e6 for r in results], 0.4,
            label="measured")
    ax2.bar([i + 0.2 for i in x], [r["model_bytes"]["fwd_bwd"] / 1e6 for r in results], 0.4, label="model")
    ax2.set_ylabel("MB sent per rank, fwd+bwd")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), names, rotation=30, ha="right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv, "compare")
    rt = init_runtime(device=args.device, seed=args.seed)
    world, rank, dev = rt.world_size, rt.rank, rt.device
    # bad input raises ValueError here, the same on every rank, before any collective of the study
    packed = args.docs is not None or args.window is not None
    backend = resolve_backend(args.backend, dev, DTYPES[args.dtype], masked=True)   # all-gather's causal needs it
    plan = method_plan(world, args.heads, args.kv_heads, packed)
    methods = [build_method(a, args, world, rank, dev, backend, ulysses=u, ring=r, layout=lay)
               for a, u, r, lay in plan]
    if args.deepspeed:
        methods.append(deepspeed_method(args, world, rank, backend))
    check_memory(memory_estimate(args, world), dev, f"seq {args.seq} x {args.heads} heads (batch {args.batch})")
    full = make_inputs(args, dev)
    reference = reference_on_rank0(full, args, rank)
    one = one_device_timing(full, args, dev, backend) if (not args.no_baseline and rank == 0) else None
    results = []
    for method in progress(methods, "cp.compare"):
        result = measure(method, full, args, dev, reference)
        if one is not None:
            result["one_device"] = one
        results.append(summarize(result, args))
    passed = all(r.get("check_passed", True) for r in results)
    if rt.is_main:
        print("context-parallel attention, every method on the same problem")
        print("\n".join(header({**results[0], "world_size": world, "launcher": rt.launcher, "device": str(dev),
                                "backend": backend, "cpu_cores": os.cpu_count()}, args)))
        if one is not None:
            print(f"one device, whole sequence: fwd {one['fwd_s'] * 1e3:.2f} ms, fwd+bwd {one['fwd_bwd_s'] * 1e3:.2f} ms")
        print()
        print(table(results, args))
        if args.check:
            print(f"check vs one device: {'PASS' if passed else 'FAIL'} "
                  f"(tolerance {results[0]['tolerance']:.0e} on every method)")
        if args.plot:
            a = args
            plot(results, args.plot, f"CP attention: batch {a.batch}, seq {a.seq}, {a.heads} q / {a.kv_heads} kv heads, "
                                     f"head_dim {a.head_dim}, {a.dtype}, {'causal' if a.causal else 'full'}, "
                                     f"W={world}, {dev.type}, backend {backend}")
        if args.json:
            write_json(args.json, {"world_size": world, "device": str(dev), "backend": backend, "args": vars(args),
                                   "one_device": one, "methods": results})
    shutdown()
    if args.check and not passed:
        sys.exit(1)


if __name__ == "__main__":
    run_study(main)
