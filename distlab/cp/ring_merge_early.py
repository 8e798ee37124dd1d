"""The ring forward's merge split around its last block: what the earlier blocks hold merged beside the last one.

    DISTLAB_RING_MERGE_EARLY=1 python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 4 --wall
    DISTLAB_RING_MERGE_EARLY=1 distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --check   # CPU: the merge in line

Why (#24): a ring forward of blocks that cannot accumulate (FA4, cuDNN) holds each block's (out, LSE) back and
merges up to four of them in one Triton launch (``distlab.kernels.lse_merge.lse_merge_blocks_``). A W=8 zigzag
rank at S32768 runs four blocks and merges all four after the last one: on the H100 (rank 4, 35th session) 55 µs
after the last kernel, ~150 MB moved (three 4096-row block outputs, one of 2048 rows, the bf16 result). But the
last block of most ranks covers only the shard's second half (zigzag's later row set, rows ``a`` … ``s``), so

- rows before ``a`` are final once the earlier blocks ran: merged then, written in q's dtype;
- rows ``a`` … ``s`` of the earlier blocks are merged then into a float32 running result;

both on the side stream (``distlab.cp.ring_fused``'s) beside the last block's kernel, which is compute-bound;
after it, one merge reads the running result and the last block for half the rows (~67 MB at S32768). On the
CPU (or the interpreter) the same merges run in line. The answer: the merge of the same block results,
associated as ``(first blocks) + last`` instead of all at once (float32 weights: within a unit of the last
place of the one-launch merge, not bit for bit).

Where it applies (``early_point``): a pass of at most ``MERGE_BLOCKS`` + 1 blocks (one merge launch for the
earlier ones) whose last block covers rows ``a`` … ``s`` with ``a > 0``. Knob ``DISTLAB_RING_MERGE_EARLY``:
``auto`` at shards of ``MIN_SHARD`` rows or more (shorter shards are host-bound: two more launches), ``1`` at
any, ``0`` never.
"""

from __future__ import annotations

import functools

import torch

from distlab import knobs

MIN_SHARD = 4096   # ``auto``: shards this long (S32768 at W=8)


def wanted(q) -> bool:
    """The knob, for this shard: ``1``, or ``auto`` at ``MIN_SHARD`` rows or more."""
    mode = knobs.get("RING_MERGE_EARLY")
    if mode not in ("0", "1", "auto"):
        raise ValueError(f"DISTLAB_RING_MERGE_EARLY={mode!r}: 0, 1 or auto")
    return mode == "1" or mode == "auto" and q.shape[1] >= MIN_SHARD


@functools.lru_cache(maxsize=256)
def early_point(block_rows: tuple, seq: int, group: int):
    """``(index of the block after which the early merges run, a)`` for a pass whose blocks cover
    ``block_rows`` (``((start, stop), ...)`` in the order they run) of a shard of ``seq`` rows, merged ``group``
    at a time; None where it does not apply (see the module's docstring)."""
    n = len(block_rows)
    if n < 2 or n - 1 > group:
        return None
    a, stop = block_rows[-1]
    if a <= 0 or stop != seq or not any(lo < a for lo, _ in block_rows[:-1]):
        return None
    return n - 2, a


def mark(side):
    """An event on the compute stream once the earlier blocks are queued (None without a ``side`` stream)."""
    if side is None:
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(side.device))
    return ready


def merge_early(pending, q, a, side, ready=None):
    """The earlier blocks' results (``pending``: ``[(out, lse, lo, hi)]``) merged: rows before ``a`` into a new
    output in q's dtype, rows ``a`` … ``s`` into a new float32 running result; on ``side`` (a CUDA stream, or
    None: in line), after ``ready`` (``mark``'s event: the last block, queued since, is not waited for — called
    after its launch, so that its kernel reaches the SMs first: H100, S32768 rank 4, merges launched before it
    held it back ~25 µs). Empties ``pending``; returns what ``merge_last`` takes."""
    from distlab.kernels.lse_merge import lse_merge_blocks_

    b, s, h, d = q.shape
    final = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    acc = torch.empty(b, s - a, h, d, dtype=torch.float32, device=q.device)
    head = [(o[:, :min(hi, a) - lo], l[..., :min(hi, a) - lo], lo, min(hi, a)) for o, l, lo, hi in pending if lo < a]
    tail = [(o[:, max(lo, a) - lo:], l[..., max(lo, a) - lo:], max(lo, a) - a, hi - a)
            for o, l, lo, hi in pending if hi > a]
    main = torch.cuda.current_stream(q.device) if side is not None else None
    if main is not None:   # plain stream calls (host time, as ring_fused's adds)
        side.wait_event(ready) if ready is not None else side.wait_stream(main)
        for o, l, *_ in pending:   # read on the side stream: not handed out again before it is done with them
            o.record_stream(side)
            l.record_stream(side)
        torch.cuda.set_stream(side)
    try:
        lse_merge_blocks_(final[:, :a], lse[:, :, :a], head, has_acc=False, final=final[:, :a])
        lse_merge_blocks_(acc, lse[:, :, a:], tail, has_acc=False)
    finally:
        if main is not None:
            torch.cuda.set_stream(main)
    pending.clear()
    return final, lse, acc, a, side


def merge_last(early, pending, q):
    """After the last block (``pending``: its one result, rows ``a`` … ``s``): it and the running result merged
    into rows ``a`` … ``s`` of the output. Returns ``(output in q's dtype, LSE)``."""
    from distlab.kernels.lse_merge import lse_merge_blocks_

    final, lse, acc, a, side = early
    (o, l, lo, hi), = pending
    if (lo, hi) != (a, q.shape[1]):
        raise RuntimeError(f"ring merge: the last block covers rows [{lo}, {hi}), the early merge left [{a}, "
                           f"{q.shape[1]})")
    if side is not None:   # the early merges' writes, before the last merge reads the running result
        torch.cuda.current_stream(q.device).wait_stream(side)
    lse_merge_blocks_(acc, lse[:, :, a:], [(o, l, 0, hi - lo)], has_acc=True, final=final[:, a:])
    pending.clear()
    return final, lse
