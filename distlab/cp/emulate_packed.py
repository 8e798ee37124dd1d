"""A ring rank's packed-document schedule on one GPU, against one device running the same pack with the same
kernel; and the masked kernel's rate on visible pairs.

    python -m distlab.cp.emulate_packed --world 8 --seq 32768 65536 --json packed.json          # GPU
    python -m distlab.cp.emulate_packed --device cpu --seq 1024 --heads 4 --kv-heads 2 --head-dim 16 --iters 1
    python -m distlab.cp.emulate_packed --tiles-only --layouts zigzag balanced units docs-first:0.25    # any machine
    python -m distlab.cp.emulate_packed --world 8 --seq 65536 --method allgather --layouts balanced units  # GPU

For each sequence length and layout, every rank's ring schedule runs with the K/V of all its steps already
on the device (``distlab.cp.ring_packed``'s own code with the exchanges removed: what is left is the masked
kernels, which merge into the running results themselves with ``triton``, and the ceiling once
communication hides behind compute), and the slowest rank's time T_r is kept; the anchor is the whole
pack's masked attention in one call, T_one. Efficiency = T_one / (W · T_r): 100% is perfect scaling of the
same kernel. Forward and forward+backward, each timed two ways: "GPU" (launches queued behind a spin kernel:
what the kernels take) and "wall" (plain back-to-back calls, launch latency included), the headline.
Then the kernel alone on one call over packs of shorter and shorter documents: TFLOP/s counted on visible
pairs stays level when the tiles a mask removes cost nothing.

Beside the clocks, on any machine, the tiles: what the masked Triton kernel visits with its H200 tiles
(forward: key tiles of 128×64 per query tile; backward: dQ's key tiles plus dK/dV's query tiles, 64×64),
counted from the same tile tables the kernel uses, for each rank's blocks and for the one call. ``tile
bound`` = one call's tiles / (W · the busiest rank's): the efficiency a rank could reach if a tile cost the
same everywhere (no launch, merge or partial-wave cost) — the ceiling a layout sets before any clock runs;
``blocks``: the most forward launches a rank makes (a block each; the backward two). ``--layouts`` also takes
the balanced layout's candidates (``units``, ``docs-first:0.25``, ...) to time them against each other.
"""

from __future__ import annotations

import functools

import torch

from distlab.bench import (DTYPES, StudyParser, add_common_args, positive_int, resolve_device, run_study,
                           time_wall, write_json)
from distlab.cp.documents import Documents, describe, parse_docs
from distlab.cp.layout import shard_positions
from distlab.cp.ring_packed import step_blocks
from distlab.profiling import kernel_summary
from distlab.kernels.attention import attention_backward, attention_forward, resolve_backend
from distlab.bench import timeit


def rank_schedule(q, k, v, dout, docs, positions, rank, backend, steps_per_launch=1):
    """(forward, forward+backward) callables of ring rank ``rank``'s packed schedule, every K/V resident:
    ``distlab.cp.ring_packed``'s own ``_forward``/``_backward`` over a ``ResidentRing`` (no exchange), the
    forward's steps in the launch groups of ``steps_per_launch`` (``distlab.cp.packed_groups``)."""
    from distlab.cp.emulate import ResidentRing
    from distlab.cp.ring_packed import _backward, _forward

    world = len(positions)
    # the ring's own blocks: rows that see each step (and each launch group)
    blocks = step_blocks(docs, positions, rank, q.device, steps_per_launch=steps_per_launch)
    mine = positions[rank].to(q.device)
    qr, dr = q[:, mine].contiguous(), dout[:, mine].contiguous()
    kv = [(k[:, positions[(rank - s) % world].to(q.device)].contiguous(),
           v[:, positions[(rank - s) % world].to(q.device)].contiguous()) for s in range(world)]
    ring = ResidentRing(world, rank, kv)

    def fwd():
        return _forward(qr, *kv[0], ring, blocks, None, backend)

    def fwd_bwd():
        out, lse = fwd()
        return _backward(dr, qr, *kv[0], out, lse, ring, blocks, None, backend)

    return fwd, fwd_bwd


