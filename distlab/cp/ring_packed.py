"""Ring attention over packed documents and sliding windows, in any layout (contiguous, zigzag, balanced).

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --docs lognormal:mean=1024,seed=0 --layout balanced --check

``ring_attention(q, k, v, group, causal, layout, cu_seqlens=..., window=...)`` runs here (and so does the
``balanced`` layout, which only documents make meaningful). It is the ring of ``distlab/cp/ring.py`` —
K/V travel from rank r to r+1 (W−1 exchanges forward), in the backward K/V again and a float32 dK/dV
accumulator that visits every rank and comes home (W exchanges) — with one difference: the block. At step
i this rank's queries, at global positions ``pos[me]``, meet the keys of rank ``src = me − i``, at
``pos[src]``, through a ``KeyMask`` (``distlab.cp.documents``). A step whose block has no visible pair
launches no kernel (its K/V still travel on: the next rank needs them), and a step computes and merges only
the runs of rows that see some of its keys (``step_blocks``): with documents most rows see nothing of most
other ranks, and merging the whole float32 output at every step cost more than the kernels on the H200
(docs/PERF.md). With the ``triton`` backend each block merges into the running (out, LSE) inside its kernel
(``_forward``), a row starting at its first block and written in q's dtype at its last; with
``steps_per_launch`` (opt-in: measured slower, ``distlab.cp.ring.PACKED_STEPS_PER_LAUNCH``) the forward and dQ
go by launch groups of steps, each group's seen keys gathered and computed as one block
(``distlab.cp.packed_groups``), and the backward's
kernels add into float32 accumulators (dQ, too, starting at a row's first block and written in q's dtype at
its last). Inside a block the kernel skips the keys the mask removes, so the
work follows the visible pairs, not T².

Every layout works because nothing here assumes where a position lives: the masks are computed from the
positions each layout assigns (``distlab.cp.layout.shard_positions``), the same on every rank.
"""

from __future__ import annotations

import contextlib

import torch

from distlab.kernels.lse_merge import lse_merge_, lse_merge_blocks_, merge_into
from distlab.profiling import phase
from distlab.kernels.attention import attention_backward, attention_forward

ROW_GAP = 256   # rows that see nothing between two runs, below which the runs are computed as one


def row_runs(mask, gap: int = ROW_GAP) -> list[tuple[int, int]]:
    """The runs [a, b) of query rows that see some key of ``mask`` (runs closer than ``gap`` joined)."""
    k = mask.k_pos if mask.k_sorted else mask.k_pos.sort().values
    seen = ((torch.searchsorted(k, mask.q_hi) - torch.searchsorted(k, mask.q_lo)) > 0).nonzero().squeeze(1)
    if not seen.numel():
        return []
    cut = ((seen[1:] - seen[:-1]) > gap).nonzero().squeeze(1)    # a run ends where gap rows or more see nothing
    starts = torch.cat([seen[:1], seen[cut + 1]]).tolist()
    stops = (torch.cat([seen[cut], seen[-1:]]) + 1).tolist()
    return list(zip(starts, stops))


class StepBlocks(list):
    """``step_blocks``' result, a list: per ring step, its ``(a, b, mask)`` blocks. ``first``/``last``: per row of
    the shard, the number (in the order the forward runs them) of the first and the last block whose rows
    cover it, −1 for none (int32, on the device); ``untouched``: the rows no block covers (their output is
    0, their LSE −inf). The ``triton`` forward starts a row at its first block (no running result to read)
    and writes it in q's dtype at its last (no float32 copy to convert after). For its two streams
    (``forward_streams``): ``side_runs``, the row ranges the later steps' blocks cover ([] when my own
    step's blocks do not cover them all: one stream then); ``first_side``, each row's first block of a later
    step; ``last_main``, ``last`` with −2 (never) on those rows, which each stream leaves in its float32
    running result (``never``: −2 everywhere, the side stream's) for the merge at the end."""

    first: torch.Tensor
    last: torch.Tensor
    untouched: torch.Tensor
    side_runs: list
    first_side: torch.Tensor
    last_main: torch.Tensor
    never: torch.Tensor
    launches: object = None


