"""The context-parallel study: time one CP attention, count its communication, check it against one device.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --check --json ring.json
    distlab run --nproc 4 -m distlab.cp.ulysses --seq 8192 --check
    distlab run --nproc 4 -m distlab.cp.usp --ulysses 2 --ring 2 --seq 8192 --check
    distlab run --nproc 4 -m distlab.cp.allgather --seq 8192 --check
    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --docs lognormal:mean=1024,seed=0 --layout balanced --check
    torchrun --nproc-per-node 8 -m distlab.cp.ring --seq 65536 --layout zigzag --check

Every rank draws the same full q, k, v (same seed), keeps its shard, and runs the method ``--warmup``
times, then ``--iters`` timed times forward-only and forward+backward. The table gives, per rank, the
median times, the bytes the rank sent (``distlab.comm.CommLog``, next to ``distlab.cp.cost``'s model) and
its share of the attention work; then the aggregate TFLOP/s, the efficiency against one device running
the whole sequence with the same kernel (``T_one / (W · T_cp)``; 100% is perfect scaling), and with
``--check`` the max relative error of the output and of dq, dk, dv against a float64 (float32 on GPU)
one-device reference on the gathered tensors. ``--check`` exits with status 1 when an error is above the
dtype's tolerance; invalid arguments exit with status 2 on every rank.

``--docs`` packs documents (a list of lengths, repeated to fill ``--seq``, or ``lognormal:mean=2048,seed=0``)
and ``--window N`` adds a sliding window (``distlab.cp.documents``); the work column then counts each
rank's visible query–key pairs, the table shows the imbalance (max/mean), FLOPs count visible pairs, and
``--check`` compares with one-device attention under the same mask in float64.

Without a GPU the defaults are CPU-sized (4 heads, 2 kv heads, head_dim 32, float32); with one, the
Llama-3-8B attention shape (32 heads, 8 kv heads, head_dim 128, bfloat16).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist

from distlab import comm, knobs
from distlab.cp.cost import cp_bytes
from distlab.cp.documents import Documents, describe, parse_docs
from distlab.cp.layout import LAYOUTS, check_divisible, gather_sequence, shard_positions, shard_sequence
from distlab.profiling import profile_steps
from distlab.runtime import Layout, init_runtime, shutdown
from distlab.kernels.attention import BACKENDS, attention_backward, attention_forward, resolve_backend
from distlab.bench import (DTYPES, StudyParser, add_common_args, check_memory, nonnegative_int, positive_int,
                           resolve_device, time_ranks, write_json)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def parse_args(argv=None, algorithm="ring"):
    p = StudyParser(prog=f"python -m distlab.cp.{algorithm}", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=positive_int, default=8192, help="full sequence length (all ranks together)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=None, help="default: 32 on GPU, 4 on CPU")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="default: 8 on GPU, 2 on CPU")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default: 128 on GPU, 32 on CPU")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", choices=LAYOUTS, default="contiguous" if algorithm == "ulysses" else "zigzag",
                   help="sequence layout (balanced: placed by the documents' causal work)")
    p.add_argument("--docs", default=None, metavar="SPEC",
                   help="packed documents: lengths 3000,1200,800 (repeated) or lognormal:mean=2048,seed=0")
    p.add_argument("--window", type=nonnegative_int, default=None, help="sliding window (causal): keys at most N back")
    if algorithm in ("usp", "compare"):
        p.add_argument("--ulysses", type=positive_int, default=None, help="Ulysses degree (default: 2, or 1 if W is odd)")
        p.add_argument("--ring", type=positive_int, default=None, help="ring degree (default: W / ulysses)")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--check", action="store_true", help="compare output and grads with one device")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-device timing")
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, plot=algorithm == "compare", profile=True)   # iters/warmup/dtype: per device below
    if algorithm == "compare":
        p.add_argument("--deepspeed", action="store_true", help="add DeepSpeed's DistributedAttention (Ulysses)")
    args = p.parse_args(argv)
    # defaults follow the device the study will run on (a forced --device cpu on a GPU box gets CPU sizes)
    gpu = resolve_device(args.device).type == "cuda"
    for name, on_gpu, on_cpu in (("heads", 32, 4), ("kv_heads", 8, 2), ("head_dim", 128, 32),
                                 ("dtype", "bfloat16", "float32"), ("iters", 5, 2), ("warmup", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    return args


def attention_flops(batch, seq, heads, head_dim, causal, backward=False, pairs=None):
    """FLOPs of attention as FlashAttention counts them: 4·b·s²·h·d forward, halved when causal; bwd 2.5×.
    ``pairs``: the visible (query, key) pairs instead (packed documents, windows): 4·b·pairs·h·d."""
    f = 4 * batch * heads * head_dim * (pairs if pairs is not None else seq * seq * (0.5 if causal else 1.0))
    return f * 2.5 if backward else f


def study_documents(args) -> Documents:
    """The study's mask: ``--docs`` and ``--window`` (ValueError on every rank when they are wrong)."""
    return Documents.from_args(args.seq, parse_docs(args.docs, args.seq), args.causal, args.window)


