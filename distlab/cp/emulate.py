"""One ring rank's schedule on one GPU, with no communication, against one fused attention call.

    python -m distlab.cp.emulate --world 8 --seq 8192 --causal --layout zigzag --backend triton --graphs
    python -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend sdpa-cudnn triton --json emulate.json

A ring rank runs W block kernels (zigzag causal: its diagonal block and W−1 half blocks) and merges each
into its running (out, LSE). Once communication hides behind compute, that is all the rank does, so its
speed against one big kernel with the same FLOPs is the ceiling of ring attention on this GPU. This
runs exactly the rank's code path of ``distlab.cp.ring`` — ``_ring_forward`` / ``_ring_backward`` — with
a stand-in exchanger whose "received" K/V of every step is already on the device (``ResidentRing``), so
the kernels, merges and their order are the real ones and nothing else is.

The fused anchor is one causal (or not) attention call over the whole sequence with H/W heads — exactly
one rank's share of the FLOPs, in one launch — with the fastest backend present (cuDNN), timed the
same way. Efficiency = the schedule's TFLOP/s / the anchor's. A small problem runs below the GPU's best
in one call too (at S=8192, W=8 the H/W-head call is itself launch- and tail-bound), so the table also
shows one call with all H heads; the schedule's TFLOP/s against that line is the stricter figure; and
"vs its own backend's H/W call" (the same anchor run with the schedule's backend) separates what the
schedule costs (launches, merges) from how fast its block kernel is. What helps, and is here: the ``triton``
backend accumulates each block into the running (out, LSE) inside its kernel (no merge launches) and, in
the backward, adds dQ and writes float32 dK/dV inside its kernels with the backward rows computed once;
other backends merge with one Triton kernel (``distlab.kernels.lse_merge``); ``--graphs`` replays the whole step
sequence as one CUDA graph (no launch gaps); ``DISTLAB_TRITON_ATTN_PDL=1`` lets each accumulating forward
start while the previous step's last wave finishes (programmatic dependent launch, sm_90+):

    DISTLAB_TRITON_ATTN_PDL=1 DISTLAB_TRITON_ATTN_FWD=64,64,4,3 python -m distlab.cp.emulate --seq 8192 32768

A real ring runs at its slowest rank's pace, and zigzag's ranks share the FLOPs but not the block shapes
(W=8, S32768: rank 0's later blocks are 2048 rows × 4096 keys, rank 7's 4096 × 2048; the middle ranks mix
both, so their launch groups hold two row sets): ``--rank all`` times every rank and prints the slowest.
``--paired 5`` times the rank and the H/W anchor again in turn, five rounds (the anchor alone is timed once,
before every rank, and the power cap moves an H100's SM clock between 1590 and 1980 MHz as the load changes:
the paired anchor read 0-4% off the first one, either way):

    python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank all --paired 5 --wall

``--variant 'SPLIT_SUM=dq' 'TMA=fwd,dq'`` times the rank once per set of launch knobs, in one process
against the same anchors. ``--steps-per-launch 1 2 4 1,1,2,4`` times the forward's step groups
(``distlab.cp.ring.launch_groups``: with ``triton`` one kernel launch a group). The stand-in exchanger has
every step's K/V resident, which a real rank has only when each group's K/V arrive while the groups before
it compute: that is why step 0 (local K/V) runs alone, with the first hop behind it, and the short group
comes first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from distlab import knobs
from distlab.cp.layout import check_divisible, chunks_per_rank, rank_chunks
from distlab.cp.local_kernels import block_flops
from distlab.cp.ring import _ring_backward, _ring_forward, check_steps_per_launch, launch_groups, ring_blocks
from distlab.cp.ring_dkv_direct import check_route
from distlab.kernels.attention import attention_backward, attention_forward, resolve_backend
from distlab.bench import time_alternating, timeit
from distlab.bench import DTYPES, StudyParser, dtype_arg, nonnegative_int, run_study


class _Ready:
    def __init__(self, tensors):
        self.recv = tensors

    def wait(self):
        return self.recv


class ResidentRing:
    """Stands in for ``comm.RingExchanger``: step i's K/V (those of rank r − i) are already resident; a
    dK/dV accumulator comes back as sent (its ``add_`` still runs, as on a real rank)."""

    def __init__(self, world, rank, kv_by_step):
        self.size, self.rank, self.kv = world, rank, kv_by_step
        self.stand_in = True   # timing probes that leave results wrong are allowed here only (knobs RING_DKV_ADDS)
        self.landing_cache = {}   # this ring's own ``ring_landing.kv_landing`` buffers (filled from its K/V)

    def exchange(self, tensors, tag, recv=None):
        if recv is not None:   # buffers from ``landing_buffer``: "received" already
            return _Ready(recv)
        if tag == "ring_kv":
            i = next(i for i, kv in enumerate(self.kv) if kv[0] is tensors[0])
            return _Ready(self.kv[i + 1])
        return _Ready(tensors)

    def exchange_after(self, pending, tag, recv=None):
        return self.exchange(pending.recv, tag, recv)

    def shift_exchange(self, tensors, shift, recv, tag):
        """dK/dV shares sent straight to their owners (``ring_dkv_direct``): the receive buffers stay as they
        are (what other ranks would send them is not computed here; the owner's sum still reads them)."""
        return _Ready(recv)

    def landing_buffer(self, shape, like, contents):
        """A K/V buffer of ``distlab.cp.ring_landing`` (``(2, 1, keys, ...)``: K, V) as the exchanges would fill
        it: its ``(step, start, length, offset)`` pieces of the resident K/V (made once per ring shape and
        kept, ``ring_landing.kv_landing``; nothing writes into received K/V)."""
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        for step, start, n, offset in contents:
            for t in (0, 1):
                buf[t][:, offset:offset + n] = self.kv[step][t][:, start:start + n]
        return buf


def rank_rows(rank, world, seq, layout):
    """The global sequence positions rank ``rank`` holds (its shard, in order)."""
    chunk = seq // (world * chunks_per_rank(layout))
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(rank, world, layout)])