def step_blocks(docs, positions, rank, device, gap: int = ROW_GAP, steps_per_launch=1) -> StepBlocks:
    """Per ring step of rank ``rank``: the ``(a, b, mask)`` blocks of rows a..b that see that step's keys
    (an empty list: the step launches nothing). ``steps_per_launch`` (``distlab.cp.ring.launch_groups``):
    when some group holds several steps, ``launches`` is the forward's plan by groups
    (``distlab.cp.packed_groups.launch_blocks``), else None."""
    world = len(positions)
    steps = StepBlocks()
    rows = positions[rank].numel()
    first = torch.full((rows,), -1, dtype=torch.int32)
    last = torch.full((rows,), -1, dtype=torch.int32)
    number = 0
    for step in range(world):
        m = docs.mask(positions[rank], positions[(rank - step) % world])
        blocks = [(a, b, m.rows(a, b)) for a, b in row_runs(m, gap)]
        for a, b, blk in blocks:
            blk.seen_columns()   # found here, on the host: the kernels' key span needs no device sync
            first[a:b] = torch.where(first[a:b] < 0, number, first[a:b])
            last[a:b] = number
            number += 1
        steps.append([(a, b, blk.to(device)) for a, b, blk in blocks])
    steps.first, steps.last = first.to(device), last.to(device)
    steps.untouched = (first < 0).nonzero().squeeze(1).to(device)
    # two forward streams (``_forward``): the later steps' blocks beside my own step's, each into its own
    # running result, merged at the end over the rows the later steps cover (``side_runs``)
    mine = len(steps[0]) if steps else 0
    first_side = torch.full((rows,), -1, dtype=torch.int32)
    number, runs = mine, []
    for blocks in steps[1:]:
        for a, b, _ in blocks:
            first_side[a:b] = torch.where(first_side[a:b] < 0, number, first_side[a:b])
            number += 1
            runs.append((a, b))
    covered = torch.zeros(rows, dtype=torch.bool)
    for a, b, _ in steps[0] if steps else []:
        covered[a:b] = True
    side = first_side >= 0
    # my own step's blocks must cover every row a later step does (each row sees its own key: they do)
    steps.side_runs = _union(runs) if runs and bool(covered[side].all()) else []
    steps.first_side = first_side.to(device)
    steps.last_main = torch.where(side, -2, last).to(device)   # rows a later step covers: merged at the end
    steps.never = torch.full((rows,), -2, dtype=torch.int32, device=device)
    from distlab.cp.packed_groups import launch_blocks
    from distlab.cp.ring import launch_groups

    if any(len(group) > 1 for group in launch_groups(world, steps_per_launch)):
        steps.launches = launch_blocks(docs, positions, rank, device, steps_per_launch, steps)
    return steps


def _union(runs):
    """The row ranges ``[(a, b)]`` joined where they overlap or touch, in order."""
    out = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def block_into(out, lse, q, k, v, a, b, mask, scale, backend):
    """Rows a..b of q against one step's K/V under ``mask``, merged into the running (out, lse) in place:
    ``backend`` (concrete, as ``ring_attention`` resolved it) computes the block, then ``merge_rows``."""
    o, l = attention_forward(q[:, a:b], k, v, False, scale, backend, mask=mask)
    merge_rows(out, lse, o, l, a, b)


def merge_rows(out, lse, o, l, a, b):
    """Merge a block of rows a..b into the float32 running (out, lse) in place (one Triton launch on CUDA)."""
    if out.is_cuda and not out.shape[-1] & (out.shape[-1] - 1):
        lse_merge_(out[:, a:b], lse[:, :, a:b], o, l)
    else:
        merge_into(out, lse, o, l, slice(a, b))


