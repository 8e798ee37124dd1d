"""Sequence layouts for context parallelism: which tokens each rank holds.

    python -m pytest tests/test_ring.py -k layout

``contiguous``: the sequence is cut into W equal chunks; rank r holds chunk r. Causal attention then
gives rank W−1 W times the work of rank 0.

``zigzag``: the sequence is cut into 2W chunks; rank r holds chunks r and 2W−1−r (in that order). Every
rank then holds one early and one late chunk, so causal attention costs every rank the same.

``balanced`` (packed documents, ``cu_seqlens=``): every rank holds T/W tokens and about the same causal work
(visible query–key pairs, documents respected) whatever the document lengths, with as many pairs as
possible on one rank: ``documents_first`` keeps documents whole, longest first, on the least loaded rank
with room, and cuts those heavier than a fraction of a rank's share zigzag over a few ranks; the fraction
goes down (1/2, 1/4, ... 0: every document cut over all ranks) until the busiest rank is within 5% of the
mean (#23's bound: the coarsest cut that meets it keeps the most documents whole, so the fewest blocks and
partial tiles; ``python -m distlab.cp.emulate_packed --tiles-only`` counts them). Should none be, the units
deal: the sequence cut into m equal units per rank (2, 4, 8 or 16), dealt heaviest first to the rank with
the least work that has room (``balanced_units``). Either way a rank's tokens are kept in position order;
the length must divide by 2W. Whole documents matter on the GPU: a ring step's block of a few rows of a
split document is a launch that barely fills the GPU (H200, 64k lognormal pack: docs/PERF.md). Without
``cu_seqlens`` it is zigzag (one document cut over all ranks).

USP (a Ulysses group of U ranks inside each ring position, ``ulysses_group=``): the sequence is first cut
for the ring group as above, then each ring shard is cut into U contiguous pieces, piece u to Ulysses
rank u. The Ulysses all-to-all concatenates the pieces in rank order, so it rebuilds exactly the ring
shard (for zigzag: chunk r followed by chunk 2R−1−r), and the ring's zigzag masks stay correct.

``shard_positions`` gives the global positions a rank holds, in its shard's order: what the CP methods
use to build their masks, whatever the layout.
"""

from __future__ import annotations

import torch

import functools

from distlab import comm

LAYOUTS = ("contiguous", "zigzag", "balanced")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def chunks_per_rank(layout: str) -> int:
    """Chunks of equal length a rank's shard is made of (balanced: its length divides by 2 as zigzag's; where
    its tokens lie depends on the documents: ``shard_positions``)."""
    check_layout(layout)
    return 1 if layout == "contiguous" else 2


