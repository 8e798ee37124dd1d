"""A packed ring's forward and dQ by launch groups of ring steps: each group's seen keys gathered in position
order and computed as one block, instead of one block (a launch) per step.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --docs lognormal:mean=1024,seed=0 --layout balanced --check
    DISTLAB_RING_STEPS_PER_LAUNCH=4 python -m distlab.cp.emulate_packed --world 8 --seq 65536   # GPU: the A/B

The unpacked Triton ring runs its forward's steps in groups (``distlab.cp.ring.launch_groups``; W=8 and 4 a
launch: 0 | 1 2 3 | 4 5 6 7): step 0's K/V are local, the later groups' K/V travel while the earlier groups
compute, and a group is one kernel launch. The packed ring does the same with the masked kernel, which
takes any keys with their global positions, ascending (``distlab.kernels.masks.KeyMask``): a group's keys
are the keys of its steps that some row of this rank sees (with documents, a few of each other rank's),
copied out of the steps' K/V and put in position order (``gather_group_kv``: two index copies of the seen
keys), and the group is one block over the rows that see any of them. Every visible pair is still computed
exactly once: the steps of a group hold disjoint keys. Why it was built: a balanced rank at 64k, W = 8,
runs 9 blocks a forward, each a launch whose start gap and last partial wave cost as much as a small
block's work; in groups it runs 3 (``python -m distlab.cp.emulate_packed --tiles-only``), and the wave
model (``distlab.cp.waves``, schedule ``groups``) put the rank 7 points higher. Measured (H100, 2026-12-05,
docs/PERF.md): 4 points *lower* on the GPU clock and 15 on the wall (balanced f+b 76.0 / 59.7% against 80.1 /
75.0% one launch a step), so it is opt-in (``steps_per_launch``, ``DISTLAB_RING_STEPS_PER_LAUNCH`` in the
studies): kept because it is correct and tested, and the measurement says where the model is wrong.

The backward keeps the ring's steps for dK/dV (K/V and the travelling dK/dV accumulators,
``ring_packed._backward``): each rank adds its part to an accumulator in ring order, so those blocks stay
per step. dQ never travels, so it goes by groups too: once a group's last K/V are here again, its keys are
gathered again and its dQ runs as the group's one block (on its own CUDA stream), numbered as the forward
(each row's first and last block: ``LaunchBlocks.first``/``last``, with the ``triton`` backend; the other
backends compute each step's dQ with its dK/dV).
"""

from __future__ import annotations

import torch

from distlab.cp.ring import launch_groups


def seen_key_rows(mask) -> torch.Tensor:
    """The key rows (ascending indices) that some query of ``mask`` sees: the union of the rows' intervals
    over keys in ascending position (a count of intervals open at each key; no (rows × keys) matrix)."""
    k = mask.k_pos
    a, b = torch.searchsorted(k, mask.q_lo), torch.searchsorted(k, mask.q_hi)
    keep = b > a
    edges = torch.zeros(k.numel() + 1, dtype=torch.int64)
    edges.index_add_(0, a[keep], torch.ones_like(a[keep]))
    edges.index_add_(0, b[keep], -torch.ones_like(b[keep]))
    return (edges.cumsum(0)[:-1] > 0).nonzero().squeeze(1)


class LaunchBlocks(list):
    """``launch_blocks``' result, a list: per launch group ``(steps, gather, blocks)`` — the ring steps (a
    range), ``gather`` (None: one step, its K/V used as they come; else ``(picks, perm)``: per step the key
    rows to take, then the order that puts their concatenation in position order, None when it already is)
    and the ``(a, b, mask)`` blocks. ``first``/``last``/``untouched``: as ``ring_packed.StepBlocks``', in the
    groups' numbering (the forward's and dQ's)."""

    first: torch.Tensor
    last: torch.Tensor
    untouched: torch.Tensor


def launch_blocks(docs, positions, rank, device, steps_per_launch, steps) -> LaunchBlocks:
    """Rank ``rank``'s forward blocks per launch group (``launch_groups(W, steps_per_launch)``); ``steps``:
    the rank's ``step_blocks`` (a one-step group reuses them). A group of several steps is one block, from
    the first row that sees any of its keys to the last: one launch, whose query tiles that see nothing
    end at once — where the steps' blocks (``ROW_GAP``) would cut it in two launches or more."""
    from distlab.cp.ring_packed import row_runs

    world = len(positions)
    plan, number = LaunchBlocks(), 0
    rows = positions[rank].numel()
    first = torch.full((rows,), -1, dtype=torch.int32)
    last = torch.full((rows,), -1, dtype=torch.int32)
    for group in launch_groups(world, steps_per_launch):
        if len(group) == 1:
            gather, blocks = None, steps[group.start]
        else:
            picks, keys = [], []
            for step in group:
                src = positions[(rank - step) % world]
                pick = seen_key_rows(docs.mask(positions[rank], src))
                picks.append(pick)
                keys.append(src[pick])
            keys = torch.cat(keys)
            order = torch.argsort(keys, stable=True)
            perm = None if bool((order == torch.arange(keys.numel())).all()) else order
            blocks = []
            if keys.numel():
                mask = docs.mask(positions[rank], keys[order])
                for a, b in row_runs(mask, rows):   # one block: a launch a group (rows seeing nothing are cheap)
                    blk = mask.rows(a, b)
                    blk.seen_columns()   # on the host: the kernels' key span needs no device sync
                    blocks.append((a, b, blk.to(device)))
            gather = ([p.to(device) for p in picks], None if perm is None else perm.to(device))
        for a, b, _ in blocks:
            first[a:b] = torch.where(first[a:b] < 0, number, first[a:b])
            last[a:b] = number
            number += 1
        plan.append((group, gather, blocks))
    plan.first, plan.last = first.to(device), last.to(device)
    plan.untouched = (first < 0).nonzero().squeeze(1).to(device)
    return plan


def gather_group_kv(kvs, gather):
    """A group's (k, v): its steps' K/V ``kvs`` (in step order) cut to the picked key rows and put in position
    order (``LaunchBlocks``' ``gather``); one step's K/V as they are when ``gather`` is None."""
    if gather is None:
        return kvs[0]
    picks, perm = gather
    out = []
    for i in range(2):
        t = torch.cat([kv[i].index_select(1, p) for kv, p in zip(kvs, picks)], 1)
        out.append(t if perm is None else t.index_select(1, perm))
    return tuple(out)