def _forward(q, k, v, ring, blocks, scale, backend):
    """The ``triton`` backend (float32 running results or below) merges each block inside its kernel
    (``masked_forward(accumulate=True)``: no merge launch, no block output in memory), starting a row at its
    first block and writing it in q's dtype at its last (``StepBlocks``: no zero fill, no conversion); the
    others compute each block, then ``merge_rows`` into zero-filled running results."""
    if blocks.launches is not None:
        return _forward_groups(q, k, v, ring, blocks.launches, scale, backend)
    fused, out, lse, final, block_scale = _running(q, blocks, scale, backend)
    if fused:
        from distlab.kernels.triton_masked_attention import masked_forward
    two = fused and bool(blocks.side_runs) and forward_streams() == 2
    side = side_streams(q.device)[0] if two and q.is_cuda else None   # on the CPU: the same work, in order
    on_side = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
    if two:   # the later steps' blocks into their own running result, on their own stream
        out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    if side is not None:
        main = torch.cuda.current_stream(q.device)
        side.wait_event(main.record_event())
        for t in (q, k, v, out, lse, out2, lse2, final):
            t.record_stream(side)
    kv, number = (k, v), 0
    for step in range(ring.size):
        later = two and step > 0
        with on_side() if later else contextlib.nullcontext():
            with phase("ring.exchange"):
                pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
            for a, b, mask in blocks[step]:
                with phase("ring.block"):
                    if fused:
                        o, l, last = (out2, lse2, blocks.never) if later else \
                            (out, lse, blocks.last_main if two else blocks.last)
                        first = blocks.first_side if later else blocks.first
                        masked_forward(q[:, a:b], kv[0], kv[1], mask, block_scale, o[:, a:b], l[:, :, a:b],
                                       accumulate=True, order=(first[a:b], last[a:b], number), final_out=final[:, a:b])
                    else:
                        block_into(out, lse, q, kv[0], kv[1], a, b, mask, scale, backend)
                number += 1
        if pending is not None:
            # the next step's K/V: with two streams the side stream waits for them, not mine (busy computing)
            with phase("ring.wait"), on_side() if two else contextlib.nullcontext():
                kv = tuple(pending.wait())
                if side is not None:
                    for t in kv:
                        t.record_stream(side)
    if two:   # rows a later step covers: my step's running result and theirs, merged into final
        if side is not None:
            main.wait_stream(side)
        for a, b in blocks.side_runs:
            lse_merge_blocks_(out[:, a:b], lse[:, :, a:b], [(out2[:, a:b], lse2[:, :, a:b], 0, b - a)],
                              has_acc=True, final=final[:, a:b])
    return (final if fused else out.to(q.dtype)), lse