class _Ctx:
    """What ``distlab.cp.allgather``'s autograd function keeps between its forward and backward, run by hand."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *_):
        pass


def allgather_schedule(q, k, v, dout, docs, positions, rank, backend, chunks=None):
    """(forward, forward+backward) callables of all-gather CP's rank ``rank``: ``distlab.cp.allgather``'s own
    forward and backward run at world 1 over every rank's K/V already gathered (in rank order, as the
    all-gather leaves them), in its kv-head groups (``chunks``; its default: two where the kv heads split
    evenly): its compute, with the gather and reduce-scatter removed."""
    from distlab.cp.allgather import _AllGatherAttention, default_chunks, gathered_mask, keys_as_gathered

    mine, everyone = positions[rank].to(q.device), torch.cat(list(positions)).to(q.device)
    qr, dr = q[:, mine].contiguous(), dout[:, mine].contiguous()
    kg, vg = k[:, everyone].contiguous(), v[:, everyone].contiguous()
    mask, order = keys_as_gathered(q, *gathered_mask(docs, positions, rank, q.device), backend)
    chunks = chunks if chunks is not None else default_chunks(k.shape[2])
    args = (None, 1, mask, q.shape[-1] ** -0.5, backend, chunks, order)

    def fwd():
        return _AllGatherAttention.forward(_Ctx(), qr, kg, vg, *args)

    def fwd_bwd():
        ctx = _Ctx()   # the forward keeps its tensors and arguments there, as autograd's context
        _AllGatherAttention.forward(ctx, qr, kg, vg, *args)
        return _AllGatherAttention.backward(ctx, dr, None)[:3]   # (dq, dk, dv)

    return fwd, fwd_bwd


def visited_tiles(mask, head_dim: int) -> dict:
    """{"fwd", "bwd", "dq", "dkv"}: the tiles the masked Triton kernel visits under ``mask`` with its H200 tile
    sizes, per head (bwd = dQ's + dK/dV's)
    (module doc; the tables are ``distlab.kernels.masks``', kept in the mask's memo)."""
    from distlab.kernels.masks import key_tiles, masked_tiles, query_ranges, range_tiles

    (fm, fn, *_), (bm, bn, *_) = (masked_tiles(torch.device("cuda"), head_dim, kind) for kind in ("fwd", "bwd"))
    seq_k = mask.k_pos.numel()
    dq, dkv = int(key_tiles(mask, bm, bn).sum()), int(range_tiles(*query_ranges(mask, seq_k, bn), bm).sum())
    return {"fwd": int(key_tiles(mask, fm, fn).sum()), "bwd": dq + dkv, "dq": dq, "dkv": dkv}


def tile_row(docs, positions, head_dim: int, method: str = "ring", steps_per_launch=1) -> dict:
    """Each rank's visited tiles over its ring blocks (the forward's by launch group, ``steps_per_launch``;
    ``method`` allgather: over its rows against every key, one block), the one call's, and the bound they set
    (module doc)."""
    every = torch.arange(docs.total)
    one = visited_tiles(docs.mask(every, every), head_dim)
    keys = torch.cat(list(positions)).sort().values
    ranks = []
    for rank in range(len(positions)):
        tiles = {"fwd": 0, "bwd": 0, "blocks": 0}   # blocks: the rank's forward launches (two each backward)
        if method == "ring":
            plan = step_blocks(docs, positions, rank, "cpu", steps_per_launch=steps_per_launch)
            masks = [mask for blocks in plan for _, _, mask in blocks]
            forward = [mask for *_, blocks in plan.launches for _, _, mask in blocks] if plan.launches else masks
        else:
            masks = forward = [docs.mask(positions[rank], keys)]
        for mask in forward:   # the forward's blocks, and dQ's (by launch groups as the forward)
            tiles["blocks"] += 1
            seen = visited_tiles(mask, head_dim)
            tiles["fwd"] += seen["fwd"]
            tiles["bwd"] += seen["dq"]
        for mask in masks:     # dK/dV's: per ring step
            tiles["bwd"] += visited_tiles(mask, head_dim)["dkv"]
        ranks.append(tiles)
    world = len(positions)
    bound = {kind: one[kind] / (world * max(r[kind] for r in ranks)) for kind in ("fwd", "bwd")}
    return {"one_call": one, "ranks": ranks, "bound": bound, "most_blocks": max(r["blocks"] for r in ranks)}


def _heavy(layout: str) -> float:
    try:
        heavy = float(layout.partition(":")[2])
    except ValueError:
        heavy = -1.0
    if not 0 <= heavy <= 1:
        raise ValueError(f"--layouts {layout}: give docs-first:H with H a fraction in [0, 1], e.g. docs-first:0.25")
    return heavy


def check_layout_names(layouts) -> None:
    """A ValueError for a ``--layouts`` name that is neither a CP layout nor a balanced candidate (before any
    clock runs)."""
    from distlab.cp.layout import LAYOUTS

    for layout in layouts:
        if layout.startswith("docs-first:"):
            _heavy(layout)
        elif layout not in (*LAYOUTS, "units"):
            raise ValueError(f"--layouts {layout}: choose from {', '.join(LAYOUTS)}, units, docs-first:H")


def placement_positions(layout: str, docs, world: int) -> list[torch.Tensor]:
    """Per rank, the positions of ``layout``: a CP layout, or one of the balanced layout's candidates — ``units``
    (the units deal) or ``docs-first:H`` (``documents_first`` with a heavy threshold H) — to time them apart."""
    from distlab.cp.layout import documents_first, units_positions

    if layout == "units":
        return units_positions(docs.total, world, docs.cu_seqlens)
    if layout.startswith("docs-first:"):
        pos = documents_first(docs.total, world, docs.cu_seqlens, _heavy(layout))
        if any(p.numel() != docs.total // world for p in pos):
            raise ValueError(f"--layouts {layout}: this threshold does not place this pack (a rank over- or under-"
                             "filled; the balanced layout skips it too)")
        return pos
    return [shard_positions(docs.total, world, r, layout, docs.cu_seqlens) for r in range(world)]


def placed_layouts(layouts, docs, world):
    """(layout, positions, pair imbalance) for each ``--layouts`` name that places this pack (a ``docs-first``
    threshold that does not is said and skipped)."""
    for layout in layouts:
        try:
            positions = placement_positions(layout, docs, world)
        except ValueError as e:
            if "does not place this pack" not in str(e):
                raise
            print(f"{docs.total:>6} {layout:<16} skipped: {e}")
            continue
        work = [docs.work(pos) for pos in positions]
        yield layout, positions, max(work) / (sum(work) / world)


def one_call(q, k, v, dout, docs, backend):
    pos = torch.arange(docs.total)
    mask = docs.mask(pos, pos, q.device)

    def fwd():
        return attention_forward(q, k, v, False, None, backend, mask=mask)

    def fwd_bwd():
        o, l = fwd()
        return attention_backward(dout, q, k, v, o, l, False, None, backend, mask=mask)

    return fwd, fwd_bwd


def print_summary(summary, what, top=8):
    print(f"{'':>8}{what}: wall {summary['wall_s'] * 1e3:.2f} ms (profiled), kernels {summary['kernel_s'] * 1e3:.2f} ms in "
          f"{sum(k['count'] for k in summary['kernels'])} launches")
    for k in summary["kernels"][:top]:
        print(f"{'':>10}{k['total_us']:>9.0f} µs {k['count']:>4}x  {k['name'][:90]}")


def measure(fns, args, device):
    """{name: {"gpu_s", "wall_s"}} for each callable."""
    return {name: {"gpu_s": timeit(fn, args.iters, args.warmup, device),
                   "wall_s": time_wall(fn, args.iters, args.warmup, device)} for name, fn in fns.items()}


def ring_steps(a, backend):
    """The packed ring's launch groups (``steps_per_launch``): its default for ``backend`` (one launch a step),
    or the studies' knob ``DISTLAB_RING_STEPS_PER_LAUNCH``; 1 for ``--method allgather``."""
    from distlab import knobs
    from distlab.cp.ring import check_steps_per_launch

    if a.method != "ring":
        return 1
    return check_steps_per_launch(knobs.get("RING_STEPS_PER_LAUNCH"), backend, a.world, packed=True)