@dataclasses.dataclass
class CPMethod:
    """One CP attention set up on this rank: how to call it, shard and gather, and what it should cost."""

    name: str
    attn: Callable
    shard: Callable
    gather: Callable
    work_share: float
    model_bytes: dict
    logged: bool = True  # its communication goes through distlab.comm (so CommLog sees it)


def needs_mask(algorithm: str, layout: str, docs: Documents) -> bool:
    """Whether the method's kernel calls carry a KeyMask (only the backends in MASK_BACKENDS take one)."""
    if docs.masked or layout == "balanced":
        return True
    return docs.causal and (algorithm == "allgather" or algorithm == "ulysses" and layout != "contiguous")


def work_share(docs: Documents, world: int, rank: int, layout: str) -> float:
    """This rank's share of the visible (query, key) pairs when ``world`` ranks hold the sequence in ``layout``."""
    mine = docs.work(shard_positions(docs.total, world, rank, layout, docs.cu_seqlens))
    return mine / max(1, docs.work(torch.arange(docs.total)))


def build_method(algorithm, args, world, rank, device, backend, ulysses=1, ring=None, layout=None) -> CPMethod:
    """Validate (same answer on every rank, no communication), then build groups and the method."""
    from distlab.cp.allgather import allgather_attention
    from distlab.cp.ring import ring_attention
    from distlab.cp.ulysses import kv_replication, ulysses_attention
    from distlab.cp.usp import usp_attention

    layout = layout or args.layout
    dtype = DTYPES[args.dtype]
    docs = study_documents(args)
    cu = docs.cu_seqlens
    kw = dict(cu_seqlens=cu, window=docs.window)
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    shape = (args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, dtype)
    g = dist.group.WORLD
    if algorithm in ("ring", "allgather"):
        check_divisible(args.seq, world, layout)
        route = knobs.get("RING_DKV_ROUTE")
        if algorithm == "ring":
            steps = knobs.get("RING_STEPS_PER_LAUNCH")   # a launch knob of the study (distlab.knobs)
            attn = lambda q, k, v: ring_attention(q, k, v, g, args.causal, layout, backend,  # noqa: E731
                                                  steps_per_launch=steps, dkv_route=route, **kw)
        else:
            attn = lambda q, k, v: allgather_attention(q, k, v, g, args.causal, layout, backend, **kw)  # noqa: E731
        model = cp_bytes(algorithm, *shape, ring=world)
        if algorithm == "ring" and route == "direct" and world > 1:   # the K/V hops, then this rank's shares
            from distlab.cp.ring import check_steps_per_launch
            from distlab.cp.ring_dkv_direct import direct_bytes

            n = check_steps_per_launch(steps, backend, world)
            kv_hops = model["fwd"]
            model = {"fwd": kv_hops, "bwd": kv_hops + direct_bytes(rank, world, args.seq // world, args.causal, layout, n,
                                                                   args.batch, args.kv_heads, args.head_dim,
                                                                   dtype.itemsize)}
            model["fwd_bwd"] = model["fwd"] + model["bwd"]
        return CPMethod(f"{algorithm} ({layout})", attn,
                        lambda x: shard_sequence(x, g, layout, cu_seqlens=cu),
                        lambda x: gather_sequence(x, g, layout, cu_seqlens=cu),
                        work_share(docs, world, rank, layout), model)
    if algorithm == "ulysses":
        check_divisible(args.seq, world, layout)
        kv_replication(args.heads, args.kv_heads, world)
        return CPMethod(f"ulysses ({layout})" if layout != "contiguous" else "ulysses",
                        lambda q, k, v: ulysses_attention(q, k, v, g, args.causal, backend, layout=layout, **kw),
                        lambda x: shard_sequence(x, g, layout, cu_seqlens=cu),
                        lambda x: gather_sequence(x, g, layout, cu_seqlens=cu),
                        1.0 / world, cp_bytes("ulysses", *shape, ulysses=world))
    if algorithm == "usp":
        ring = ring if ring is not None else world // ulysses
        dims = Layout(world, cp=world, ulysses=ulysses, ring=ring)
        check_divisible(args.seq, ring, layout, ulysses)
        kv_replication(args.heads, args.kv_heads, ulysses)
        mesh = dims.build_mesh(device.type)
        ug, rg = mesh.get_group("ulysses"), mesh.get_group("ring")
        r_rank = mesh.get_local_rank("ring")
        return CPMethod(f"usp {ulysses}x{ring} ({layout})",
                        lambda q, k, v: usp_attention(q, k, v, ug, rg, args.causal, layout, backend, **kw),
                        lambda x: shard_sequence(x, rg, layout, ulysses_group=ug, cu_seqlens=cu),
                        lambda x: gather_sequence(x, rg, layout, ulysses_group=ug, cu_seqlens=cu),
                        work_share(docs, ring, r_rank, layout) / ulysses,
                        cp_bytes("usp", *shape, ulysses=ulysses, ring=ring))
    raise ValueError(f"unknown CP algorithm {algorithm!r}")