def _running(q, plan, scale, backend):
    """``(fused, out, lse, final, block_scale)``: the forward's running results. ``fused`` (the ``triton``
    backend, float32 running results): ``out``/``lse`` unfilled — each row starts at its first block — and
    ``final`` in q's dtype, written at each row's last block (the rows of ``plan.untouched``, which no block
    covers, filled here: output 0, LSE −inf); else zero-filled float32/float64 results, ``final`` None."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    fused = acc == torch.float32 and backend == "triton"
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    if not fused:
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        return False, out, torch.full(lse_shape, float("-inf"), dtype=acc, device=q.device), None, None
    out, final = torch.empty(q.shape, dtype=acc, device=q.device), torch.empty_like(q)
    lse = torch.empty(lse_shape, dtype=acc, device=q.device)
    if plan.untouched.numel():
        final.index_fill_(1, plan.untouched, 0.0)
        lse.index_fill_(2, plan.untouched, float("-inf"))
    return True, out, lse, final, scale if scale is not None else q.shape[-1] ** -0.5


def _forward_groups(q, k, v, ring, plan, scale, backend):
    """``_forward`` by launch groups (``distlab.cp.packed_groups``): the K/V of the steps up to the largest
    group beyond the current one travel while it computes (``distlab.cp.ring._KVAhead``, as the unpacked
    ring's groups), a group's keys are gathered in position order, and its blocks run on one stream into one
    running result, numbered in the groups' order (``plan.first``/``last``)."""
    from distlab.cp.packed_groups import gather_group_kv
    from distlab.cp.ring import _KVAhead

    fused, out, lse, final, block_scale = _running(q, plan, scale, backend)
    if fused:
        from distlab.kernels.triton_masked_attention import masked_forward
    kvs, number = _KVAhead(ring, (k, v)), 0
    ahead = max(len(group) for group, _, _ in plan)
    for steps, gather, blocks in plan:
        with phase("ring.exchange"):
            kvs.post_through(steps[-1] + ahead)   # the next groups' K/V, while this one computes
        with phase("ring.wait"):
            got = [kvs.get(step) for step in steps]
        if not blocks:
            continue
        with phase("ring.gather"):
            kk, vv = gather_group_kv(got, gather)
        for a, b, mask in blocks:
            with phase("ring.block"):
                if fused:
                    masked_forward(q[:, a:b], kk, vv, mask, block_scale, out[:, a:b], lse[:, :, a:b], accumulate=True,
                                   order=(plan.first[a:b], plan.last[a:b], number), final_out=final[:, a:b])
                else:
                    block_into(out, lse, q, kk, vv, a, b, mask, scale, backend)
            number += 1
    return (final if fused else out.to(q.dtype)), lse


_SIDE_STREAMS: dict = {}


def side_streams(device) -> list:
    """The four CUDA streams a packed ring's forward and backward run beside the caller's (made once per
    device; the forward's later steps take the first, as the backward's dQ kernels do: they never overlap)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = [torch.cuda.Stream(device) for _ in range(4)]
    return _SIDE_STREAMS[device]


def forward_streams() -> int:
    """Knob ``DISTLAB_PACKED_FWD_STREAMS``: 1 (the default) — a packed Triton ring's forward runs its blocks in
    order on one stream into one running result; 2 — it runs its later steps' blocks beside its own step's,
    on a second CUDA stream, each into its own float32 running result, in order; the rows the later steps
    cover are merged at the end (one ``lse_merge_blocks_`` launch per run of them, written in q's dtype),
    and the side stream, not mine, waits for the later steps' K/V, so my own step's block runs from the
    start. On the CPU the same work runs in order (tested there). On the H100 (2026-12-05, ``bash
    launch/gpu_packed_check.sh OUT backward``: checked against the float64 torch backend, then timed) it was
    no faster: a balanced 64k pack's slowest rank at W=8, forward 71.0% of one call with 1, 70.1% with 2
    (GPU clock; seed 3: 72.4 / 70.5%) — so 1 stays the default."""
    from distlab import knobs

    flag = knobs.get("PACKED_FWD_STREAMS")
    if flag not in ("1", "2"):
        raise ValueError(f"DISTLAB_PACKED_FWD_STREAMS={flag!r}: use 2 (the later steps on a second stream) or 1")
    return int(flag)


def _backward(dout, q, k, v, out, lse, ring, blocks, scale, backend):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kv, dkv_pending = (k, v), None
    # the triton backend adds each block's dQ and dK/dV into float32 accumulators inside its kernels, from
    # the backward rows (final LSE, rowsum(dO·O)) computed once for the shard
    fused = acc == torch.float32 and backend == "triton"   # backend: concrete (ring_attention resolved it)
    # and, given each row's first and last block (``StepBlocks``), a row's first dQ kernel writes its float32
    # dQ (no zero fill) and its last writes the final dQ in q's dtype (no conversion launch after the ring)
    ordered = fused and getattr(blocks, "last", None) is not None
    if ordered:
        from distlab.kernels.triton_attention_backward import ring_dq_final

        ordered = ring_dq_final()   # knob DISTLAB_RING_DQ_FINAL (1: the default; 0: the A/B)
    # with the forward's launch groups, dQ runs by group too (one launch a group over its gathered keys, once
    # the group's last K/V are here: dQ never travels), numbered as the forward; dK/dV stay per step
    groups = blocks.launches if fused and getattr(blocks, "launches", None) is not None else None
    numbering = groups if groups is not None else blocks
    dq = (torch.empty if ordered else torch.zeros)(q.shape, dtype=acc, device=q.device)
    dq_final, number = None, 0
    if ordered:
        dq_final = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if numbering.untouched.numel():   # rows no block covers (none see a key): dQ 0
            dq_final.index_fill_(1, numbering.untouched, 0)
    plan = BackwardStreams(q.device if fused else torch.device("cpu"))
    if fused:
        from distlab.kernels.triton_masked_attention import masked_backward, masked_backward_rows

        back_rows = masked_backward_rows(dout, out, lse)
        block_scale = scale if scale is not None else q.shape[-1] ** -0.5
    held, group = [], 0   # the K/V of the current launch group's steps so far
    for step in range(ring.size):
        with phase("ring.exchange"):
            kv_pending = ring.exchange(kv, "ring_kv") if step < ring.size - 1 else None
        part, span, done = None, slice(None), None
        if fused and blocks[step]:   # this step's dK/dV, written or summed by the kernels in float32
            part = (torch.empty(k.shape, dtype=acc, device=k.device), torch.empty(v.shape, dtype=acc, device=v.device))
            # only the keys the step's blocks see are written and added on; step 0's part becomes the
            # accumulator of my K/V, so there every key (each row sees its own key: the span is all of them)
            seen = [c for c in (m.seen_columns() for _, _, m in blocks[step]) if c is not None]
            span = slice(min(c.start for c in seen), max(c.stop for c in seen)) if seen else slice(0, 0)
            whole = (span.start, span.stop) == (0, k.shape[1])
            only = len(blocks[step]) == 1 and (step > 0 or whole)   # a step's only block writes its keys: no fill
            if step == 0:
                span = slice(None)
            kernels = plan.dkv_stream(step)
            plan.ready(kv, part, kernels)   # this step's K/V are here: its kernels may start
            with plan.on(kernels):
                if not only:
                    for t in part:
                        t[:, span].zero_()
                for a, b, mask in blocks[step]:
                    with phase("ring.block_backward"):
                        masked_backward(dout[:, a:b], q[:, a:b], kv[0], kv[1], None, None, mask, block_scale,
                                        rows=(back_rows[0][:, :, a:b], back_rows[1][:, :, a:b]), dq_acc=dq[:, a:b],
                                        dk_acc=part[0], dv_acc=part[1], dkv_add=not only, dq_stream=plan.dq,
                                        order=(blocks.first[a:b], blocks.last[a:b], number)
                                        if ordered and groups is None else None,
                                        dq_final=dq_final[:, a:b] if ordered and groups is None else None,
                                        parts="dkv" if groups is not None else "both")
                    number += groups is None   # with groups, dQ's numbering is the groups' (below)
            done = plan.done(kernels)
        elif not fused:
            for a, b, mask in blocks[step]:
                with phase("ring.block_backward"):
                    dq_b, dk_b, dv_b = attention_backward(dout[:, a:b], q[:, a:b], kv[0], kv[1], out[:, a:b],
                                                          lse[:, :, a:b], False, scale, backend, mask=mask)
                dq[:, a:b] += dq_b
                part = (dk_b.to(acc), dv_b.to(acc)) if part is None else (part[0].add_(dk_b), part[1].add_(dv_b))
        if groups is not None:
            held.append(kv)
            steps, gather, group_blocks = groups[group]
            if step == steps[-1]:   # the group's last K/V are here: its dQ, in one launch a block
                if group_blocks:
                    from distlab.cp.packed_groups import gather_group_kv

                    with plan.group_dq(held):
                        kk, vv = gather_group_kv(held, gather)
                        for a, b, mask in group_blocks:
                            with phase("ring.block_backward"):
                                masked_backward(dout[:, a:b], q[:, a:b], kk, vv, None, None, mask, block_scale,
                                                rows=(back_rows[0][:, :, a:b], back_rows[1][:, :, a:b]),
                                                dq_acc=dq[:, a:b], parts="dq", dq_final=dq_final[:, a:b] if ordered
                                                else None, order=(groups.first[a:b], groups.last[a:b], number)
                                                if ordered else None)
                            number += 1
                held, group = [], group + 1
        with plan.on(plan.chain, after=done):   # the travelling accumulators: off the kernels' streams
            if step == 0:      # the accumulator of my own K/V starts here
                dkv = part if part is not None else tuple(torch.zeros(k.shape, dtype=acc, device=k.device)
                                                          for _ in range(2))
            else:              # the accumulator of rank src's K/V, from the previous rank: add mine
                dkv = tuple(dkv_pending.wait())
                if part is not None:
                    dkv[0][:, span].add_(part[0][:, span])
                    dkv[1][:, span].add_(part[1][:, span])
            if ring.size > 1:
                dkv_pending = ring.exchange(dkv, "ring_dkv")
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    with plan.on(plan.chain):
        if dkv_pending is not None:
            dkv = tuple(dkv_pending.wait())
    plan.join()
    return (dq_final if ordered else dq.to(q.dtype)), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class BackwardStreams:
    """The CUDA streams of a packed Triton ring's backward (knob ``DISTLAB_PACKED_BWD_STREAMS``):

    - ``1``: everything on the caller's stream, in order;
    - ``2``: each dQ kernel on a second stream, after its step's dK/dV kernel and beside the
      next steps' — dQ stays on the rank, only dK/dV travel on to the next rank, and the kernels' partial
      last waves overlap (H200, a balanced 64k pack at W=8: f+b 69.9% → 76.9% of one call, docs/PERF.md);
    - ``4`` (the default): besides, each step's dK/dV kernels on one of two streams in turn (a step's kernels
      overlap the previous step's: a balanced pack's rank has a large block and several small ones), and the travelling
      dK/dV accumulators — receive, add this rank's part, send on — on a fourth stream that waits for each
      step's kernels, so the caller's stream only posts the K/V exchanges and never waits for a kernel or
      for another rank. On the H100 (2026-12-05, ``bash launch/gpu_packed_check.sh OUT backward``, checked
      there against the float64 torch backend first): that pack's slowest rank f+b 70.4% → 77.8% of one
      call against 2 (GPU clock; wall 72.7 → 76.9%), units deal 71.2%, seed 3's pack 75.8 → 77.4%.

    A kernel stream starts a step's work after an event the caller's stream records once that step's K/V
    are there, and every tensor a stream reads is marked as used by it (``record_stream``: not reused
    before it ran); ``join`` makes the caller's stream wait for them all at the end. On the CPU, or for the
    other backends, everything runs in order on the caller's stream and these methods do nothing."""

    def __init__(self, device):
        from distlab import knobs

        flag = knobs.get("PACKED_BWD_STREAMS")
        if flag not in ("1", "2", "4"):
            raise ValueError(f"DISTLAB_PACKED_BWD_STREAMS={flag!r}: use 1, 2 or 4")
        self.main = self.dq = self.chain = None
        self.kernels = (None, None)
        if device.type != "cuda" or flag == "1":
            return
        pool = side_streams(device)
        self.main, self.dq = torch.cuda.current_stream(device), pool[0]
        if flag == "4":
            self.kernels, self.chain = (pool[1], pool[2]), pool[3]

    def dkv_stream(self, step):
        """The stream of step ``step``'s dK/dV kernels (None: the caller's)."""
        return self.kernels[step % 2]

    def ready(self, kv, parts, kernels):
        """``kernels`` waits for what the caller's stream has queued so far (this step's K/V, its dK/dV parts
        allocated; the dQ stream waits for the kernels' stream in ``masked_backward``); the K/V are marked as
        used by the kernel streams, the parts by the dK/dV kernels' and the accumulators' streams."""
        if self.main is None:
            return
        if kernels is not None:
            kernels.wait_event(self.main.record_event())
        for stream, tensors in ((self.dq, kv), (kernels, (*kv, *parts)), (self.chain, parts)):
            if stream is not None:
                for t in tensors:
                    t.record_stream(stream)

    def group_dq(self, kvs):
        """A context on the dQ stream (None: the caller's) after what the caller's stream has queued so far (a
        launch group's last K/V are there): a group's dQ (``_backward``); ``kvs`` are marked as used by it."""
        if self.main is None:
            return contextlib.nullcontext()
        self.dq.wait_event(self.main.record_event())
        for kv in kvs:
            for t in kv:
                t.record_stream(self.dq)
        return torch.cuda.stream(self.dq)

    def done(self, kernels):
        """An event after this step's dK/dV kernels for the accumulators' stream (None: no stream to order)."""
        return kernels.record_event() if kernels is not None and self.chain is not None else None

    def on(self, stream, after=None):
        """A context that runs on ``stream`` (None: the caller's) once the event ``after`` has happened."""
        if stream is None:
            return contextlib.nullcontext()
        if after is not None:
            stream.wait_event(after)
        return torch.cuda.stream(stream)

    def join(self):
        """The caller's stream waits for every stream used (at the end of the backward)."""
        if self.main is not None:
            for stream in (self.dq, *self.kernels, self.chain):
                if stream is not None:
                    self.main.wait_stream(stream)


class PackedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, blocks, scale, backend):
        out, lse = _forward(q, k, v, ring, blocks, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, blocks, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None
