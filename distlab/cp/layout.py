"""Sequence layouts for context parallelism: which tokens each rank holds.

    python -m pytest tests/test_ring.py -k layout

``contiguous``: the sequence is cut into W equal chunks; rank r holds chunk r. Causal attention then
gives rank W−1 W times the work of rank 0.

``zigzag``: the sequence is cut into 2W chunks; rank r holds chunks r and 2W−1−r (in that order). Every
rank then holds one early and one late chunk, so causal attention costs every rank the same.

USP (a Ulysses group of U ranks inside each ring position, ``ulysses_group=``): the sequence is first cut
for the ring group as above, then each ring shard is cut into U contiguous pieces, piece u to Ulysses
rank u. The Ulysses all-to-all concatenates the pieces in rank order, so it rebuilds exactly the ring
shard (for zigzag: chunk r followed by chunk 2R−1−r), and the ring's zigzag masks stay correct.
"""

from __future__ import annotations

import torch

from distlab import comm

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


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
    """Indices of the sequence chunks (of ``world * chunks_per_rank``) that ``rank`` holds, in order."""
    return [rank, 2 * world - 1 - rank] if chunks_per_rank(layout) == 2 else [rank]


def shard_sequence(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1,
                   ulysses_group=None) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (no communication; a copy).

    ``group`` is the ring (or only) CP group; with ``ulysses_group`` the ring shard is cut further (USP).
    """
    world, rank = comm.group_size(group), comm.group_rank(group)
    ulysses = comm.group_size(ulysses_group) if ulysses_group is not None else 1
    check_divisible(x.shape[dim], world, layout, ulysses)
    pieces = x.chunk(world * chunks_per_rank(layout), dim)
    ring_shard = torch.cat([pieces[c] for c in rank_chunks(rank, world, layout)], dim)
    if ulysses > 1:
        ring_shard = ring_shard.chunk(ulysses, dim)[comm.group_rank(ulysses_group)]
    return ring_shard.contiguous()


def gather_sequence(x_local: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1,
                    ulysses_group=None) -> torch.Tensor:
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
    if per_rank == 1:
        return full
    pieces = full.chunk(world * per_rank, dim)                 # rank order: r0c0, r0c1, r1c0, ...
    where = {c: i for i, c in enumerate(c for r in range(world) for c in rank_chunks(r, world, layout))}
    return torch.cat([pieces[where[c]] for c in range(world * per_rank)], dim)