def tiles_only(a) -> dict:
    """``--tiles-only``: each layout's pair imbalance, tile bound and block count, no tensor and no clock (any
    machine, seconds)."""
    steps = ring_steps(a, "triton")   # the masked Triton ring's, whose tiles these are
    result = {"world": a.world, "head_dim": a.head_dim, "docs": a.docs, "steps_per_launch": steps, "rows": []}
    print(f"tiles the masked kernel visits (H200 tiles), W={a.world}, head_dim {a.head_dim}, --docs {a.docs}")
    print(f"{'seq':>6} {'layout':<16} {'imbal.':>6}   {'tile bound f/b':>14} {'blocks':>6}")
    for seq in a.seq or [32768, 65536]:
        docs = Documents.from_args(seq, parse_docs(a.docs, seq), True, None)
        for layout, positions, imbalance in placed_layouts(a.layouts, docs, a.world):
            row = {"seq": seq, "layout": layout, "imbalance": imbalance,
                   "tiles": tile_row(docs, positions, a.head_dim, a.method, steps)}
            bound = row["tiles"]["bound"]
            print(f"{seq:>6} {layout:<16} {row['imbalance']:>6.3f}   {bound['fwd'] * 100:>6.1f}/"
                  f"{bound['bwd'] * 100:>5.1f}% {row['tiles']['most_blocks']:>6}")
            result["rows"].append(row)
    return result


