"""A wave model of the masked Triton kernels on a GPU: where a packed ring rank loses against one call (#23).

    python -m distlab.cp.waves --world 8 --seq 65536 --layouts zigzag balanced units      # any machine, seconds
    python -m distlab.cp.waves --measured docs/perf/h200_2026-12-05b/backward_{rows_1:rows,auto_1:lpt,auto_2:lpt+dq}.json
    python -m distlab.cp.waves --docs lognormal:mean=2048,seed={0..9} --layouts balanced units   # ten packs' spread

The tile bound (``distlab.cp.emulate_packed --tiles-only``) counts the tiles a rank visits against one call's,
as if a tile cost the same everywhere. What it leaves out is how the tiles reach the GPU: a launch is a grid of
programs (a query tile of one head, or a key tile of one kv head), each looping over its tiles, started in
grid order on the SMs as they free up; a launch ends with its last program, so a rank's short launches end in
partial waves that one long call hides. This module replays that: each kernel's programs, their loop lengths
counted from the same tile tables the kernels use (``distlab.kernels.masks``), list-scheduled in the order
the GPU starts them onto ``--sms`` SMs (``--per-sm``: how many programs of a kind an SM holds at once),
with a kernel waiting for the kernels its stream (or an event) puts before it. A program costs
``--overhead`` tiles (loading its rows, the epilogue) plus one per tile; the backward's tiles are weighted
4 : 3 (dK/dV's four matmuls a tile against dQ's three) and scaled so one call's backward/forward ratio is
the measured one (``--bwd-ratio``, H200 2026-12-05: 26.59 / 6.13 ms).

Rank schedules (the ring's own blocks, ``distlab.cp.ring_packed.step_blocks``), each against one call in
grid order, are listed in ``chain``. Efficiency = one call's time / (W · the slowest rank's), forward and
forward+backward (one call's backward scaled to ``--bwd-ratio`` times its forward).

The defaults are fitted to the H200 (2026-12-05, ``docs/perf/h200_2026-12-05b``: 64k pack, W=8, zigzag /
balanced / units, GPU clock, schedules rows, lpt, lpt+dq, fwd and f+b, 18 figures): a kernel starts 30 µs
after the one it waits for (``--gap-us``: launch, ramp up and down), a program costs 1.5 tiles more than its
loop (``--overhead``), one program an SM at a time, forward or backward (``--per-sm 1 1``); a forward tile
takes 2.0 µs (``--tile-us``: the one call's 6.13 ms). RMS error 2.3 points, worst +4.9 (a grid of
gap 10-50 µs, overhead 0.5-3, one or two backward programs an SM; docs/PERF.md has the table). A model: it
ranks schedules and layouts before a GPU times them; the clocks decide.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

import torch

from distlab.bench import StudyParser, positive_int, run_study, write_json
from distlab.cp.documents import Documents, describe, parse_docs
from distlab.kernels.masks import key_tiles, query_ranges, range_tiles

FWD_TILE, BWD_TILE = (128, 64), (64, 64)   # the masked kernel's H200 tiles (``masked_tiles``, head_dim <= 128)
DKV_WEIGHT, DQ_WEIGHT = 4.0, 3.0           # matmuls per tile: dK/dV's four, dQ's three
SPLIT_MERGE = 0.5                          # ``--split``: a part's partial (out, LSE) written and merged, in tiles
SCHEDULES = ("rows", "lpt", "lpt+dq", "dq once", "bwd4", "fwd2+bwd4", "lpt+dq pdl", "fwd2+bwd4 pdl", "fwd groups",
             "groups", "grouped", "no barrier")
COLUMNS = SCHEDULES + ("all-gather rows", "all-gather")   # and all-gather CP's compute on the same layout, its tiles
# in row order (until the 24th session) and longest first (the masked kernel's ``auto`` for a rank's share; ``layout_row``)


@dataclass
class Kernel:
    """One launch: its programs' costs in the order the GPU starts them, the units of an SM's capacity each
    takes (``per_sm_units``), the kernels (indices in the launch list) that must end before it starts, and
    ``pdl``: the kernel before it on its stream when it is a programmatic dependent launch — that one need
    only have started all its programs (no gap then), and a program of this one whose loop ends before it
    has ended holds its SM until it has (it waits at ``gdc_wait`` before its epilogue)."""
    name: str
    costs: list
    units: int = 2
    after: tuple = ()
    pdl: tuple = ()
    end: float = field(default=0.0, compare=False)


def simulate(kernels, sms: int = 132, gap: float = 0.0, capacity: int = 2) -> float:
    """List-schedule ``kernels`` (in launch order) on ``sms`` SMs of ``capacity`` units each; return when the last
    program ends (and set each kernel's ``end``). A kernel starts once those in ``after`` have ended and those
    in ``pdl`` have started all their programs; the programs of started kernels are dispatched earliest
    launch first — a launch whose next program finds no room holds back the launches after it, as the GPU's
    block scheduler does — each to the fullest SM with room (so empty ones stay free for programs that need
    a whole SM). ``gap``: the time from a kernel's last wait ending to its first program (launch latency and
    ramp; none for a kernel with no wait, or one launched early by ``pdl``)."""
    n = len(kernels)
    to_start = [set(k.after) | set(k.pdl) for k in kernels]   # what must happen before a kernel starts
    to_end = [set(k.pdl) for k in kernels]                    # its programs end only after these have
    on_dispatch, on_end, on_pdl_end = ([[] for _ in kernels] for _ in range(3))
    for i, k in enumerate(kernels):
        for j in k.after:
            on_end[j].append(i)
        for j in k.pdl:
            on_dispatch[j].append(i)
            on_pdl_end[j].append(i)
    free, room = [capacity] * sms, {u: set() for u in range(1, capacity + 1)}
    room[capacity] = set(range(sms))
    left, nxt, ready, running, parked = [len(k.costs) for k in kernels], [0] * n, [], [], {}
    now, ended = 0.0, 0

    def start(i):
        if not kernels[i].costs:   # nothing to run: it ends as it starts
            dispatched(i)
            end(i)
        elif kernels[i].after and gap > 0 and not kernels[i].pdl:   # its first program after the gap
            heapq.heappush(running, (now + gap, -1, i))
        else:
            bisect.insort(ready, i)

    def dispatched(i):
        for d in on_dispatch[i]:
            to_start[d].discard(i)
            if not to_start[d]:
                start(d)

    def release(sm, units):
        if free[sm]:
            room[free[sm]].discard(sm)
        free[sm] += units
        room[free[sm]].add(sm)

    def end(i):
        nonlocal ended
        kernels[i].end, ended = now, ended + 1
        for d in on_pdl_end[i]:   # its parked programs end once the kernel it follows has
            to_end[d].discard(i)
            if not to_end[d] and d in parked:
                for sm in parked.pop(d):
                    release(sm, kernels[d].units)
                    left[d] -= 1
                if left[d] == 0:
                    end(d)
        for d in on_end[i]:
            to_start[d].discard(i)
            if not to_start[d]:
                start(d)

    def take(units):
        for have in range(units, capacity + 1):
            if room[have]:
                sm = room[have].pop()
                free[sm] = have - units
                if free[sm]:
                    room[free[sm]].add(sm)
                return sm
        return None

    for i, k in enumerate(kernels):
        if not k.after and not k.pdl:
            start(i)
    while True:
        while ready:
            i = ready[0]
            sm = take(kernels[i].units)
            if sm is None:
                break
            heapq.heappush(running, (now + kernels[i].costs[nxt[i]], sm, i))
            nxt[i] += 1
            if nxt[i] == len(kernels[i].costs):
                ready.pop(0)
                dispatched(i)
        if not running:
            break
        now, sm, i = heapq.heappop(running)
        if sm < 0:   # kernel i's gap is over
            bisect.insort(ready, i)
            continue
        if to_end[i]:   # waits for the kernel it follows, holding its SM
            parked.setdefault(i, []).append(sm)
            continue
        release(sm, kernels[i].units)
        left[i] -= 1
        if left[i] == 0:
            end(i)
    if ended < n:
        raise ValueError("kernels wait on each other in a cycle")
    return max((k.end for k in kernels), default=0.0)


def _order(lengths, heads: int, lpt: bool) -> list:
    """Per-program tile counts in start order: grid (tiles, heads) in row order, head by head; or (heads,
    tiles) with the tiles sorted longest first (stable), every head of a tile before the next tile."""
    n = lengths.tolist()
    if lpt:
        order = torch.argsort(lengths, descending=True, stable=True).tolist()
        return [n[t] for t in order for _ in range(heads)]
    return n * heads


def _split(lengths, cap):
    """Per-tile loop lengths with every loop longer than ``cap`` tiles cut into ⌈n / cap⌉ equal programs
    (split-K: each writes a partial result that a merge adds up; the merge is ``SPLIT_MERGE`` tiles a part)."""
    if not cap:
        return lengths
    out = []
    for n in lengths.tolist():
        parts = max(1, math.ceil(n / cap))
        out += [n / parts + (SPLIT_MERGE if parts > 1 else 0.0)] * parts
    return torch.tensor(out, dtype=torch.float64)


def block_costs(mask, heads: int, kv_heads: int, lpt: bool, ring_block: bool, overhead: float, split=None) -> dict:
    """{"fwd", "dkv", "dq"}: the program costs, in tiles, of one masked block's three kernels in start order
    (``ring_block``: its dK/dV covers only the keys some row sees, as ``masked_backward`` with accumulators;
    ``split``: no program loops over more than that many tiles, ``_split``; not built, a what-if)."""
    from distlab.kernels.masks import seen_keys

    groups = heads // kv_heads
    sub = seen_keys(mask)[1] if ring_block else mask
    qb, qe = query_ranges(sub, sub.k_pos.numel(), BWD_TILE[1])
    return {"fwd": [overhead + n for n in _order(_split(key_tiles(mask, *FWD_TILE), split), heads, lpt)],
            "dkv": [overhead + DKV_WEIGHT * groups * n
                    for n in _order(_split(range_tiles(qb, qe, BWD_TILE[0]), split), kv_heads, lpt)],
            "dq": [overhead + DQ_WEIGHT * n for n in _order(_split(key_tiles(mask, *BWD_TILE), split), heads, lpt)]}


class _Streams:
    """Kernels queued on streams: each waits for the one before it on its stream (``pdl``: as its programmatic
    dependent) and for any ``waits`` (events: whole kernels)."""

    def __init__(self, pdl=False):
        self.kernels, self.last, self.pdl = [], {}, pdl

    def launch(self, stream, name, costs, units, waits=()):
        before = self.last.get(stream)
        follows = (before,) if self.pdl and before is not None and costs and self.kernels[before].costs else ()
        after = tuple(i for i in (None if follows else before, *waits) if i is not None)
        self.kernels.append(Kernel(name, costs, units, after, follows))
        self.last[stream] = len(self.kernels) - 1
        return self.last[stream]


def chain(blocks, schedule: str, bwd_scale: float = 1.0, backward: bool = True, units=(2, 1), later_dq=None,
          world=None, groups=None) -> list:
    """Kernels of a rank's (or one call's) blocks — ``(step, block_costs)`` in step order — on the streams of
    ``schedule`` (``SCHEDULES``): ``rows``/``lpt``, one stream; ``lpt+dq``, each dQ on a second stream after its
    dK/dV (``DISTLAB_PACKED_BWD_STREAMS=2``); ``bwd4``, besides, each step's dK/dV on one of two streams in turn
    (``PACKED_BWD_STREAMS=4``, the default); ``fwd2+bwd4``, also the forward's later steps on a second stream beside
    step 0's (``PACKED_FWD_STREAMS=2``); ``... once`` (written, tested on the CPU, dropped on this model's word:
    docs/PERF.md): the later steps' dQ in one launch over their keys gathered in position order (program costs
    ``later_dq``, from ``later_steps_mask``), queued on the dQ stream when the last step's K/V arrive (step
    ``world`` − 1, after what the caller's stream holds by then); ``... pdl`` (not built; a bound, since the whole
    fitted gap goes, not only the launch latency PDL hides): every kernel a programmatic dependent of the one before
    it on its stream (``Kernel.pdl``), as the unpacked Triton ring's kernels can be (``DISTLAB_TRITON_ATTN_PDL=1``);
    ``fwd groups`` (not built): each forward step group of the unpacked Triton ring (``launch_groups(W, 4)``: 0 | 1
    2 3 | 4 5 6 7) in one launch, the backward as ``lpt+dq``; ``groups`` (built, ``distlab.cp.packed_groups``):
    the forward and dQ by launch groups, each group's keys gathered in position order and one block
    (``groups``: its ``(first step, costs)``), each step's dK/dV as ``bwd4``'s (``blocks``: the steps'), the
    dQ launches on their own stream (measured on the H100 against ``bwd4``: 4 points slower, where this model
    put it 7 higher — docs/PERF.md); ``grouped`` (not built: what a kernel taking several
    blocks a launch would give), step 0's forward blocks, then one forward launch for the later steps and one dK/dV
    and one dQ launch for all blocks, each longest first; ``no barrier``, no kernel waits for another. A backward
    program's cost is scaled by ``bwd_scale``; ``units``: the SM units a forward and a backward program take."""
    if schedule == "fwd groups":   # hypothetical: each step group's forward blocks in one launch, then lpt+dq
        from distlab.cp.ring import launch_groups

        grouped = []
        for group in launch_groups(_steps(blocks, world), 4):
            mine = [b for step, b in blocks if step in group]
            if mine:
                grouped.append((group.start, {"fwd": sorted((c for b in mine for c in b["fwd"]), reverse=True),
                                              "dkv": [], "dq": []}))
        kernels = chain(grouped, "lpt", backward=False, units=units)
        if backward:   # the backward as lpt+dq, after the last forward launch
            rest = chain(blocks, "lpt+dq", bwd_scale, units=units)[len(blocks):]
            shift = len(kernels) - len(blocks)
            for k in rest:
                k.after = tuple(i + shift for i in k.after)
            kernels += rest
        return kernels
    if schedule == "groups":   # built: the forward and dQ by launch groups, one block each; dK/dV as bwd4
        q = _Streams()
        for _, b in groups:
            q.launch("main", "fwd", b["fwd"], units[0])
        if not backward:
            return q.kernels
        last_fwd = q.last["main"]
        for step, b in blocks:   # each step's dK/dV on one of two streams in turn
            stream = f"dkv {step % 2}"
            q.launch(stream, "dkv", [bwd_scale * c for c in b["dkv"]], units[1], () if stream in q.last else (last_fwd,))
        for _, b in groups:      # each group's dQ on its own stream (the K/V are resident: after the forward)
            q.launch("dq", "dq", [bwd_scale * c for c in b["dq"]], units[1], () if "dq" in q.last else (last_fwd,))
        return q.kernels
    if schedule == "grouped":   # hypothetical: step 0's forward, then one launch for the rest and one per kind
        first = [Kernel("fwd", b["fwd"], units[0]) for step, b in blocks if step == 0]
        later = sorted((c for step, b in blocks if step > 0 for c in b["fwd"]), reverse=True)
        kernels = first + ([Kernel("fwd", later, units[0])] if later else [])
        if backward:
            kernels += [Kernel(name, sorted((bwd_scale * c for _, b in blocks for c in b[name]), reverse=True),
                               units[1]) for name in ("dkv", "dq")]
        for i in range(1, len(kernels)):
            kernels[i].after = (i - 1,)
        return kernels
    if schedule == "no barrier":
        return [Kernel(name, [c * (1.0 if name == "fwd" else bwd_scale) for c in b[name]], units[name != "fwd"])
                for name in (("fwd", "dkv", "dq") if backward else ("fwd",)) for _, b in blocks]
    pdl = schedule.endswith(" pdl")
    schedule = schedule.removesuffix(" pdl")
    q = _Streams(pdl)
    two = schedule.startswith("fwd2+")             # the forward's later steps on a side stream
    four = schedule in ("bwd4", "fwd2+bwd4")       # each step's dK/dV on one of two streams in turn
    once = schedule.endswith("once") and later_dq is not None
    once_queued = False
    for step, b in blocks:
        q.launch("fwd side" if two and step > 0 else "main", "fwd", b["fwd"], units[0])
    if not backward:
        return q.kernels
    if two and "fwd side" in q.last:   # the merge of the two running results waits for both
        q.launch("main", "merge", [], units[0], (q.last["fwd side"],))
    last_dkv = q.last["main"]
    last_step = _steps(blocks, world) - 1
    for step, b in blocks + [(last_step + 1, None)]:
        if once and not once_queued and step >= last_step:   # the last K/V are here: after the main stream
            q.launch("dq", "dq once", [bwd_scale * c for c in later_dq], units[1], (q.last["main"],))
            once_queued = True
        if b is None:
            break
        dkv = [bwd_scale * c for c in b["dkv"]]
        dq = [bwd_scale * c for c in b["dq"]]
        if schedule in ("rows", "lpt"):
            q.launch("main", "dkv", dkv, units[1])
            q.launch("main", "dq", dq, units[1])
            continue
        stream = f"dkv {step % 2}" if four else "main"
        at = q.launch(stream, "dkv", dkv, units[1], (last_dkv,) if stream not in q.last else ())
        if not (once and step > 0):
            q.launch("dq", "dq", dq, units[1], (at,))
    return q.kernels


def _steps(blocks, world):
    """The ring's steps: ``world``, or (unknown) one past the last step with a block."""
    return world if world is not None else max(step for step, _ in blocks) + 1


def later_steps_mask(docs, positions, rank):
    """The mask of a rank's rows against every later step's keys gathered in position order, over the one run
    of rows that sees any of them (``... once``: the later steps' dQ in one launch), or None."""
    from distlab.cp.ring_packed import row_runs

    world = len(positions)
    if world == 1:
        return None
    keys = torch.cat([positions[(rank - step) % world] for step in range(1, world)]).sort().values
    mask = docs.mask(positions[rank], keys)
    runs = row_runs(mask, positions[rank].numel())
    return mask.rows(*runs[0]) if runs else None


def per_sm_units(fwd_per_sm: int, bwd_per_sm: int) -> tuple:
    """(SM capacity, units of a forward program, units of a backward program) for programs that fit
    ``fwd_per_sm`` / ``bwd_per_sm`` at a time on one SM."""
    capacity = math.lcm(fwd_per_sm, bwd_per_sm)
    return capacity, capacity // fwd_per_sm, capacity // bwd_per_sm


def layout_row(docs, positions, heads, kv_heads, sms, overhead, bwd_ratio, gap_us=0.0, tile_us=2.0,
               per_sm=(1, 1), row_gap=None, split=None) -> dict:
    """Model efficiencies of one layout's slowest rank against one call, per schedule: {schedule: {"fwd",
    "fb"}, "one_call_fwd_ms"}, one call's backward scaled to ``bwd_ratio`` times its forward; ``gap_us``
    between a kernel and the one it waits for, ``tile_us`` a forward tile's time; ``per_sm``: forward and
    backward programs an SM holds at once; ``row_gap``: ``step_blocks``' (None: the ring's own); ``split``: the
    rank's kernels' loops cut at that many tiles (``block_costs``; a what-if), the one call's kept whole (its
    long loops end inside its many waves; split, it would only pay the parts' overhead and merges)."""
    from distlab.cp.ring_packed import ROW_GAP, step_blocks

    row_gap = ROW_GAP if row_gap is None else row_gap
    every = torch.arange(docs.total)
    one = block_costs(docs.mask(every, every), heads, kv_heads, False, False, overhead)   # its kernel unsplit
    capacity, *units = per_sm_units(*per_sm)
    t_fwd = simulate(chain([(0, one)], "rows", backward=False, units=units), sms, 0.0, capacity)
    gap = gap_us / tile_us
    scale = bwd_ratio * t_fwd / (simulate(chain([(0, one)], "rows", units=units), sms, 0.0, capacity) - t_fwd)
    one_fb = simulate(chain([(0, one)], "rows", scale, units=units), sms, gap, capacity)
    world, row = len(positions), {"one_call_fwd_ms": t_fwd * tile_us / 1e3}
    plans = [step_blocks(docs, positions, rank, "cpu", row_gap, steps_per_launch=4) for rank in range(world)]
    masks = [[(step, mask) for step, blocks in enumerate(plan) for _, _, mask in blocks] for plan in plans]
    group_masks = [[(steps.start, mask) for steps, _, blocks in plan.launches or () for _, _, mask in blocks]
                   for plan in plans]
    later_masks = [later_steps_mask(docs, positions, rank) for rank in range(world)]
    costs = {lpt: [([(step, block_costs(m, heads, kv_heads, lpt, True, overhead, split)) for step, m in rank_masks],
                    None if later is None else block_costs(later, heads, kv_heads, lpt, True, overhead, split)["dq"],
                    [(step, block_costs(m, heads, kv_heads, lpt, True, overhead, split)) for step, m in grouped]
                    or None)
                   for rank_masks, later, grouped in zip(masks, later_masks, group_masks)] for lpt in (False, True)}
    for schedule in SCHEDULES:
        f_max = fb_max = 0.0
        for blocks, later, groups in costs[schedule != "rows"]:   # tiles longest first except in ``rows``
            name = "bwd4" if schedule == "groups" and groups is None else schedule   # W < 3: no group
            f_max = max(f_max, simulate(chain(blocks, name, backward=False, units=units, world=world, groups=groups),
                                        sms, gap, capacity))
            fb_max = max(fb_max, simulate(chain(blocks, name, scale, units=units, later_dq=later, world=world,
                                                groups=groups), sms, gap, capacity))
        row[schedule] = {"fwd": t_fwd / (world * f_max), "fb": one_fb / (world * fb_max)}
    # all-gather CP on the same layout (``distlab.cp.allgather``): each rank's rows against every key in position
    # order, in two kv-head groups (its default), one launch per kernel and group, one stream, the programs in row
    # order or longest first; its gather and reduce-scatter are not counted (they travel behind the other group's
    # compute)
    chunks = 2 if kv_heads % 2 == 0 else 1
    keys = torch.cat(list(positions)).sort().values
    masks = [docs.mask(positions[rank], keys) for rank in range(world)]
    for name, lpt in (("all-gather rows", False), ("all-gather", True)):
        f_max = fb_max = 0.0
        for mask in masks:
            b = block_costs(mask, heads // chunks, kv_heads // chunks, lpt, False, overhead, split)
            kernels = [(c, b) for c in range(chunks)]
            f_max = max(f_max, simulate(chain(kernels, "rows", backward=False, units=units), sms, gap, capacity))
            fb_max = max(fb_max, simulate(chain(kernels, "rows", scale, units=units), sms, gap, capacity))
        row[name] = {"fwd": t_fwd / (world * f_max), "fb": one_fb / (world * fb_max)}
    return row


def main(argv=None):
    p = StudyParser(prog="python -m distlab.cp.waves", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=positive_int, default=8)
    p.add_argument("--seq", type=positive_int, nargs="+", default=[65536])
    p.add_argument("--layouts", nargs="+", default=["zigzag", "balanced", "units"])
    p.add_argument("--docs", nargs="+", default=["lognormal:mean=2048,seed=0"],
                   help="one pack or several (e.g. lognormal:mean=2048,seed={0..9}: then each layout's spread)")
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--sms", type=positive_int, default=132, help="SMs (H200: 132)")
    p.add_argument("--overhead", type=float, default=1.5, help="a program's fixed cost, in tiles")
    p.add_argument("--bwd-ratio", type=float, default=26.59 / 6.13, help="one call's backward / forward time")
    p.add_argument("--gap-us", type=float, default=30.0, help="from a kernel's wait ending to its first program, µs")
    p.add_argument("--per-sm", type=positive_int, nargs=2, default=[1, 1], metavar=("FWD", "BWD"),
                   help="forward and backward programs an SM holds at once")
    p.add_argument("--tile-us", type=float, default=2.0, help="a forward tile's time on one SM, µs (H200: the 64k "
                   "pack's one call, 6.13 ms, over its 3067.5 modelled tiles)")
    p.add_argument("--row-gap", type=int, default=None, help="rows that see nothing between two runs of a step, "
                   "below which they are one block (default: the ring's ROW_GAP; the shard length: a launch a step)")
    p.add_argument("--split", type=positive_int, default=None, metavar="TILES",
                   help="what-if (not built): a rank's kernels' loops cut at TILES tiles (split-K, partial results "
                        "merged at SPLIT_MERGE tiles a part); the one call keeps its kernel whole")
    p.add_argument("--measured", nargs="+", default=[], metavar="JSON:SCHEDULE",
                   help="``distlab.cp.emulate_packed`` JSON timed under a schedule (e.g. docs/perf/h200_2026-12-05b/"
                        "backward_auto_2.json:lpt+dq): its GPU efficiencies beside the model's (first --docs), and "
                        "the RMS error")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    measured = _read_measured(a.measured)
    from distlab.cp.emulate_packed import placed_layouts

    print(f"wave model, W={a.world}, {a.heads} q / {a.kv_heads} kv heads, {a.sms} SMs, program overhead "
          f"{a.overhead} tiles: slowest rank vs one call, fwd / f+b")
    print(f"{'seq':>6} {'layout':<10} " + " ".join(f"{s:>14}" for s in COLUMNS) + "   one call fwd ms")
    rows, errors = [], []
    for seq, spec in ((seq, spec) for spec in a.docs for seq in a.seq):
        docs = Documents.from_args(seq, parse_docs(spec, seq), True, None)
        if len(a.docs) > 1:
            print(f"--docs {spec}: {describe(docs)}")
        for layout, positions, imbalance in placed_layouts(a.layouts, docs, a.world):
            row = layout_row(docs, positions, a.heads, a.kv_heads, a.sms, a.overhead, a.bwd_ratio, a.gap_us,
                             a.tile_us, tuple(a.per_sm), a.row_gap, a.split)
            print(f"{seq:>6} {layout:<10} " + " ".join(f"{row[s]['fwd'] * 100:>6.1f}/{row[s]['fb'] * 100:>5.1f}%"
                                                    for s in COLUMNS) + f"   {row['one_call_fwd_ms']:.2f}", flush=True)
            rows.append({"seq": seq, "docs": spec, "layout": layout, "imbalance": imbalance, "model": row})
            for schedule, fwd, fb in measured.get((seq, layout), []) if spec == a.docs[0] else []:
                rows[-1].setdefault("measured", {})[schedule] = {"fwd": fwd, "fb": fb}
                errors += [row[schedule]["fwd"] - fwd, row[schedule]["fb"] - fb]
                print(f"{'':>6} {'':<10} measured {schedule}: {fwd * 100:.1f}/{fb * 100:.1f}% (model "
                      f"{(row[schedule]['fwd'] - fwd) * 100:+.1f}/{(row[schedule]['fb'] - fb) * 100:+.1f})")
    if errors:
        rms = math.sqrt(sum(e * e for e in errors) / len(errors))
        print(f"model against {len(errors)} measured figures: RMS {rms * 100:.1f} points, worst "
              f"{max(errors, key=abs) * 100:+.1f}")
    spread = _spread(rows) if len(a.docs) > 1 else {}
    for (seq, layout), by_schedule in spread.items():
        print(f"{seq:>6} {layout:<10} over {len(a.docs)} packs, f+b median [min, max]: " +
              ", ".join(f"{s} {m * 100:.1f} [{lo * 100:.1f}, {hi * 100:.1f}]" for s, (m, lo, hi) in by_schedule.items()))
    if a.json:
        write_json(a.json, {"args": vars(a), "rows": rows,
                            "spread": [{"seq": k[0], "layout": k[1], "fb": v} for k, v in spread.items()]})
    return rows


def _spread(rows) -> dict:
    """{(seq, layout): {schedule: (median, min, max) of f+b over the packs}}."""
    import statistics

    out = {}
    for r in rows:
        for schedule in COLUMNS:
            out.setdefault((r["seq"], r["layout"]), {}).setdefault(schedule, []).append(r["model"][schedule]["fb"])
    return {k: {s: (statistics.median(v), min(v), max(v)) for s, v in by.items()} for k, by in out.items()}


def _read_measured(specs) -> dict:
    """{(seq, layout): [(schedule, fwd, f+b)]}: GPU efficiencies from ``emulate_packed`` JSON files."""
    import json

    found = {}
    for spec in specs:
        path, _, schedule = spec.rpartition(":")
        if schedule not in SCHEDULES:
            raise ValueError(f"--measured {spec}: name a schedule after the colon ({', '.join(SCHEDULES)})")
        with open(path) as f:
            for r in json.load(f)["rows"]:
                e = r["efficiency"]
                found.setdefault((r["seq"], r["layout"]), []).append((schedule, e["fwd_gpu"], e["fwd_bwd_gpu"]))
    return found


if __name__ == "__main__":
    run_study(main)