def rel_error(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def memory_estimate(args, world) -> float:
    """Bytes one rank holds at its peak, roughly: the full q, k, v, dout every rank draws, its shards with
    their gradients, and with ``--check`` the float64 one-device reference (inputs, output, grads)."""
    elems = args.batch * args.seq * args.head_dim * (2 * args.heads + 2 * args.kv_heads)
    size = DTYPES[args.dtype].itemsize
    need = elems * size * (1 + 3 / world)
    if args.check:
        need += elems * 8 * 2.5
    return need


def make_inputs(args, device):
    """The full q, k, v, dout, drawn identically on every rank."""
    dtype = DTYPES[args.dtype]
    shape_q = (args.batch, args.seq, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq, args.kv_heads, args.head_dim)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    return [torch.randn(s, generator=gen).to(device, dtype) for s in (shape_q, shape_kv, shape_kv, shape_q)]


def one_device_mask(docs: Documents, device):
    """The whole sequence's KeyMask when there are documents or a window (else None: plain causal/full)."""
    if not docs.masked:
        return None
    pos = torch.arange(docs.total)
    return docs.mask(pos, pos, device)


def one_device_reference(q, k, v, dout, causal, docs: Documents | None = None):
    """Output and grads of the whole attention on one device, in float64 on CPU (float32 on GPU)."""
    ct = torch.float64 if q.device.type == "cpu" else torch.float32
    q, k, v, dout = (t.to(ct) for t in (q, k, v, dout))
    mask = one_device_mask(docs, q.device) if docs is not None else None
    causal = causal and mask is None
    out, lse = attention_forward(q, k, v, causal, backend="torch", mask=mask)
    return (out, *attention_backward(dout, q, k, v, out, lse, causal, backend="torch", mask=mask))


def measure(method: CPMethod, full, args, device, reference=None) -> dict:
    """Time, log and (with ``reference``, rank 0's one-device output and grads) check one method."""
    world, rank = comm.group_size(), comm.group_rank()
    q, k, v, dout = (method.shard(t) for t in full)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            method.attn(q, k, v)

    def fwd_bwd():
        method.attn(qg, kg, vg).backward(dout)

    t_fwd = time_ranks(fwd, args.iters, args.warmup, device)
    t_fb = time_ranks(fwd_bwd, args.iters, args.warmup, device)
    with comm.CommLog() as log_fwd:
        fwd()
    with comm.CommLog() as log_fb:
        qg.grad = kg.grad = vg.grad = None
        out = method.attn(qg, kg, vg)
        out.backward(dout)
    mine = torch.tensor([[t_fwd, t_fb, log_fwd.total_bytes(), log_fb.total_bytes(), method.work_share]],
                        dtype=torch.float64)
    per_rank = comm.all_gather_raw(mine, None, 0)
    result = {"method": method.name, "logged": method.logged, "comm_forward": log_fwd.as_dict(), "comm_forward_backward": log_fb.as_dict(),
              "model_bytes": method.model_bytes,
              "ranks": [dict(zip(("fwd_s", "fwd_bwd_s", "fwd_bytes", "fwd_bwd_bytes", "work_share"), row.tolist()))
                        for row in per_rank]}
    if args.check:
        got = [method.gather(t) for t in (out.detach(), qg.grad, kg.grad, vg.grad)]
        errors = torch.zeros(4, dtype=torch.float64)
        if rank == 0:
            errors = torch.tensor([rel_error(a, b) for a, b in zip(got, reference)], dtype=torch.float64)
        if world > 1:
            dist.broadcast(errors, 0)
        tol = TOLERANCE[DTYPES[args.dtype]]
        result.update(max_rel_error=dict(zip(("out", "dq", "dk", "dv"), errors.tolist())), tolerance=tol,
                      check_passed=bool(errors.max().item() <= tol))
    if args.profile != "none":
        folder = os.path.join(args.profile_dir, "".join(c if c.isalnum() else "_" for c in method.name).strip("_"))
        result["trace"] = profile_steps(fwd_bwd, args.profile, folder, rank)
    return result


def one_device_timing(full, args, device, backend) -> dict:
    fq, fk, fv, fd = full
    mask = one_device_mask(study_documents(args), device)
    causal = args.causal and mask is None

    def one_fwd():
        attention_forward(fq, fk, fv, causal, backend=backend, mask=mask)

    def one_fb():
        o, l = attention_forward(fq, fk, fv, causal, backend=backend, mask=mask)
        attention_backward(fd, fq, fk, fv, o, l, causal, backend=backend, mask=mask)

    return {"fwd_s": time_ranks(one_fwd, args.iters, args.warmup, device, barrier=False),
            "fwd_bwd_s": time_ranks(one_fb, args.iters, args.warmup, device, barrier=False)}


def reference_on_rank0(full, args, rank):
    """Rank 0 computes the one-device reference with every core (the others wait in the next collective)."""
    if not args.check or rank != 0:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return one_device_reference(*full, args.causal, study_documents(args))
    finally:
        torch.set_num_threads(threads)


def default_split(world, heads, ulysses=None, ring=None):
    """USP degrees from the flags: the given ones, else Ulysses 2 (1 for odd W or odd heads) × the rest."""
    if ulysses is None and ring is None:
        ulysses = 2 if world % 2 == 0 and heads % 2 == 0 else 1
    if ulysses is None:
        if world % ring:
            raise ValueError(f"--ring {ring} does not divide the world size {world}")
        ulysses = world // ring
    if ring is None:
        if world % ulysses:
            raise ValueError(f"--ulysses {ulysses} does not divide the world size {world}")
        ring = world // ulysses
    if ulysses * ring != world:
        raise ValueError(f"--ulysses {ulysses} x --ring {ring} = {ulysses * ring}, but the world size is {world}")
    return ulysses, ring


def run(args, algorithm="ring"):
    rt = init_runtime(device=args.device, seed=args.seed)
    world, rank, dev = rt.world_size, rt.rank, rt.device
    backend = resolve_backend(args.backend, dev, DTYPES[args.dtype],
                              masked=needs_mask(algorithm, args.layout, study_documents(args)))
    u, r = default_split(world, args.heads, args.ulysses, args.ring) if algorithm == "usp" else (1, world)
    method = build_method(algorithm, args, world, rank, dev, backend, ulysses=u, ring=r)
    check_memory(memory_estimate(args, world), dev, f"seq {args.seq} x {args.heads} heads (batch {args.batch})")
    full = make_inputs(args, dev)
    result = measure(method, full, args, dev, reference_on_rank0(full, args, rank))
    result.update(algorithm=algorithm, world_size=world, device=str(dev), backend=backend, launcher=rt.launcher,
                  args=vars(args), cpu_cores=os.cpu_count())
    if not args.no_baseline and rank == 0:
        result["one_device"] = one_device_timing(full, args, dev, backend)
    return rt, result


def summarize(result, args) -> dict:
    """Slowest-rank times, TFLOP/s and efficiency of one measured method (adds them to ``result``)."""
    a = args
    w = len(result["ranks"])
    docs = study_documents(a)
    pairs = docs.work(torch.arange(a.seq)) if docs.masked else None
    f_fwd = attention_flops(a.batch, a.seq, a.heads, a.head_dim, a.causal, pairs=pairs)
    f_fb = f_fwd + attention_flops(a.batch, a.seq, a.heads, a.head_dim, a.causal, backward=True, pairs=pairs)
    shares = [r["work_share"] for r in result["ranks"]]
    result["work_imbalance"] = max(shares) / (sum(shares) / len(shares)) if sum(shares) else 1.0
    t_fwd = max(r["fwd_s"] for r in result["ranks"])
    t_fb = max(r["fwd_bwd_s"] for r in result["ranks"])
    result["slowest"] = {"fwd_s": t_fwd, "fwd_bwd_s": t_fb}
    result["tflops"] = {"fwd": f_fwd / t_fwd / 1e12, "fwd_bwd": f_fb / t_fb / 1e12}
    if "one_device" in result:
        one = result["one_device"]
        result["efficiency"] = {"fwd": one["fwd_s"] / (w * t_fwd), "fwd_bwd": one["fwd_bwd_s"] / (w * t_fb)}
    return result


def header(result, args) -> list[str]:
    a = args
    lines = [f"batch {a.batch} · seq {a.seq} · heads {a.heads} (kv {a.kv_heads}) · head_dim {a.head_dim} · "
             f"{a.dtype} · {'causal' if a.causal else 'full'} · W={result['world_size']} ({result['launcher']}) · "
             f"{result['device']} · backend {result['backend']}"]
    if a.docs or a.window is not None:
        lines.append(f"packed: {describe(study_documents(a))}")
    if not result["device"].startswith("cuda"):
        w, cores = result["world_size"], result["cpu_cores"]
        share = f"{w} processes share {cores} CPU cores, so " if w > 1 else ""
        lines.append(f"(CPU run: CPU-sized defaults; {share}times show correctness-scale work, not scaling)")
    return lines


def report(result, args) -> str:
    summarize(result, args)
    lines = [f"{result['method']} attention"] + header(result, args) + [""]
    lines.append(f"{'rank':>4} {'fwd ms':>9} {'fwd+bwd ms':>11} {'sent fwd MB':>12} {'sent f+b MB':>12} {'work %':>7}")
    for r, row in enumerate(result["ranks"]):
        lines.append(f"{r:>4} {row['fwd_s'] * 1e3:>9.2f} {row['fwd_bwd_s'] * 1e3:>11.2f} "
                     f"{row['fwd_bytes'] / 1e6:>12.3f} {row['fwd_bwd_bytes'] / 1e6:>12.3f} "
                     f"{row['work_share'] * 100:>7.1f}")
    m = result["model_bytes"]
    lines.append(f"{'model':>4} {'':>9} {'':>11} {m['fwd'] / 1e6:>12.3f} {m['fwd_bwd'] / 1e6:>12.3f}   "
                 f"(distlab.cp.cost; rank 0 measured {'==' if result['ranks'][0]['fwd_bwd_bytes'] == m['fwd_bwd'] and result['ranks'][0]['fwd_bytes'] == m['fwd'] else '!='} model)")
    s = result["slowest"]
    lines += ["", f"slowest rank: fwd {s['fwd_s'] * 1e3:.2f} ms ({result['tflops']['fwd']:.3f} TFLOP/s), "
                  f"fwd+bwd {s['fwd_bwd_s'] * 1e3:.2f} ms ({result['tflops']['fwd_bwd']:.3f} TFLOP/s)",
              f"communication per rank: forward {result['comm_forward']['calls']}, forward+backward "
              f"{result['comm_forward_backward']['calls']}",
              f"work (visible query-key pairs) per rank: max/mean {result['work_imbalance']:.3f}"]
    if "one_device" in result:
        one, eff = result["one_device"], result["efficiency"]
        times = f"one device, whole sequence: fwd {one['fwd_s'] * 1e3:.2f} ms, fwd+bwd {one['fwd_bwd_s'] * 1e3:.2f} ms"
        if result["world_size"] == 1:   # nothing is parallel: what remains is the CP code's own overhead
            lines.append(f"{times} -> W=1, no scaling to measure; the CP path takes {1 / eff['fwd'] * 100:.0f}% / "
                         f"{1 / eff['fwd_bwd'] * 100:.0f}% of the plain call's time (fwd / fwd+bwd)")
        else:
            lines.append(f"{times} -> efficiency T_one/(W*T_cp): fwd {eff['fwd'] * 100:.1f}%, "
                         f"fwd+bwd {eff['fwd_bwd'] * 100:.1f}%")
    if result.get("trace"):
        lines.append(f"traces: {os.path.dirname(result['trace'])}/trace_rank*.json "
                     f"(python -m distlab.profiling.overlap {os.path.dirname(result['trace'])}/trace_rank*.json)")
    if "max_rel_error" in result:
        e = result["max_rel_error"]
        lines.append(f"check vs one device: max rel error out {e['out']:.2e}, dq {e['dq']:.2e}, dk {e['dk']:.2e}, "
                     f"dv {e['dv']:.2e} (tolerance {result['tolerance']:.0e}): "
                     f"{'PASS' if result['check_passed'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None, algorithm="ring"):
    args = parse_args(argv, algorithm)
    if algorithm != "usp":
        args.ulysses = args.ring = None
    rt, result = run(args, algorithm)   # bad input raises ValueError on every rank before any collective
    if rt.is_main:
        print(report(result, args), flush=True)
        if args.json:
            write_json(args.json, result)
    shutdown()
    if args.check and not result["check_passed"]:
        sys.exit(1)


if __name__ == "__main__":   # python -m distlab.cp.ring (ulysses, usp, allgather) runs this with ALGORITHM set
    from distlab.bench import run_study

    run_study(lambda: main(algorithm=globals().get("ALGORITHM", "ring")))