def schedule_flops(world, rank, seq, heads, head_dim, causal, layout, batch=1):
    local = seq // world
    blocks = [(r.stop - r.start, c.stop - c.start, cz) for step in range(world)
              for r, c, cz in ring_blocks((rank - step) % world, rank, local, causal, layout)]
    return block_flops(batch, head_dim, heads, blocks)


def emulate_rank(world, seq, heads, kv_heads, head_dim, rank, layout, causal, backend, dtype, device,
                 backward=True, keep_output=False, graphs=False, iters=10, warmup=3, batch=1, timeline=False, mode="gpu",
                 steps_per_launch=None):
    """Time rank ``rank``'s forward (and backward) schedule; returns a dict of seconds and FLOPs (and,
    with ``keep_output``, the full q/k/v, the rank's rows and its output, for checks; with ``timeline``,
    each kernel of one forward / backward with its duration and the gap before it)."""
    check_divisible(seq, world, layout)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(device, dtype)
    shard = {r: rank_rows(r, world, seq, layout).to(device) for r in range(world)}
    kv_by_step = [(k[:, shard[(rank - i) % world]].contiguous(), v[:, shard[(rank - i) % world]].contiguous())
                  for i in range(world)]
    ring = ResidentRing(world, rank, kv_by_step)
    q_r = q[:, shard[rank]].contiguous()
    dout = torch.randn(q_r.shape, generator=g).to(device, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    backend = resolve_backend(backend, device, dtype)
    steps_per_launch = check_steps_per_launch(steps_per_launch, backend, world)

    def fwd():
        return _ring_forward(q_r, *kv_by_step[0], ring, causal, layout, scale, backend, steps_per_launch)

    out, lse = fwd()
    out = out.to(dtype)

    route = check_route(knobs.get("RING_DKV_ROUTE"))   # read here: ``--variant RING_DKV_ROUTE=direct`` is an A/B

    def bwd():
        return _ring_backward(dout, q_r, *kv_by_step[0], out, lse, ring, causal, layout, scale, backend,
                              steps_per_launch, route)

    run_f, run_b = fwd, bwd
    if graphs and device.type == "cuda":
        run_f, run_b = _graphed(fwd), (_graphed(bwd) if backward else None)
    result = {"world": world, "rank": rank, "seq": seq, "layout": layout, "causal": causal, "backend": backend,
              "steps_per_launch": steps_per_launch,
              "graphs": bool(graphs and device.type == "cuda"),
              "flops_fwd": schedule_flops(world, rank, seq, heads, head_dim, causal, layout, batch)}
    result["fwd_s"] = timeit(run_f, iters, warmup, device, mode)
    if backward:
        result["bwd_s"] = timeit(run_b, iters, warmup, device, mode)
    if timeline and device.type == "cuda":
        from distlab.profiling.timeline import kernel_timeline

        # the eager calls, queued behind the timeline's spin kernel: a graph replay has no ops to name its kernels
        result["timeline_fwd"] = kernel_timeline(fwd, origins=True)
        if backward:
            result["timeline_bwd"] = kernel_timeline(bwd, origins=True)
    if keep_output:   # what one more (graph-replayed) run leaves: the checks' view of the timed path
        result.update(q=q, k=k, v=v, rows=shard[rank].cpu(), dout=dout, out=run_f()[0].to(dtype))
        if backward:
            result["dq"] = run_b()[0]
    result["calls"] = (run_f, run_b if backward else None)   # the timed calls, for ``--paired`` (not written to JSON)
    return result


def _graphed(fn):
    """Capture ``fn`` (a fixed sequence of kernels on static tensors) once; returns a function that replays
    it and returns the captured call's (static) outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()

    def replay():
        graph.replay()
        return static
    return replay


def fused_anchor(world, seq, heads, kv_heads, head_dim, causal, dtype, device, iters=10, warmup=3, batch=1,
                 backend="auto", timeline=False, mode="gpu"):
    """One attention call over the whole sequence with H/W heads (one rank's FLOPs), by default with the
    fastest backend. ``world=1``: all H heads — the whole problem in one call, the GPU's attention rate at
    this length. ``backend``: the schedule's own backend, to separate schedule overhead from kernel speed."""
    h = max(1, heads // world)
    hk = max(1, kv_heads * h // heads)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, seq, h, head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, seq, hk, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, seq, hk, head_dim, generator=g).to(device, dtype)
    backend = resolve_backend(backend, device, dtype)
    out, lse = attention_forward(q, k, v, causal, backend=backend)
    dout = torch.randn_like(q)
    flops = 4 * batch * seq * seq * h * head_dim * (0.5 if causal else 1.0)
    fwd = lambda: attention_forward(q, k, v, causal, backend=backend)   # noqa: E731
    bwd = lambda: attention_backward(dout, q, k, v, out, lse, causal, backend=backend)   # noqa: E731
    result = {"backend": backend, "flops_fwd": flops, "fwd_s": timeit(fwd, iters, warmup, device, mode),
              "bwd_s": timeit(bwd, iters, warmup, device, mode), "calls": (fwd, bwd)}
    if timeline and device.type == "cuda":
        from distlab.profiling.timeline import kernel_timeline

        result.update(timeline_fwd=kernel_timeline(fwd), timeline_bwd=kernel_timeline(bwd))
    return result


def paired_timing(r, calls, anchor, anchor_calls, iters, device, mode, rounds):
    """The rank's calls (``calls``: forward, backward or None) and the anchor's timed in turn
    (``time_alternating``), and the rank's efficiency against that anchor: fwd and f+b."""
    fns = {"rank_fwd": calls[0], "anchor_fwd": anchor_calls[0]}
    if calls[1] is not None:
        fns.update(rank_bwd=calls[1], anchor_bwd=anchor_calls[1])
    t = time_alternating(fns, iters, 1, device, mode, rounds)
    pr = {"rounds": rounds, "fwd_s": t["rank_fwd"], "anchor_fwd_s": t["anchor_fwd"],
          "efficiency_fwd": (r["flops_fwd"] / t["rank_fwd"]) / (anchor["flops_fwd"] / t["anchor_fwd"])}
    if calls[1] is not None:
        pr.update(bwd_s=t["rank_bwd"], anchor_bwd_s=t["anchor_bwd"],
                  efficiency_fwd_bwd=(r["flops_fwd"] / (t["rank_fwd"] + t["rank_bwd"]))
                  / (anchor["flops_fwd"] / (t["anchor_fwd"] + t["anchor_bwd"])))
    return pr


def _print_slowest(rows, seq, layout):
    """Per configuration (backend, launch groups, variant), the rank with the lowest efficiency: the ring's pace."""
    key = "efficiency_fwd_bwd" if "efficiency_fwd_bwd" in rows[0] else "efficiency_fwd"
    configs: dict = {}
    for r in rows:
        configs.setdefault((r["backend"], str(r["steps_per_launch"]), r["variant"]), []).append(r)
    for (backend, groups, variant), rs in configs.items():
        low = min(rs, key=lambda r: r[key])
        line = (f"{seq:>6} {layout:>10} {backend:>11}: slowest of ranks {[r['rank'] for r in rs]}: rank {low['rank']}, "
                f"{'f+b' if key.endswith('bwd') else 'fwd'} {100 * low[key]:.1f}%")
        if "paired" in low:
            paired = min(rs, key=lambda r: r["paired"][key])
            line += f"; paired: rank {paired['rank']}, {100 * paired['paired'][key]:.1f}%"
        print(line + (f"   [{variant}]" if variant else ""), flush=True)


def _print_timelines(r, own, seq, layout, a):
    from distlab.profiling.timeline import format_timeline

    local = seq // a.world
    launches = [[(rw.stop - rw.start, c.stop - c.start, cz) for step in group   # triton: one kernel a group
                 for rw, c, cz in ring_blocks((r["rank"] - step) % a.world, r["rank"], local, a.causal, layout)]
                for group in launch_groups(a.world, r["steps_per_launch"])]
    fwd_flops = [block_flops(1, a.head_dim, a.heads, blk) for blk in launches if blk] \
        if r["backend"] == "triton" else None
    name = f"S{seq} {layout} {r['backend']} rank {r['rank']}"
    print(format_timeline(r["timeline_fwd"], f"{name}: forward", fwd_flops))
    print(format_timeline(own["timeline_fwd"], f"{name}: its backend's fused H/W call, forward", [own["flops_fwd"]]))
    if "timeline_bwd" in r:
        print(format_timeline(r["timeline_bwd"], f"{name}: backward"))
        print(format_timeline(own["timeline_bwd"], f"{name}: its backend's fused H/W call, backward"))


def variant_knobs(variant):
    """The knobs of a ``--variant`` (``'K=V;K=V'``, names without ``TRITON_ATTN_`` allowed), for
    ``knobs.override``."""
    return knobs.parse_settings(variant, "TRITON_ATTN_")


def main(argv=None):
    gpu = torch.cuda.is_available()
    p = StudyParser(prog="python -m distlab.cp.emulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--seq", type=int, nargs="+", default=[8192] if gpu else [1024])
    p.add_argument("--heads", type=int, default=32 if gpu else 8)
    p.add_argument("--kv-heads", type=int, default=8 if gpu else 2)
    p.add_argument("--head-dim", type=int, default=128 if gpu else 32)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", nargs="+", default=["zigzag"], choices=("zigzag", "contiguous"))
    p.add_argument("--backend", nargs="+", default=["triton", "sdpa-cudnn"] if gpu else ["torch"])
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=gpu, help="replay as a CUDA graph")
    p.add_argument("--wall", action="store_true", help="wall clock: back-to-back calls from Python, launch latency "
                   "included, no spin kernel and no graph (what a real ring over NCCL pays), rank and anchors alike")
    p.add_argument("--rank", nargs="+", default=None, metavar="R|all",
                   help="the ranks to time, one row each, or 'all', and the slowest of them (default: the busiest, W-1 "
                        "contiguous, 0 zigzag — zigzag's ranks share the FLOPs, not the block shapes; a real ring runs "
                        "at its slowest rank's pace)")
    p.add_argument("--dtype", type=dtype_arg("bfloat16", "float16", "float32"), default="bfloat16" if gpu else "float32",
                   help="bf16, fp16 or fp32")
    p.add_argument("--iters", type=int, default=20 if gpu else 2)
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--steps-per-launch", nargs="+", default=[None], metavar="N|SIZES",
                   help="the forward's steps per group (distlab.cp.ring.launch_groups; triton: one kernel launch a "
                        "group): n from 1 to 4, or group sizes adding up to W such as 1,1,2,4 (more than 4 a group for the "
                        "fused backends: 1,2,5; default: "
                        "distlab.cp.ring's, 4 for triton, fa4 and sdpa-cudnn, 1 for the others)")
    p.add_argument("--variant", nargs="+", default=[""], metavar="K=V;K=V",
                   help="time the rank once per variant: ';'-separated knob settings in force for that run "
                        "(names without DISTLAB_ are DISTLAB_TRITON_ATTN_ knobs), e.g. 'SPLIT_SUM=dq;TMA=fwd,dq'; "
                        "'' is the environment as it is")
    p.add_argument("--paired", type=nonnegative_int, default=0, metavar="ROUNDS",
                   help="also time the rank and the H/W anchor in turn, ROUNDS rounds of --iters calls each "
                        "(distlab.bench.time_alternating), and print the efficiency against that anchor: both timed "
                        "under the same load (the anchor on its own is timed once, before every rank)")
    p.add_argument("--timeline", action="store_true",
                   help="GPU: print each kernel of one forward / backward (duration, gap before it), rank and anchor")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.rank is not None:
        if a.rank != ["all"] and not all(x.isdigit() for x in a.rank):
            raise ValueError(f"--rank {' '.join(a.rank)}: ring ranks (0 to {a.world - 1}) or 'all'")
        a.rank = list(range(a.world)) if a.rank == ["all"] else [int(x) for x in a.rank]
        if any(not 0 <= rank < a.world for rank in a.rank):
            raise ValueError(f"--rank {a.rank}: the ranks of a ring of {a.world} are 0 to {a.world - 1}")
    device = torch.device("cuda" if gpu else "cpu")
    dtype = DTYPES[a.dtype]
    mode = "wall" if a.wall else "gpu"
    if a.wall:
        a.graphs = False   # a graph replay hides the launches that the wall clock is there to count
    rows = []
    print(f"one ring rank's schedule, no communication, {device} {a.dtype}, {mode} timing: W={a.world}, heads {a.heads} "
          f"(kv {a.kv_heads}), head_dim {a.head_dim}, causal {a.causal}; eff = TFLOP/s against one call with H/W "
          f"heads (the same FLOPs); the line 'fused H' is one call with all H heads (the GPU's rate at this length)")
    set_now = knobs.in_force()
    print("knobs: " + (" ".join(f"{k}={v}" for k, v in set_now.items()) or "none set (defaults)"))
    print(f"{'seq':>6} {'layout':>10} {'backend':>11} {'groups':>9} {'graph':>5} | {'fwd ms':>8} {'TFLOP/s':>8} {'eff':>6} | "
          f"{'f+b ms':>8} {'TFLOP/s':>8} {'eff':>6}")
    for seq in a.seq:
        anchor = fused_anchor(a.world, seq, a.heads, a.kv_heads, a.head_dim, a.causal, dtype, device, a.iters, mode=mode)
        whole = fused_anchor(1, seq, a.heads, a.kv_heads, a.head_dim, a.causal, dtype, device, a.iters, mode=mode)
        anchor_calls = anchor.pop("calls")
        whole.pop("calls")
        a_f = anchor["flops_fwd"] / anchor["fwd_s"]
        a_fb = 3.5 * anchor["flops_fwd"] / (anchor["fwd_s"] + anchor["bwd_s"])
        w_f = whole["flops_fwd"] / whole["fwd_s"]
        w_fb = 3.5 * whole["flops_fwd"] / (whole["fwd_s"] + whole["bwd_s"])
        for label, an, f_, fb_ in (("fused H/W", anchor, a_f, a_fb), ("fused H", whole, w_f, w_fb)):
            print(f"{seq:>6} {label:>10} {an['backend']:>11} {'-':>9} {'-':>5} | {an['fwd_s'] * 1e3:>8.3f} {f_ / 1e12:>8.1f} "
                  f"{100 * f_ / a_f:>5.1f}% | {(an['fwd_s'] + an['bwd_s']) * 1e3:>8.3f} {fb_ / 1e12:>8.1f} "
                  f"{100 * fb_ / a_fb:>5.1f}%")
        for layout in a.layout:
            ranks = a.rank if a.rank is not None else [a.world - 1 if layout == "contiguous" else 0]
            for rank, backend, n, variant in itertools.product(ranks, a.backend, a.steps_per_launch, a.variant):
                n = check_steps_per_launch(n if n is not None else knobs.get("RING_STEPS_PER_LAUNCH"), backend, a.world)
                try:
                    with knobs.override(**variant_knobs(variant)):
                        r = emulate_rank(a.world, seq, a.heads, a.kv_heads, a.head_dim, rank, layout, a.causal, backend,
                                         dtype, device, backward=not a.no_backward, graphs=a.graphs, iters=a.iters,
                                         timeline=a.timeline, steps_per_launch=n, mode=mode)
                        own = anchor if backend == anchor["backend"] and not a.timeline else fused_anchor(
                            a.world, seq, a.heads, a.kv_heads, a.head_dim, a.causal, dtype, device, a.iters,
                            backend=backend, timeline=a.timeline, mode=mode)
                        own.pop("calls", None)
                        calls = r.pop("calls")
                        if a.paired:
                            r["paired"] = paired_timing(r, calls, anchor, anchor_calls, a.iters, device, mode, a.paired)
                except (RuntimeError, ValueError) as e:   # a backend that cannot run (or be captured) here
                    print(f"{seq:>6} {layout:>10} {backend:>11}: failed: {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                r["variant"] = variant
                o_f = own["flops_fwd"] / own["fwd_s"]
                o_fb = 3.5 * own["flops_fwd"] / (own["fwd_s"] + own["bwd_s"])
                f = r["flops_fwd"] / r["fwd_s"]
                r.update(anchor=anchor, whole=whole, own_anchor=own, tflops_fwd=f / 1e12, efficiency_fwd=f / a_f,
                         efficiency_fwd_vs_whole=f / w_f, efficiency_fwd_vs_own=f / o_f)
                groups = "|".join(str(len(g)) for g in launch_groups(a.world, n))
                where = layout + (f" r{rank}" if a.rank is not None else "")   # the rank when asked for
                line = (f"{seq:>6} {where:>10} {r['backend']:>11} {groups:>9} {'yes' if r['graphs'] else 'no':>5} | "
                        f"{r['fwd_s'] * 1e3:>8.3f} {f / 1e12:>8.1f} {100 * f / a_f:>5.1f}%")
                if not a.no_backward:
                    fb = 3.5 * r["flops_fwd"] / (r["fwd_s"] + r["bwd_s"])
                    r.update(tflops_fwd_bwd=fb / 1e12, efficiency_fwd_bwd=fb / a_fb,
                             efficiency_fwd_bwd_vs_whole=fb / w_fb, efficiency_fwd_bwd_vs_own=fb / o_fb)
                    line += f" | {(r['fwd_s'] + r['bwd_s']) * 1e3:>8.3f} {fb / 1e12:>8.1f} {100 * fb / a_fb:>5.1f}%"
                    line += (f"   vs fused H: {100 * f / w_f:.1f}% / {100 * fb / w_fb:.1f}%   vs its own backend's "
                             f"H/W call ({o_f / 1e12:.0f} / {o_fb / 1e12:.0f} TFLOP/s): {100 * f / o_f:.1f}% / "
                             f"{100 * fb / o_fb:.1f}%")
                print(line + (f"   [{variant}]" if variant else ""), flush=True)
                if "paired" in r:
                    pr = r["paired"]
                    print(f"{'':>6} {'paired':>10} {'':>11} {'':>9} {'':>5} | {pr['fwd_s'] * 1e3:>8.3f} {'':>8} "
                          f"{100 * pr['efficiency_fwd']:>5.1f}%" + ("" if a.no_backward else
                          f" | {(pr['fwd_s'] + pr['bwd_s']) * 1e3:>8.3f} {'':>8} {100 * pr['efficiency_fwd_bwd']:>5.1f}%")
                          + f"   against the H/W call timed in turn with it ({pr['rounds']} rounds): "
                          f"{pr['anchor_fwd_s'] * 1e3:.3f}"
                          + ("" if a.no_backward else f" / {(pr['anchor_fwd_s'] + pr['anchor_bwd_s']) * 1e3:.3f}")
                          + " ms", flush=True)
                if "timeline_fwd" in r:
                    _print_timelines(r, own, seq, layout, a)
                rows.append(r)
            if len(ranks) > 1:
                _print_slowest([r for r in rows if r["seq"] == seq and r["layout"] == layout], seq, layout)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu", "args": vars(a), "knobs": set_now,
                       "results": rows}, f,
                      indent=1)


if __name__ == "__main__":
    run_study(main)