def check_divisible(seq_len: int, world: int, layout: str, ulysses: int = 1) -> None:
    """Raise ValueError unless ``seq_len`` splits evenly for ``world`` ring ranks in ``layout``, each ring
    shard then into ``ulysses`` pieces."""
    parts = world * chunks_per_rank(layout)
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} is not divisible by {parts} "
                         f"({'2 x ' if layout == 'zigzag' else ''}{world} ranks, {layout} layout)")
    if (seq_len // world) % ulysses:
        raise ValueError(f"sequence length {seq_len} is not divisible by {world * ulysses} "
                         f"({world} ring x {ulysses} Ulysses ranks)")


def rank_chunks(rank: int, world: int, layout: str) -> list[int]:
    """Indices of the sequence chunks (of ``world * chunks_per_rank``) that ``rank`` holds, in order
    (contiguous and zigzag; the balanced layout's tokens depend on the documents: ``shard_positions``)."""
    if layout == "balanced":
        raise ValueError("the balanced layout's chunks depend on the documents: use shard_positions")
    return [rank, 2 * world - 1 - rank] if chunks_per_rank(layout) == 2 else [rank]


UNIT_CHOICES = (2, 4, 8, 16)
BALANCE_TARGET = 1.05   # the busiest rank's work over the mean that a coarser placement must reach


def units_per_rank(total: int, world: int, cu_seqlens=None) -> int:
    """m, the units per rank of the units deal (module doc)."""
    key = None if cu_seqlens is None else tuple(torch.as_tensor(cu_seqlens).tolist())
    return _balanced(total, world, key)[0]


def unit_work(total: int, units: int, cu_seqlens=None) -> torch.Tensor:
    """Causal visible pairs of the queries of each of ``units`` equal units (documents respected)."""
    pos = torch.arange(total)
    if cu_seqlens is None:
        start = torch.zeros_like(pos)
    else:
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
        start = cu[torch.searchsorted(cu, pos, right=True) - 1]
    return (pos - start + 1).view(units, -1).sum(1)


def _deal(total: int, world: int, m: int, cu):
    """(imbalance, units per rank) of dealing ``world·m`` units heaviest first to the least loaded rank."""
    work = unit_work(total, world * m, cu).tolist()
    load, room, owned = [0] * world, [m] * world, [[] for _ in range(world)]
    for unit in sorted(range(world * m), key=lambda u: (-work[u], u)):     # heaviest first, ties by position
        r = min((r for r in range(world) if room[r]), key=lambda r: (load[r], r))
        load[r] += work[unit]
        room[r] -= 1
        owned[r].append(unit)
    return max(load) / (sum(load) / world), tuple(tuple(sorted(units)) for units in owned)


@functools.lru_cache(maxsize=64)
def _balanced(total: int, world: int, cu_key: tuple | None) -> tuple[int, tuple[tuple[int, ...], ...]]:
    cu = None if cu_key is None else torch.tensor(cu_key)
    choices = [m for m in UNIT_CHOICES if total % (world * m) == 0]
    if not choices:
        raise ValueError(f"the balanced layout needs a sequence length divisible by 2 x {world} ranks; got {total}")
    best = None
    for m in choices:
        imbalance, owned = _deal(total, world, m, cu)
        if best is None or imbalance < best[0]:
            best = (imbalance, m, owned)
        if imbalance <= BALANCE_TARGET:
            break
    return best[1], best[2]


def _causal_pairs(a: int, b: int) -> int:
    """Causal visible pairs of the queries at document-relative rows [a, b)."""
    return (b * (b + 1) - a * (a + 1)) // 2


def documents_first(total: int, world: int, cu_seqlens=None, heavy: float = 0.5) -> list[torch.Tensor]:
    """Per rank, ascending global positions: whole documents where they fit, so most pairs stay on one rank.

    A document whose causal work exceeds ``heavy`` of a rank's share is cut into 2k equal chunks dealt
    zigzag to the k least loaded ranks with room (chunks i and 2k−1−i together: the same work), k the
    smallest with at most ``heavy`` of a share each; the other documents go whole, longest first, to the
    least loaded rank with room, and one that fits nowhere fills the roomiest ranks piece by piece. Every
    rank ends with exactly T/W tokens."""
    cu = [0, total] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    docs = [(cu[i], cu[i + 1]) for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
    share = sum(_causal_pairs(0, e - s) for s, e in docs) / world
    load, room, owned = [0] * world, [total // world] * world, [[] for _ in range(world)]

    def give(r, s, a, b):
        owned[r].append((s + a, s + b))
        load[r] += _causal_pairs(a, b)
        room[r] -= b - a

    rest = []
    for s, e in sorted(docs, key=lambda d: (d[0] - d[1], d[0])):
        n = e - s
        k = min(world, -(-_causal_pairs(0, n) // max(1, int(heavy * share))), n // 2)
        if k > 1:
            cut = [i * n // (2 * k) for i in range(2 * k + 1)]
            need = max(cut[i + 1] - cut[i] + cut[2 * k - i] - cut[2 * k - 1 - i] for i in range(k))
            ranks = [r for r in sorted(range(world), key=lambda r: (load[r], r)) if room[r] >= need][:k]
            if len(ranks) == k:
                for i, r in enumerate(ranks):
                    give(r, s, cut[i], cut[i + 1])
                    give(r, s, cut[2 * k - 1 - i], cut[2 * k - i])
                continue
        rest.append((s, e))
    for s, e in rest:
        a, n = 0, e - s
        while a < n:
            fits = [r for r in range(world) if room[r] >= n - a]
            r = min(fits, key=lambda r: (load[r], r)) if fits else max(range(world), key=lambda r: (room[r], -r))
            b = n if fits else a + room[r]
            give(r, s, a, b)
            a = b
    return [torch.cat([torch.arange(a, b) for a, b in sorted(o)]) for o in owned]


HEAVY_STEPS = (0.5, 0.25, 0.125, 0.0625, 0.03125, 0.0)   # documents_first's thresholds, tried in turn


def rank_work(positions: torch.Tensor, cu_seqlens=None) -> int:
    """Causal visible pairs of the queries at ``positions`` (documents respected): a rank's work."""
    start = torch.zeros_like(positions)
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
        start = cu[torch.searchsorted(cu, positions, right=True) - 1]
    return int((positions - start + 1).sum())


def units_positions(total: int, world: int, cu_seqlens=None) -> list[torch.Tensor]:
    """Per rank, the positions of the units deal (``balanced_units``), ascending."""
    size = total // (world * units_per_rank(total, world, cu_seqlens))
    return [torch.cat([torch.arange(u * size, (u + 1) * size) for u in units])
            for units in balanced_units(total, world, cu_seqlens)]


@functools.lru_cache(maxsize=64)
def _balanced_positions(total: int, world: int, cu_key: tuple | None) -> tuple[tuple[int, ...], ...]:
    """The balanced layout's positions per rank (module doc): documents first at the largest threshold within
    ``BALANCE_TARGET``, else the least imbalanced of those and the units deal."""
    if total % (2 * world):
        raise ValueError(f"the balanced layout needs a sequence length divisible by 2 x {world} ranks; got {total}")
    tries = []
    for heavy in HEAVY_STEPS:
        pos = documents_first(total, world, cu_key, heavy)
        if any(p.numel() != total // world for p in pos):   # a zigzag cut that overfilled a rank: not this one
            continue
        work = [rank_work(p, cu_key) for p in pos]
        tries.append((max(work) / max(1, sum(work) / world), len(tries), pos))
        if tries[-1][0] <= BALANCE_TARGET:
            break
    else:
        pos = units_positions(total, world, cu_key)
        work = [rank_work(p, cu_key) for p in pos]
        tries.append((max(work) / max(1, sum(work) / world), len(tries), pos))
    best = tries[-1] if tries[-1][0] <= BALANCE_TARGET else min(tries, key=lambda t: t[:2])
    return tuple(tuple(p.tolist()) for p in best[2])


def balanced_units(total: int, world: int, cu_seqlens=None) -> list[list[int]]:
    """The units deal (module doc): per rank, the indices (ascending) of the ``world·m`` equal units it holds."""
    key = None if cu_seqlens is None else tuple(torch.as_tensor(cu_seqlens).tolist())
    return [list(u) for u in _balanced(total, world, key)[1]]


def shard_positions(total: int, world: int, rank: int, layout: str, cu_seqlens=None, ulysses: int = 1,
                    ulysses_rank: int = 0) -> torch.Tensor:
    """The global positions (int64, in shard order) of the tokens ``rank`` holds; with ``ulysses`` > 1 those
    of Ulysses rank ``ulysses_rank``'s piece of that ring shard (USP)."""
    check_divisible(total, world, layout, ulysses)
    if layout == "balanced":
        key = None if cu_seqlens is None else tuple(torch.as_tensor(cu_seqlens).tolist())
        pos = torch.tensor(_balanced_positions(total, world, key)[rank])
    else:
        size = total // (world * chunks_per_rank(layout))
        pos = torch.cat([torch.arange(c * size, (c + 1) * size) for c in rank_chunks(rank, world, layout)])
    if ulysses > 1:
        pos = pos.chunk(ulysses)[ulysses_rank]
    return pos


def shard_sequence(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1,
                   ulysses_group=None, cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (no communication; a copy).

    ``group`` is the ring (or only) CP group; with ``ulysses_group`` the ring shard is cut further (USP).
    ``cu_seqlens``: the packed documents (the balanced layout places by them; the others ignore them).
    """
    world, rank = comm.group_size(group), comm.group_rank(group)
    ulysses = comm.group_size(ulysses_group) if ulysses_group is not None else 1
    check_divisible(x.shape[dim], world, layout, ulysses)
    if layout == "balanced":
        pos = shard_positions(x.shape[dim], world, rank, layout, cu_seqlens, ulysses,
                              comm.group_rank(ulysses_group) if ulysses > 1 else 0)
        return x.index_select(dim, pos.to(x.device))
    pieces = x.chunk(world * chunks_per_rank(layout), dim)
    ring_shard = torch.cat([pieces[c] for c in rank_chunks(rank, world, layout)], dim)
    if ulysses > 1:
        ring_shard = ring_shard.chunk(ulysses, dim)[comm.group_rank(ulysses_group)]
    return ring_shard.contiguous()


def gather_sequence(x_local: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1,
                    ulysses_group=None, cu_seqlens=None) -> torch.Tensor:
    """The full tensor from every rank's shard (all-gather, then undo the layout's chunk order).

    Differentiable: the gradient of the full tensor is reduce-scattered back to the shards (each rank's
    gradient is taken as a partial sum, as after a tensor-parallel region).
    """
    if ulysses_group is not None:
        x_local = comm.all_gather(x_local, ulysses_group, dim)
    world = comm.group_size(group)
    per_rank = chunks_per_rank(layout)
    if x_local.shape[dim] % per_rank:
        raise ValueError(f"a {layout} shard must have a length divisible by {per_rank}; got {x_local.shape[dim]}")
    full = comm.all_gather(x_local, group, dim)
    if layout == "balanced":   # rank order -> position order: the inverse of every rank's positions
        total = full.shape[dim]
        order = torch.cat([shard_positions(total, world, r, layout, cu_seqlens) for r in range(world)])
        return full.index_select(dim, torch.argsort(order).to(full.device))
    if per_rank == 1:
        return full
    pieces = full.chunk(world * per_rank, dim)                 # rank order: r0c0, r0c1, r1c0, ...
    where = {c: i for i, c in enumerate(c for r in range(world) for c in rank_chunks(r, world, layout))}
    return torch.cat([pieces[where[c]] for c in range(world * per_rank)], dim)
