"""The context-parallel study: time one CP attention, count its communication, check it against one device.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --check --json ring.json
    torchrun --nproc-per-node 8 -m distlab.cp.ring --seq 65536 --layout zigzag --check

Every rank draws the same full q, k, v (same seed), keeps its shard, and runs the algorithm ``--warmup``
times, then ``--iters`` timed times forward-only and forward+backward. The table gives, per rank, the
median times, the bytes the rank sent (``distlab.comm.CommLog``) and its share of the attention work;
then the aggregate TFLOP/s, the efficiency against one device running the whole sequence with the same
kernel (``T_one / (W · T_cp)``; 100% is perfect scaling), and with ``--check`` the max relative error of
the output and of dq, dk, dv against a float64 (float32 on GPU) one-device reference on the gathered
tensors. ``--check`` exits with status 1 when an error is above the dtype's tolerance.

Without a GPU the defaults are CPU-sized (4 heads, 2 kv heads, head_dim 32, float32); with one, the
Llama-3-8B attention shape (32 heads, 8 kv heads, head_dim 128, bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from distlab import comm
from distlab.cp.layout import LAYOUTS, check_divisible, gather_sequence, rank_chunks, shard_sequence
from distlab.runtime import init_runtime, shutdown
from kernels.attention import BACKENDS, attention_backward, attention_forward, resolve_backend

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def parse_args(argv=None, algorithm="ring"):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog=f"python -m distlab.cp.{algorithm}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=int, default=8192, help="full sequence length (all ranks together)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32 if gpu else 4)
    p.add_argument("--kv-heads", type=int, default=8 if gpu else 2)
    p.add_argument("--head-dim", type=int, default=128 if gpu else 32)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if gpu else "float32")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--iters", type=int, default=5 if gpu else 2)
    p.add_argument("--warmup", type=int, default=2 if gpu else 0, help="untimed runs first (CPU needs none)")
    p.add_argument("--check", action="store_true", help="compare output and grads with one device")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-device timing")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    p.add_argument("--device", default=None, help="force a device (cpu, cuda); default: cuda if present")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def attention_flops(batch, seq, heads, head_dim, causal, backward=False):
    """FLOPs of attention as FlashAttention counts them: 4·b·s²·h·d forward, halved when causal; bwd 2.5×."""
    f = 4 * batch * seq * seq * heads * head_dim * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


def work_share(rank, world, causal, layout, local_seq):
    """Fraction of the whole attention's score entries that ``rank`` computes (shows causal balance)."""
    from distlab.cp.ring import ring_blocks

    area = 0
    for step in range(world):
        for rows, cols, blk_causal in ring_blocks((rank - step) % world, rank, local_seq, causal, layout):
            n, m = rows.stop - rows.start, cols.stop - cols.start
            area += n * (n + 1) / 2 if blk_causal else n * m
    full = world * local_seq
    return area / (full * (full + 1) / 2 if causal else full * full)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, iters, warmup, device, barrier=True):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if barrier and dist.is_initialized():
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_attention(algorithm, group, args, backend):
    if algorithm == "ring":
        from distlab.cp.ring import ring_attention

        return lambda q, k, v: ring_attention(q, k, v, group, args.causal, args.layout, backend)
    raise ValueError(f"unknown CP algorithm {algorithm!r}")


def rel_error(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def one_device_reference(q, k, v, dout, causal):
    """Output and grads of the whole attention on one device, in float64 on CPU (float32 on GPU)."""
    ct = torch.float64 if q.device.type == "cpu" else torch.float32
    q, k, v, dout = (t.to(ct) for t in (q, k, v, dout))
    out, lse = attention_forward(q, k, v, causal, backend="torch")
    return (out, *attention_backward(dout, q, k, v, out, lse, causal, backend="torch"))


def run(args, algorithm="ring"):
    rt = init_runtime(device=args.device, seed=args.seed)
    world, rank, dev = rt.world_size, rt.rank, rt.device
    dtype = DTYPES[args.dtype]
    # every rank validates the same arguments before any collective, so a bad one fails everywhere
    check_divisible(args.seq, world, args.layout)
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    backend = resolve_backend(args.backend, dev, dtype)
    group = dist.group.WORLD

    shape_q = (args.batch, args.seq, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq, args.kv_heads, args.head_dim)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    full = [torch.randn(s, generator=gen).to(dev, dtype) for s in (shape_q, shape_kv, shape_kv, shape_q)]
    q, k, v, dout = (shard_sequence(t, group, args.layout) for t in full)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    attn = make_attention(algorithm, group, args, backend)

    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwd_bwd():
        attn(qg, kg, vg).backward(dout)

    t_fwd = _time(fwd, args.iters, args.warmup, dev)
    t_fb = _time(fwd_bwd, args.iters, args.warmup, dev)
    with comm.CommLog() as log_fwd:
        fwd()
    with comm.CommLog() as log_fb:
        qg.grad = kg.grad = vg.grad = None
        out = attn(qg, kg, vg)
        out.backward(dout)

    mine = torch.tensor([t_fwd, t_fb, log_fwd.total_bytes(), log_fb.total_bytes(),
                         work_share(rank, world, args.causal, args.layout, q.shape[1])], dtype=torch.float64)
    per_rank = comm.all_gather_raw(mine[None], group, 0) if world > 1 else mine[None]

    result = {"algorithm": algorithm, "world_size": world, "device": str(dev), "backend": backend,
              "launcher": rt.launcher, "args": vars(args), "cpu_cores": os.cpu_count(),
              "comm_forward": log_fwd.as_dict(), "comm_forward_backward": log_fb.as_dict(),
              "ranks": [dict(zip(("fwd_s", "fwd_bwd_s", "fwd_bytes", "fwd_bwd_bytes", "work_share"),
                                 row.tolist())) for row in per_rank]}

    if not args.no_baseline and rank == 0:
        fq, fk, fv, fd = (t.detach().requires_grad_(False) for t in full)

        def one_fwd():
            attention_forward(fq, fk, fv, args.causal, backend=backend)

        def one_fb():
            o, l = attention_forward(fq, fk, fv, args.causal, backend=backend)
            attention_backward(fd, fq, fk, fv, o, l, args.causal, backend=backend)

        result["one_device"] = {"fwd_s": _time(one_fwd, args.iters, args.warmup, dev, barrier=False),
                                "fwd_bwd_s": _time(one_fb, args.iters, args.warmup, dev, barrier=False)}

    if args.check:
        got = [gather_sequence(t, group, args.layout) for t in (out.detach(), qg.grad, kg.grad, vg.grad)]
        errors = torch.zeros(4, dtype=torch.float64)
        if rank == 0:  # the other ranks wait in the broadcast: let the reference use every core
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or 1)
            want = one_device_reference(*full, args.causal)
            torch.set_num_threads(threads)
            errors = torch.tensor([rel_error(a, b) for a, b in zip(got, want)], dtype=torch.float64)
        if world > 1:
            dist.broadcast(errors, 0, group=group)
        result["max_rel_error"] = dict(zip(("out", "dq", "dk", "dv"), errors.tolist()))
        result["tolerance"] = TOLERANCE[dtype]
        result["check_passed"] = bool(errors.max().item() <= TOLERANCE[dtype])
    return rt, result