def kernel_rates(a, seq, means, device, dtype, backend) -> list:
    """The masked kernel alone on one pack of ``seq`` tokens per mean document length: TFLOP/s on visible pairs."""
    print(f"\nthe masked kernel alone, seq {seq}: TFLOP/s on visible pairs (4·pairs·h·d fwd, 2.5x that bwd)")
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, dout = (torch.randn(1, seq, h, a.head_dim, generator=g).to(device, dtype)
                     for h in (a.heads, a.kv_heads, a.kv_heads, a.heads))
    rates = []
    for mean in means:
        spec = "" if mean >= seq else f"lognormal:mean={mean},seed=0"
        docs = Documents.from_args(seq, parse_docs(spec, seq) if spec else torch.tensor([0, seq]), True, None)
        pairs = docs.work(torch.arange(seq))
        t = measure(dict(zip(("fwd", "fwd_bwd"), one_call(q, k, v, dout, docs, backend))), a, device)
        flops = 4 * pairs * a.heads * a.head_dim
        rate = {"pairs": pairs, "mean_doc": mean, "fwd_tflops": flops / t["fwd"]["gpu_s"] / 1e12,
                "fwd_bwd_tflops": 3.5 * flops / t["fwd_bwd"]["gpu_s"] / 1e12, "times": t}
        rates.append(rate)
        print(f"  mean doc {mean:>6}: {pairs / 1e6:>9.1f} M pairs  fwd {rate['fwd_tflops']:>6.1f}  "
              f"fwd+bwd {rate['fwd_bwd_tflops']:>6.1f} TFLOP/s (GPU)")
    return rates


def main(argv=None):
    p = StudyParser(prog="python -m distlab.cp.emulate_packed", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=positive_int, default=8)
    p.add_argument("--seq", type=positive_int, nargs="+", default=None, help="default 32768 65536 (GPU), 1024 (CPU)")
    p.add_argument("--docs", default="lognormal:mean=2048,seed=0", help="the pack (as the CP studies' --docs)")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "balanced"],
                   help="CP layouts, and the balanced layout's candidates: units, docs-first:H (e.g. docs-first:0.25)")
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--backend", default="auto")
    p.add_argument("--profile", nargs="*", default=None, metavar="LAYOUT",
                   help="also list the kernels of the slowest rank's forward+backward (torch.profiler), per layout "
                        "given (none: every layout)")
    p.add_argument("--timeline", nargs="*", default=None, metavar="LAYOUT",
                   help="also print each kernel of the slowest rank's forward+backward with its start and the GPU's "
                        "idle gap before it (distlab.profiling.timeline; kernels of several streams overlap), per "
                        "layout given (none: every layout)")
    p.add_argument("--rate-means", type=positive_int, nargs="*", default=None,
                   help="mean document lengths for the kernel-rate table (default 32768 8192 2048 512)")
    p.add_argument("--tiles-only", action="store_true", help="only the tile bound and block counts (no clocks)")
    p.add_argument("--method", choices=("ring", "allgather"), default="ring",
                   help="the rank's schedule: the packed ring's (default), or all-gather CP's compute "
                        "(``allgather_schedule``; its tile columns are then the gathered mask's)")
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="--method allgather: its kv-head groups (default: all-gather CP's, two where they split)")
    add_common_args(p, iters=10, warmup=3, dtypes=("bfloat16", "float16", "float32"))
    a = p.parse_args(argv)
    check_layout_names(a.layouts)
    if a.tiles_only:
        result = tiles_only(a)
        if a.json:
            write_json(a.json, result)
        return
    device = resolve_device(a.device)
    gpu = device.type == "cuda"
    dtype = DTYPES[a.dtype or ("bfloat16" if gpu else "float32")]
    seqs = a.seq or ([32768, 65536] if gpu else [1024])
    backend = resolve_backend(a.backend, device, dtype, masked=True)
    result = {"world": a.world, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "dtype": str(dtype),
              "backend": backend, "device": torch.cuda.get_device_name() if gpu else "cpu", "rows": [], "rates": []}
    steps = ring_steps(a, backend)
    if a.method == "ring":
        from distlab.cp.ring import launch_groups

        result["launch_groups"] = [len(g) for g in launch_groups(a.world, steps)]
        schedule = functools.partial(rank_schedule, steps_per_launch=steps)
    else:
        if a.chunks is not None and a.kv_heads % a.chunks:
            p.error(f"--chunks {a.chunks} must divide --kv-heads {a.kv_heads}")
        schedule = functools.partial(allgather_schedule, chunks=a.chunks)
        result["chunks"] = a.chunks
    method = "ring" if a.method == "ring" else "all-gather"
    groups = f", forward launch groups {'|'.join(map(str, result['launch_groups']))}" if a.method == "ring" else ""
    print(f"a {method} rank's packed schedule vs one call, W={a.world}, {a.heads} q / {a.kv_heads} kv heads, "
          f"head_dim {a.head_dim}, {str(dtype)[6:]}, backend {backend}{groups}, {result['device']}")
    print(f"{'seq':>6} {'layout':<16} {'imbal.':>6}  {'fwd wall':>9} {'f+b wall':>9}   {'fwd GPU':>8} {'f+b GPU':>8}"
          f"   {'tile bound f/b':>14} {'blocks':>6}   {'rank f/fb ms (wall)':>20}")
    for seq in seqs:
        docs = Documents.from_args(seq, parse_docs(a.docs, seq), True, None)
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v, dout = (torch.randn(1, seq, h, a.head_dim, generator=g).to(device, dtype)
                         for h in (a.heads, a.kv_heads, a.kv_heads, a.heads))
        one = measure(dict(zip(("fwd", "fwd_bwd"), one_call(q, k, v, dout, docs, backend))), a, device)
        profiles = []
        for layout, positions, imbalance in placed_layouts(a.layouts, docs, a.world):
            ranks = [measure(dict(zip(("fwd", "fwd_bwd"), schedule(q, k, v, dout, docs, positions, r, backend))),
                             a, device) for r in range(a.world)]
            row = {"seq": seq, "layout": layout, "method": a.method, "docs": describe(docs), "imbalance": imbalance,
                   "one_call": one, "ranks": ranks, "efficiency": {},
                   "tiles": tile_row(docs, positions, a.head_dim, a.method, steps)}
            for kind in ("fwd", "fwd_bwd"):
                for clock in ("wall_s", "gpu_s"):
                    slowest = max(r[kind][clock] for r in ranks)
                    row["efficiency"][f"{kind}_{clock[:-2]}"] = one[kind][clock] / (a.world * slowest)
            e = row["efficiency"]
            worst = max(range(a.world), key=lambda r: ranks[r]["fwd_bwd"]["wall_s"])
            print(f"{seq:>6} {layout:<16} {row['imbalance']:>6.3f}  {e['fwd_wall'] * 100:>8.1f}% {e['fwd_bwd_wall'] * 100:>8.1f}%"
                  f"   {e['fwd_gpu'] * 100:>7.1f}% {e['fwd_bwd_gpu'] * 100:>7.1f}%   "
                  f"{row['tiles']['bound']['fwd'] * 100:>6.1f}/{row['tiles']['bound']['bwd'] * 100:>5.1f}% "
                  f"{row['tiles']['most_blocks']:>6}   "
                  f"r{worst} {ranks[worst]['fwd']['wall_s'] * 1e3:.2f} / {ranks[worst]['fwd_bwd']['wall_s'] * 1e3:.2f}")
            wanted = [(kind, names) for kind, names in (("profile", a.profile), ("timeline", a.timeline))
                      if gpu and names is not None and (not names or layout in names)]
            profiles += [(kind, row, positions, worst) for kind, _ in wanted]
            result["rows"].append(row)
        # after every clock of this length: a layout timed right after the profiler ran read 13 points low
        if any(kind == "profile" for kind, *_ in profiles):   # the one call's kernels, to set beside the rank's
            result.setdefault("one_call_profiles", {})[seq] = one_profile = kernel_summary(
                one_call(q, k, v, dout, docs, backend)[1], device)
            print_summary(one_profile, "one call fwd+bwd")
        for kind, row, positions, worst in profiles:
            fn = schedule(q, k, v, dout, docs, positions, worst, backend)[1]
            title = f"{row['layout']} r{worst} fwd+bwd"
            if kind == "profile":
                row["profile"] = kernel_summary(fn, device)
                print_summary(row["profile"], title)
            else:
                from distlab.profiling.timeline import format_timeline, kernel_timeline, summarize

                timeline = kernel_timeline(fn)
                row["timeline"] = {"kernels": timeline, **summarize(timeline)}
                print(format_timeline(timeline, title))
        print(f"{'':>6} one call: fwd {one['fwd']['wall_s'] * 1e3:.2f} ms, fwd+bwd {one['fwd_bwd']['wall_s'] * 1e3:.2f} ms "
              f"(wall); {describe(docs)}")
    means = a.rate_means if a.rate_means is not None else ([32768, 8192, 2048, 512] if gpu else [512, 64])
    if means:
        result["rates"] = kernel_rates(a, max(seqs), means, device, dtype, backend)
    if a.json:
        write_json(a.json, result)


if __name__ == "__main__":
    run_study(main)