def report(result) -> str:
    a = result["args"]
    w = result["world_size"]
    f_fwd = attention_flops(a["batch"], a["seq"], a["heads"], a["head_dim"], a["causal"])
    f_fb = f_fwd + attention_flops(a["batch"], a["seq"], a["heads"], a["head_dim"], a["causal"], backward=True)
    gpu = result["device"].startswith("cuda")
    lines = [f"{result['algorithm']} attention, {a['layout']} layout, W={w} ({result['launcher']}), "
             f"{result['device']}, backend {result['backend']}",
             f"batch {a['batch']} · seq {a['seq']} · heads {a['heads']} (kv {a['kv_heads']}) · head_dim "
             f"{a['head_dim']} · {a['dtype']} · {'causal' if a['causal'] else 'full'}"]
    if not gpu:
        lines.append(f"(no GPU: CPU-sized defaults; {w} processes share {result['cpu_cores']} CPU cores, so "
                     f"times show correctness-scale work, not scaling)")
    lines.append("")
    lines.append(f"{'rank':>4} {'fwd ms':>9} {'fwd+bwd ms':>11} {'sent fwd MB':>12} {'sent f+b MB':>12} "
                 f"{'work %':>7}")
    for r, row in enumerate(result["ranks"]):
        lines.append(f"{r:>4} {row['fwd_s'] * 1e3:>9.2f} {row['fwd_bwd_s'] * 1e3:>11.2f} "
                     f"{row['fwd_bytes'] / 1e6:>12.3f} {row['fwd_bwd_bytes'] / 1e6:>12.3f} "
                     f"{row['work_share'] * 100:>7.1f}")
    t_fwd = max(r["fwd_s"] for r in result["ranks"])
    t_fb = max(r["fwd_bwd_s"] for r in result["ranks"])
    result["tflops"] = {"fwd": f_fwd / t_fwd / 1e12, "fwd_bwd": f_fb / t_fb / 1e12}
    lines.append("")
    lines.append(f"slowest rank: fwd {t_fwd * 1e3:.2f} ms ({result['tflops']['fwd']:.3f} TFLOP/s), "
                 f"fwd+bwd {t_fb * 1e3:.2f} ms ({result['tflops']['fwd_bwd']:.3f} TFLOP/s)")
    calls = result["comm_forward"]["calls"]
    lines.append(f"communication per rank: forward {dict(calls)}, forward+backward "
                 f"{dict(result['comm_forward_backward']['calls'])}")
    if "one_device" in result:
        one = result["one_device"]
        result["efficiency"] = {"fwd": one["fwd_s"] / (w * t_fwd), "fwd_bwd": one["fwd_bwd_s"] / (w * t_fb)}
        lines.append(f"one device, whole sequence: fwd {one['fwd_s'] * 1e3:.2f} ms, fwd+bwd "
                     f"{one['fwd_bwd_s'] * 1e3:.2f} ms -> efficiency T_one/(W*T_cp): fwd "
                     f"{result['efficiency']['fwd'] * 100:.1f}%, fwd+bwd {result['efficiency']['fwd_bwd'] * 100:.1f}%")
    if "max_rel_error" in result:
        e = result["max_rel_error"]
        ok = result["check_passed"]
        lines.append(f"check vs one device: max rel error out {e['out']:.2e}, dq {e['dq']:.2e}, dk {e['dk']:.2e}, "
                     f"dv {e['dv']:.2e} (tolerance {result['tolerance']:.0e}): {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None, algorithm="ring"):
    args = parse_args(argv, algorithm)
    try:
        rt, result = run(args, algorithm)
    except ValueError as e:  # bad input: every rank raises the same before any collective
        print(f"error: {e}", file=sys.stderr)
        shutdown()
        sys.exit(2)
    if rt.is_main:
        print(report(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"wrote {args.json}")
    shutdown()
    if args.check and not result["check_passed"]:
        sys.exit(1)
