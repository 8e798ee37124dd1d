"""A ring backward on FA4's own kernels, its float32 accumulators kept across the ring's steps (#24).

    python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --timeline   # one rank's kernels, H100/H200
    DISTLAB_FA4_RING_ACCUM=0 python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4   # the A/B

One ``_flash_attn_bwd`` call runs five kernels: a preprocess (delta = rowsum(O·dO), the LSE in base 2, dQ's
float32 accumulator zeroed), the main kernel (dQ added into that accumulator by atomics; with GQA, dK and dV
too, into zeroed float32 accumulators), and three postprocess kernels converting the accumulators to q's
dtype. Called once per ring step (H100, S32768, W=8, one rank's timeline, docs/PERF.md) each step paid ~150
µs beside its ~550 µs main kernel: the preprocess again (29 µs; its inputs — the final out, dO, LSE — are the
same every step), three postprocesses (39), two zero fills (12), then three adds of the bf16 results into
distlab's float32 dQ and the travelling dK/dV (75).

``FA4RingBackward`` runs the same compiled kernels one by one (recorded from one FA4 call per block shape,
as ``fa4_forward`` replays its forward): per *row set* of the rank's blocks (its rows and whether the block
is causal: zigzag has three, all rows causal at step 0, all rows and the second half later) the preprocess
once and one float32 dQ accumulator that every block of that set adds into; the postprocess once at the end
(one per row set, summed); and since a row's delta and LSE do not depend on the block, one preprocess
serves every unfolded row set (``share_preprocess``, knob ``DISTLAB_FA4_RING_SHARE_PRE``). A block's dK/dV go
into zeroed float32 scratch in FA4's accumulator layout, added into the travelling accumulator, which stays
in that layout (head-major, key rows in tiles of the kernel's n-block) and is converted once by its owner
(``finish_dkv``). Why one dQ accumulator per row set and not one
for all: FA4 tiles the causal kernel's rows by 64 and the non-causal one's by 80 at head_dim 128, the
accumulator's layout is the tile's, and zigzag's second half starts at row 2048 (S32768, W=8), off the
80-row tiles. Why scratch for dK/dV and not the received accumulator itself: a
kernel adding straight into it would have to wait for the previous rank's hop before it starts; with
scratch only the add waits (as in distlab's Triton ring).

Memory: a float32 dQ accumulator per row set (zigzag: one and a half shards' worth more than a single float32
dQ; 160 MiB against 64 at S32768, W=8, 32 heads) and the block's dK/dV scratch (a fused ring's later
blocks' kept per ring shape beside those accumulators, ``prepare``: 64 MiB more for rank 4 at S32768, W=8).

**Folded blocks** (knob ``DISTLAB_FA4_RING_FOLD``: ``auto`` by default, see ``FOLD_MIN_SHARD``; ``half``: the
same policy, half-shard row sets folded, at any shard length). FA4's sm90
backward gives each CTA one 128-key tile of one q head and loops it over the block's rows, so a ring's short
row sets (2048 rows at S32768, W=8; 512 at S8192) pay each CTA's prologue and its float32 dK/dV atomics over
few rows, and FA4 4.0.0b36 has no packed-GQA backward. A block with no mask (every later block of a causal
ring) is the same attention with each kv head's G q heads stacked as rows (``fold_heads``): MHA over the kv
heads, G times the rows a CTA loops over, dK/dV written straight in q's dtype (no scratch, no fill). H100,
2026-12-06 (``launch/fa4_tile_probe.py --fold``): main kernel 2048 × 16384 2114 → 2007 µs, 512 × 4096 200 →
137. Then a folded block's dK/dV come back as ``(2, batch, keys, kv_heads, dim)`` in q's dtype, rounded once a
block as any per-block backend's are, and the travelling accumulator is that layout in float32; an unfolded
block's float32 scratch is scaled and added into it by one Triton pass (knob ``FA4_RING_DKV_FINISH``, default;
with 0, converted to q's dtype by FA4's postprocesses first); Q and dO are folded once per row set with FA4's
preprocess in the same Triton pass (knob ``FA4_RING_FOLD_PRE``; every row set's in one pass before step 0,
``FA4_RING_PRE_ONCE``: ``distlab.kernels.triton_fold_preprocess``; with 0, Q, out and dO folded by one launch,
knob ``FA4_RING_GLUE``, then FA4's preprocess) and dQ unfolded at the end (``distlab.kernels.triton_dq_finish``).
The W=8 rank at S32768 (docs/PERF.md): rank 0 86.8 → 92.0% f+b wall, the slowest rank 85.2 → 86.8% (21st
session); with the Triton glue (31st session, another lease) the slowest rank 84.5 → 85.8%.

**The end of the backward** (36th session): where the ring's last kernels all add into one later row set
(zigzag's second half: every rank but the last), the other sets' dQ is finished beside them on the side stream
(``_dq_early``, knob ``FA4_RING_DQ_EARLY``), so the finish after the last kernel reads two accumulators for half
the rows; and with ``FA4_RING_PRE_ONCE`` the folded sets' dQ accumulators are zeroed beside step 0's kernel
instead of by the pass before it (``FA4_RING_ZERO_BESIDE=once``). H100, S32768, every rank (docs/PERF.md): the
slowest rank's f+b a tie on the wall clock, 1.5% faster on the GPU clock; rank 4's backward tail after its last
kernel ~140 µs against ~180.

Used by ``distlab.cp.ring``'s backward for ``backend="fa4"`` when ``usable`` says so: GQA (with one q head
per kv head FA4 writes dK/dV directly, no accumulators), batch-contiguous bshd, every block's rows and keys
in whole tiles of 128 (FA4's kernels round sequence lengths up to their tile); otherwise the per-block
``attention_backward``. Knob ``DISTLAB_FA4_RING_ACCUM=0`` turns it off. The kernels' argument lists are
FA4 4.0.0b36's (``flash_attn.cute.interface``); a recording that does not match them is refused
(``RuntimeError``) rather than guessed at.
"""

from __future__ import annotations

import collections
import functools
import warnings

import torch

from distlab import knobs, lru
from distlab.kernels import fa4
from distlab.kernels.launch import triton_runs_on

TILE = 128   # FA4's largest row / key tile of the sm90 backward at head_dim 128 (n-block 128, m-block 64 or 80)
# ``FA4_RING_FOLD=auto``: a folding ring where the shard has FOLD_MIN_SHARD rows or more and its half row sets
# (a causal zigzag ring's later blocks on every rank but the last; a contiguous or non-causal ring has none,
# and would only pay the conversions) FOLD_MAX_ROWS or fewer, folding those half row sets only — and, at a
# shard of FOLD_WHOLE_SHARD rows, its whole-shard unmasked sets too (35th session, the last lines below).
# H100, 2026-12-06, W=8 zigzag, f+b wall against FA4's H/W call (docs/PERF.md): shard 4096 (S32768) folded /
# not, slowest of the 8 ranks 86.8 / 85.2% (rank 0 92.0 / 86.8); shard 2048 (S16384, everything folded) rank 0
# 81.1 / 76.9% but ranks 3 and 7 69.8 / 73.6 and 74.4 / 78.4 (each folded row set costs its folds of Q, out
# and dO, ~75 µs at 2048 rows, and a GQA block in a folding ring its conversion); shard 1024 (S8192) rank 0
# 75.4 / 76.6% (host-bound), though 81.9 / 77.2% on the GPU clock. Main kernel alone (fa4_tile_probe --fold):
# 2048 x 16384 2114 -> 2007 µs, 4096 x 8192 2092 -> 2004: the 4096-row blocks gain too little for their folds.
# With the folds one Triton launch (triton_ring_glue, 31st session) and a folding ring's host work kept per ring
# shape (32nd), the half sets alone (``half``), H100 2026-12-07, slowest of the 8 ranks folded / not: shard 2048
# (S16384) wall 78.9 / 76.5% (paired 79.7 / 75.7), GPU clock 81.2 / 77.3% — auto folds there since; shard 1024
# (S8192) GPU clock 81.1 / 76.6% but host-bound on the wall (78.5 µs of host a backward step against 56.5 of GPU).
# With the folded sets' fold and preprocess one Triton pass (FA4_RING_FOLD_PRE=1, 35th session), a shard of 4096
# rows folds its whole-shard sets too: H100, 2026-12-07, S32768 slowest of the 8 ranks, wall, every unmasked set
# folded with the pass / the half sets without it 85.8 / 83.6% and 91.1 / 89.4% (paired 88.7 / 87.9, 89.6 / 86.1)
# in two processes; GPU clock 85.0 / 82.2% (paired 88.6 / 87.3).
FOLD_MIN_SHARD = 2048
FOLD_MAX_ROWS = 2048
FOLD_WHOLE_SHARD = 4096   # auto folds every unmasked row set of a shard this long (2048: the half sets only)
DQ_EARLY_MIN_SHARD = 4096   # FA4_RING_DQ_EARLY=auto: dQ's early finish at shards this long (``_dq_early``)
_RECORDED: dict = {}
# per ring shape (``FA4RingBackward.prepare``'s signature): {"zero", "sets"}: the shared preprocess's buffers and
# views (None and [] without it); "blocks": what each block shape needs besides its tensors (``block``)
_PREPARED: collections.OrderedDict = collections.OrderedDict()   # release_prepared() frees them
PREPARED_KEPT = 4


def usable(q, k, blocks, dtype) -> bool:
    """The kept-accumulator path applies: fa4 on this device and dtype, GQA, and every block's rows and
    columns (``blocks``: ``[(rows, cols, ...)]``) starting and ending on a multiple of ``TILE``."""
    if knobs.get("FA4_RING_ACCUM") == "0" or not fa4.runs_on(q.device, dtype):
        return False
    if q.shape[2] == k.shape[2] or q.shape[1] % TILE or k.shape[1] % TILE:
        return False
    return _on_tiles(blocks)


_ON_TILES: dict = {}   # id(blocks) -> (blocks, on tiles): a ring's blocks are one kept list per ring shape


def _on_tiles(blocks) -> bool:
    hit = _ON_TILES.get(id(blocks))
    if hit is not None and hit[0] is blocks:
        return hit[1]
    ok = all(s.start % TILE == 0 and s.stop % TILE == 0 for block in blocks for s in block[:2])
    if len(_ON_TILES) >= 64:
        _ON_TILES.clear()
    _ON_TILES[id(blocks)] = (blocks, ok)   # the list held: its id stays its own
    return ok


def _record(batch, rows, cols, heads, kv_heads, dim, dtype, device, causal, scale):
    """The compiled kernels of one ``_flash_attn_bwd`` call on a block of this shape, and their arguments:
    ``(preprocess, main, [postprocess dQ, dK, dV], buffer shapes)``, each ``(fn, args)`` (MHA, ``heads ==
    kv_heads``: the main kernel writes dK/dV itself, one postprocess, dQ's); recorded once per shape (one FA4
    call on zeros)."""
    key = (batch, rows, cols, heads, kv_heads, dim, dtype, device, causal, scale)
    if key in _RECORDED:
        return _RECORDED[key]
    fi = fa4._interface()
    funcs = (fi._bwd_preprocess, fi._flash_attn_bwd, fi._bwd_postprocess_convert)
    recorders = [fa4._Recorder(f.compile_cache) for f in funcs]
    q = torch.zeros(batch, rows, heads, dim, dtype=dtype, device=device)
    k, v = (torch.zeros(batch, cols, kv_heads, dim, dtype=dtype, device=device) for _ in range(2))
    out, dout = torch.zeros_like(q), torch.zeros_like(q)
    lse = torch.zeros(batch, heads, rows, dtype=torch.float32, device=device)
    for f, r in zip(funcs, recorders):
        f.compile_cache = r
    try:
        got = fi._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal)
    finally:
        for f, r in zip(funcs, recorders):
            f.compile_cache = r.cache
    pre, main, post = recorders[0].calls, recorders[1].calls, recorders[2].calls
    mha = heads == kv_heads
    ok = len(pre) == 1 and len(main) == 1 and len(post) == (1 if mha else 3)
    if ok:
        (pre,), (main,) = pre, main
        ok = (all(_same(a, b) for a, b in zip((pre[1][i] for i in (0, 1, 3)), (out, dout, lse)))
              and all(_same(a, b) for a, b in zip(main[1][:4], (q, k, v, dout)))
              and main[1][4] is pre[1][4] and main[1][5] is pre[1][2] and main[1][6] is pre[1][5]
              and not any(isinstance(a, torch.Tensor) for a in main[1][9:]))
        if mha:   # dK, dV: the tensors the call returned
            ok = ok and post[0][1][0] is main[1][6] and _same(main[1][7], got[1]) and _same(main[1][8], got[2])
        else:
            ok = ok and all(p[1][0] is main[1][i] for p, i in zip(post, (6, 7, 8)))
    if not ok:
        raise RuntimeError("FA4's backward did not run the kernels FA4RingBackward expects (flash-attn-4 "
                           "4.0.0b36's preprocess, main kernel and three postprocesses, one with MHA); set "
                           "DISTLAB_FA4_RING_ACCUM=0")
    shapes = {"dpsum": pre[1][2].shape, "dq_accum": pre[1][5].shape, "dkv_accum": main[1][7].shape}
    if not mha and main[1][8].shape != main[1][7].shape:
        raise RuntimeError("FA4RingBackward: dK's and dV's accumulators differ in shape (head_dim_v != head_dim)")
    _RECORDED[key] = rec = (pre, main, post, shapes)
    return rec


def _same(a, b) -> bool:
    """``a`` is ``b`` or the same memory seen the same way (FA4 passes ``q.detach()``)."""
    return a is b or (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride())


@functools.lru_cache(maxsize=1)
def _glue():
    """``distlab.kernels.triton_ring_glue``, imported once its Triton is known to run here (an import statement
    in the per-block hot path cost ~1 µs a call)."""
    from distlab.kernels import triton_ring_glue

    return triton_ring_glue


@functools.lru_cache(maxsize=1)
def _fold_pre():
    """``distlab.kernels.triton_fold_preprocess``, imported once (as ``_glue``)."""
    from distlab.kernels import triton_fold_preprocess

    return triton_fold_preprocess


def _acc_dtype(dtype):
    """FA4's accumulators are float32; float64 where a CPU test's stand-in kernels run in float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def release_prepared() -> int:
    """Drop what ``FA4RingBackward.prepare`` kept per ring shape (the shared preprocess's buffers: at S32768, W=8,
    32 heads, ~130 MiB a shape); returns the bytes they held. A CUDA graph that captured a backward still reads
    them: release them only with that graph."""
    freed = 0
    while _PREPARED:
        plan = _PREPARED.popitem()[1]
        for flat in (plan["zero"], plan["outs"]):   # one allocation each holds the shape's float32 buffers, and
            if flat is not None:                    # its folded blocks' dK/dV
                freed += flat.untyped_storage().nbytes()
        freed += sum(t.untyped_storage().nbytes() for bufs in plan["set_bufs"].values() for t in bufs)
    return freed


def fold_heads(t, kv_heads: int):
    """``(B, rows, H, D)`` -> ``(B, G·rows, kv_heads, D)``, contiguous: kv head h's q heads hG … hG+G−1 stacked
    as rows (row g·rows + i is q head hG + g's row i). With no mask, the same attention as MHA over the kv heads."""
    b, rows, heads, dim = t.shape
    group = heads // kv_heads
    return t.reshape(b, rows, kv_heads, group, dim).permute(0, 3, 1, 2, 4).reshape(b, group * rows, kv_heads, dim)


def unfold_heads(t, heads: int):
    """``fold_heads`` undone: ``(B, G·rows, kv_heads, D)`` -> ``(B, rows, heads, D)``."""
    b, grows, kv_heads, dim = t.shape
    group = heads // kv_heads
    return t.view(b, group, grows // group, kv_heads, dim).permute(0, 2, 3, 1, 4).reshape(b, grows // group, heads, dim)


def postprocessed_dq(q, sets):
    """dQ (q's shape and dtype) from row sets' float32 accumulators, each converted by its FA4 postprocess
    (scaled) and the parts added in q's dtype. ``sets``: ``(accum, (post_fn, post_args), start, stop, q_rows,
    fold)`` — ``q_rows`` the set's q as its kernels take it (folded: ``fold_heads``), its part's shape."""
    total = None
    for accum, (post_fn, post_args), start, stop, q_rows, fold in sets:
        part = torch.empty_like(q_rows, memory_format=torch.contiguous_format)
        post_fn(accum, part, *post_args[2:])
        if fold:
            part = unfold_heads(part, q.shape[2])
        if total is None and (start, stop) == (0, q.shape[1]):
            total = part
            continue
        if total is None:
            total = torch.zeros_like(q, memory_format=torch.contiguous_format)
        total[:, start:stop] += part
    return total


class _RowSet:
    """One row set's preprocess results and its float32 dQ accumulator (FA4's layout for its kernel); ``q`` and
    ``dout`` as its kernels take them (folded: ``fold_heads``). ``shared``: ``(dpsum, lse_log2, dq_accum,
    run)``, views the ring's shared preprocess (``FA4RingBackward.share_preprocess``) hands out; the preprocess
    runs only where ``run`` (the whole shard's set), the others' rows being already written and their dQ
    accumulators zeroed. ``bufs``: ``(dpsum, lse_log2, dq_accum)`` kept from an earlier backward of the ring's
    shape (``FA4RingBackward.set_bufs``), which the preprocess writes over (and zeroes dq_accum); ``written``: a
    folded set's fold wrote them already (``FA4_RING_FOLD_PRE``, ``triton_fold_preprocess``)."""

    def __init__(self, rec, q, out, dout, lse, fold, shared=None, bufs=None, written=False):
        (pre_fn, pre_args), _, _, _ = rec
        self.rec, self.q, self.dout, self.fold = rec, q, dout, fold
        if shared is not None:
            self.dpsum, self.lse_log2, self.dq_accum, run = shared
            if not run:
                return
        else:
            self.dpsum, self.lse_log2, self.dq_accum = bufs or preprocess_buffers(rec, dout)
        if not written:
            pre_fn(out, dout, self.dpsum, lse, self.lse_log2, self.dq_accum, *pre_args[6:])   # zeroes dq_accum


def _zeroed_beside(tensors, stream):
    """Zero ``tensors`` on ``stream`` after what the compute stream has queued (a previous backward's dQ finish
    reads them); returns the event the first block that reads them waits for. Plain stream calls: less host time
    than the context manager."""
    main = torch.cuda.current_stream(tensors[0].device)
    stream.wait_stream(main)
    torch.cuda.set_stream(stream)
    try:
        for t in tensors:
            t.zero_()
        done = torch.cuda.Event()
        done.record(stream)
    finally:
        torch.cuda.set_stream(main)
    return done


def _choice(name: str, allowed) -> str:
    """Knob ``name``'s value, one of ``allowed`` (read in ``prepare``: before the ring's first exchange, on every
    rank alike), else a ValueError."""
    value = knobs.get(name)
    if value not in allowed:
        raise ValueError(f"DISTLAB_{name}={value!r}: one of {', '.join(allowed)}")
    return value


def _early_point(blocks):
    """``FA4RingBackward._dq_early``'s point in a ring's ``blocks`` (``[(rows, cols, causal)]`` in the order they
    run): ``(i, key of block i, the last row set's key)`` where the last row set starts after row 0 and other
    sets' blocks run before its last ones (block ``i`` the last of those), else None."""
    sets = [(rows.start, rows.stop, causal) for rows, _, causal in blocks]
    if not sets or sets[-1][0] == 0 or len(set(sets)) < 2:
        return None
    i = max(j for j, key in enumerate(sets) if key != sets[-1])
    rows, cols, causal = blocks[i]
    return i, (rows.start, rows.stop, cols.start, cols.stop, causal), sets[-1]


def preprocess_buffers(rec, like):
    """FA4's preprocess outputs for a block recorded as ``rec``, new: delta, the LSE in log2 and dQ's accumulator
    (float32; float64 with a CPU test's stand-ins)."""
    shapes, acc = rec[3], _acc_dtype(like.dtype)
    return tuple(torch.empty(shapes[name], dtype=acc, device=like.device) for name in ("dpsum", "dpsum", "dq_accum"))


class FA4RingBackward:
    """One rank's ring backward on FA4's kernels: ``block`` per ring block (dQ kept in float32 across the
    steps; the block's dK/dV returned as float32 scratch in FA4's accumulator layout, for ``add_into`` a
    travelling accumulator), ``dq()`` at the end, ``finish_dkv`` for the accumulator that comes home.
    ``causal``: the ring's (its first block, all rows against all local keys, starts the travelling
    accumulator and sets its shape)."""

    def __init__(self, dout, q, out, lse, k, scale, causal, layout=None):
        self.dout, self.q, self.out, self.lse, self.scale, self.causal = dout, q, out, lse, scale, causal
        self.kv_heads, self.keys = k.shape[2], k.shape[1]
        self.sets: dict = {}
        self.plans: dict = {}
        self.zeroed: dict = {}   # block key -> [(zeroed scratch, its fill's event)] (``zero_ahead``)
        self.zeroed_later = None   # the later row sets' dQ accumulators' fill on a side stream (``prepare``)
        self.scratch: dict = {}   # block key -> [kept dK/dV scratch, zeroed by ``prepare``] (``keep_scratch``)
        self.shares: dict = {}   # (id of a kept scratch, start, n) -> its share's view, kept per ring shape (``share``)
        self.kept: dict = {}   # id -> each kept scratch buffer (held: its id stays its own)
        self.set_bufs: dict = {}   # row set key -> its own preprocess's buffers, kept per ring shape (``_row_set``)
        self.add_rows = knobs.get("RING_DKV_ADD_ROWS") == "1"
        self.glue = knobs.get("FA4_RING_GLUE")   # a folding ring's fold and adds in Triton (triton_ring_glue)
        self.fold_pre = knobs.get("FA4_RING_FOLD_PRE") == "1"   # and its folded sets' preprocess in the fold
        self.triton = triton_runs_on(q.device)   # asked once: the glue's and the dQ finish's calls are per block
        # an unfolded block of a folding ring: its float32 scratch finished into the travelling accumulator by
        # one Triton pass (triton_ring_glue.dkv_finish_), not converted to q's dtype first (``raw``)
        self.raw_finish = knobs.get("FA4_RING_DKV_FINISH") == "1"
        self.raw = None   # (orders, dK's scale, dV's scale, postprocesses) once the first such block ran
        self.whole = None   # ``prepare``'s
        # dQ's early finish (``_dq_early``): (index of the block after which it runs, that block's key, the last
        # row set's key) or None; the blocks run so far; what it left for ``dq()``; the side stream it runs on
        self.early, self.calls, self.early_done, self.beside = None, 0, None, None
        # every rank decides alike (shapes and a knob): the travelling accumulator's layout depends on it
        mode = knobs.get("FA4_RING_FOLD")
        half = causal and layout == "zigzag"   # a causal zigzag ring's later row sets are half its shard
        self.fold = q.shape[2] > k.shape[2] and (mode == "1" or mode == "half" and half or mode == "auto" and half
                                                  and FOLD_MIN_SHARD <= q.shape[1] <= 2 * FOLD_MAX_ROWS)
        auto_rows = q.shape[1] if q.shape[1] >= FOLD_WHOLE_SHARD else min(FOLD_MAX_ROWS, q.shape[1] // 2)
        self.fold_rows = {"auto": auto_rows, "half": q.shape[1] // 2}.get(mode)

    def folds(self, rows: int, causal: bool) -> bool:
        """A block of ``rows`` rows runs folded: a folding ring's unmasked block, short enough a row set
        (``auto``) that FA4's CTAs loop over few rows."""
        return self.fold and not causal and (self.fold_rows is None or rows <= self.fold_rows)

    def prepare(self, blocks, beside=None, keep_scratch=False):
        """Record FA4's kernels for every block shape of the ring (``[(rows, cols, causal)]``) now, before the
        ring's first exchange: a recording FA4 refuses raises on every rank before any collective. What this
        works out (and the shared preprocess's buffers, ``share_preprocess``) is kept per ring shape: each
        layer's and step's backward would pay its host time again (H100, S8192: rebuilt every call, the shared
        preprocess cost the wall clock 3–6 points while gaining 0.4–1 on the GPU clock, docs/PERF.md).
        ``beside``: a CUDA stream on which, with the knob ``FA4_RING_ZERO_BESIDE=1``, the later row sets' dQ
        accumulators are zeroed beside step 0's kernels (their first block waits for it). Off by default: H100,
        S8192, it gained the GPU clock 0.6 points on the slowest rank and cost the wall 0.3 (the stream switch
        and event's host time; docs/PERF.md).

        ``keep_scratch`` (a fused ring, ``distlab.cp.ring_fused``, whose ``blocks[0]`` is step 0's own block):
        the later unfolded blocks' dK/dV scratch is kept per ring shape too, in the same allocation as the later
        row sets' dQ accumulators, so one fill zeroes them all each backward instead of one ``torch.zeros`` a
        block (an allocation and a fill launch: ~30 µs of host each on a slow H100 host, #24's ring step), and
        the later folded blocks' dK/dV (written whole, in q's dtype: one allocation, no fill); the shares cut
        out of kept buffers are views made once (``share``). Step 0's scratch stays fresh: it starts the
        accumulator that travels. The kept buffers are read by the dK/dV adds on the side stream, which the
        compute stream waits for at the backward's end, before the next backward writes them."""
        q = self.q
        share = knobs.get("FA4_RING_SHARE_PRE") != "0"
        keep = keep_scratch and knobs.get("FA4_RING_KEEP_SCRATCH") == "1"
        sig = (tuple(q.shape), q.dtype, q.device, self.keys, self.kv_heads, self.causal, self.fold, self.fold_rows,
               self.scale, share, keep, tuple((r.start, r.stop, c.start, c.stop, cz) for r, c, cz in blocks))
        plan = lru.kept(_PREPARED, sig, lambda: self._plan(blocks, share, keep), PREPARED_KEPT)
        self.plans = plan["blocks"]   # filled by the first backward of this shape, read by the later ones
        self.whole = plan["whole"]   # the recording of the whole shard's block (``finish_dkv``'s postprocesses)
        zero, sets = plan["zero"], plan["sets"]   # ``zero``: the later row sets' dQ accumulators, the kept scratch
        self.scratch = {key: list(views) for key, views in plan["scratch"].items()}   # popped a block at a time
        self.shares, self.set_bufs, self.kept = plan["shares"], plan["set_bufs"], plan["kept"]
        self.plan, self.beside = plan, beside
        early = _choice("FA4_RING_DQ_EARLY", ("0", "1", "auto"))
        _choice("FA4_RING_ZERO_BESIDE", ("0", "1", "once"))
        if plan["early"] is not None and (early == "1" or early == "auto" and q.shape[1] >= DQ_EARLY_MIN_SHARD) \
                and knobs.get("FA4_RING_DQ_FUSED") == "1" and self.triton and _acc_dtype(q.dtype) == torch.float32:
            self.early = plan["early"]
        if zero is not None:
            if beside is not None and knobs.get("FA4_RING_ZERO_BESIDE") == "1":
                self.zeroed_later = _zeroed_beside([zero], beside)
            else:
                zero.zero_()
            for rows, cols, causal, views, rec in sets:
                self._row_set(rows, cols, causal, views, rec)
        if not sets and self.fold and self.fold_pre and self.triton and knobs.get("FA4_RING_PRE_ONCE") == "1":
            self._preprocess_once(blocks)

    def _preprocess_once(self, blocks):
        """Every row set's preprocess in one Triton pass before step 0 (knob ``FA4_RING_PRE_ONCE``,
        ``triton_fold_preprocess.preprocess_sets_``) where the ring's row sets are folded ones (up to two) and at
        most one unfolded, the whole shard's (S32768, W=8, every unmasked set folded: the causal set, all rows,
        the second half): q, out and dO read once for all, not once per set — the causal set's preprocess and
        each folded set's fold-and-preprocess read them again (H100, S32768 rank 4: 45 + 83 + 42 µs; in one
        pass 129, docs/PERF.md). Other rings, or tensors the pass does not take: each set's own preprocess when
        its first block runs, as before."""
        q, s = self.q, self.q.shape[1]
        first = {}   # row set key -> the keys of its first block (``block`` records a new set with them)
        for rows, cols, causal in blocks:
            first.setdefault((rows.start, rows.stop, causal), cols.stop - cols.start)
        folded = [key for key in first if self.folds(key[1] - key[0], key[2])]
        plain = [key for key in first if key not in folded]
        fp = _fold_pre()
        if len(first) < 2 or not 0 < len(folded) <= fp.MAX_FOLDED or len(plain) > 1 \
                or any(key[:2] != (0, s) for key in plain):   # the pass writes one unfolded set's buffers
            return
        recs = {key: self._rec(key[1] - key[0], first[key], key[2], key in folded) for key in first}
        bufs = {key: self.set_bufs.get(key) or preprocess_buffers(recs[key], self.dout) for key in first}
        tensors, targets = (q, self.out, self.dout), [(key[0], key[1] - key[0], bufs[key]) for key in folded]
        unfolded = bufs[plain[0]] if plain else None
        if not fp.sets_take(tensors, self.lse, self.kv_heads, targets, unfolded):
            return
        # a causal ring's step 0 runs the unfolded causal set: the folded ones' first blocks come later
        beside = self.beside if self.causal and knobs.get("FA4_RING_ZERO_BESIDE") in ("1", "once") else None
        outs = fp.preprocess_sets_(tensors, self.lse, self.kv_heads, targets, unfolded, True, beside is None)
        if beside is not None:   # the folded sets' dQ accumulators zeroed beside step 0's kernel, which does not
            # read them (their first block waits: ``zeroed_later``); H100 S32768 rank 4, 100 of the pass's ~370 MB
            self.zeroed_later = _zeroed_beside([bufs[key][2] for key in folded], beside)
        for key, (fq, fdout) in zip(folded, outs):
            self.sets[key] = _RowSet(recs[key], fq, None, fdout, None, True, None, bufs[key], True)
        for key in plain:
            self.sets[key] = _RowSet(recs[key], q, None, self.dout, None, False, None, bufs[key], True)
        for key in first:   # kept for the next backward of this ring shape, as ``_row_set`` keeps them
            self.set_bufs.setdefault(key, bufs[key])

    def _plan(self, blocks, share: bool, keep: bool):
        """The first time a ring shape comes: record every block shape, and with ``share`` the shared
        preprocess's buffers and views (``share_preprocess``); with ``keep`` the later unfolded blocks' dK/dV
        scratch, carved out of the same allocation's tail (``prepare``'s ``keep_scratch``)."""
        q = self.q
        whole = self._rec(q.shape[1], self.keys, self.causal)
        kept, folded = [], []   # (block key, shape, its numel padded to 64: every view 128-byte aligned or more)
        for i, (rows, cols, causal) in enumerate(blocks):
            n, fold = rows.stop - rows.start, self.folds(rows.stop - rows.start, causal)
            rec = self._rec(n, cols.stop - cols.start, causal, fold)
            if keep and i > 0:   # a folded block's dK/dV are written whole in q's dtype: kept, never zeroed
                key = (rows.start, rows.stop, cols.start, cols.stop, causal)
                shape = torch.Size((2, q.shape[0], cols.stop - cols.start, self.kv_heads, q.shape[3]) if fold else
                                   (2, *rec[3]["dkv_accum"]))
                (folded if fold else kept).append((key, shape, -(-shape.numel() // 64) * 64))
        extra = sum(size for _, _, size in kept)
        zero, sets = (self.share_preprocess(blocks, extra) if share else None) or (None, [])
        if extra and zero is None:
            zero = torch.empty(extra, dtype=_acc_dtype(q.dtype), device=q.device)
        outs = (torch.empty(sum(size for _, _, size in folded), dtype=q.dtype, device=q.device) if folded else None)
        scratch = {}
        for flat, views in ((zero, kept), (outs, folded)):
            at = 0 if flat is None else flat.numel() - sum(size for _, _, size in views)
            for key, shape, size in views:
                scratch.setdefault(key, []).append(flat[at:at + shape.numel()].view(shape))
                at += size
        return {"zero": zero, "outs": outs, "sets": sets, "blocks": {}, "whole": whole, "scratch": scratch,
                "early": _early_point(blocks), "partial": None,
                "set_bufs": {}, "shares": {}, "kept": {id(view): view for views in scratch.values() for view in views}}

    def share_preprocess(self, blocks, extra: int = 0):
        """One preprocess for every unfolded row set: FA4's preprocess writes, per head, each row's delta
        (rowsum(out·dO)) and base-2 LSE, which depend on the row alone, not on the block — a later row set's
        are the whole shard's rows ``start`` … ``stop``. They go into one buffer of the shard's rows and a
        tail, each set reading a view of it at its own start; FA4's kernels take any head stride (a multiple
        of 4) and round a set's rows up to their tile (64 causal, 80 not: zigzag's half set at S8192 reads 560
        rows from row 512), so the tail past the shard holds what FA4's preprocess writes past a set's rows
        (delta 0, LSE +inf: no key weighs on them). H100, S8192, W=8 (docs/PERF.md): a middle rank's three
        preprocesses 13.6 + 6.2 µs read out and dO again for rows already read. A folded set (its rows are heads
        × rows) keeps its own preprocess.

        Returns ``(zero, sets)`` or None (fewer than two unfolded sets): ``zero`` the later sets' dQ
        accumulators and ``extra`` elements after them (``_plan``'s kept scratch), one tensor to zero each
        backward; ``sets`` each set's ``(rows, cols, causal, views, rec)`` for ``_RowSet``. The buffers are made
        once and kept per ring shape (``prepare``): one backward on a shape at a time, in stream order — each
        backward's ``dq()`` has read its accumulators before the next one zeroes them on the same stream."""
        s, (b, h) = self.q.shape[1], self.q.shape[:3:2]
        whole = (0, s, self.causal)
        keys = {whole: self.keys}
        for rows, cols, causal in blocks:
            keys.setdefault((rows.start, rows.stop, causal), cols.stop - cols.start)
        recs = {key: self._rec(key[1] - key[0], cols, key[2]) for key, cols in keys.items()
                if not self.folds(key[1] - key[0], key[2])}
        plain = {key: rec[3] for key, rec in recs.items()}
        if len(plain) < 2 or whole not in plain:
            return None
        reach = max(start + shapes["dpsum"][-1] for (start, _, _), shapes in plain.items())
        width = s + -(-max(reach - s, 0) // 4) * 4   # a multiple of 4 floats: FA4's assumed 16-byte alignment
        order = [whole] + [key for key in plain if key != whole]
        sizes = [2 * b * h * width] + [torch.Size(plain[key]["dq_accum"]).numel() for key in order] + [extra]
        acc = _acc_dtype(self.q.dtype)
        flat = torch.empty(sum(sizes), dtype=acc, device=self.q.device)
        rows, *accums, _ = flat.split(sizes)
        rows = rows.view(2, b, h, width)   # [0] delta, [1] the base-2 LSE; the shard's rows written each backward
        rows[0, :, :, s:].zero_()
        rows[1, :, :, s:].fill_(float("inf"))
        sets = []
        for key, accum in zip(order, accums):
            n = plain[key]["dpsum"][-1]
            views = (rows[0, :, :, key[0]:key[0] + n], rows[1, :, :, key[0]:key[0] + n],
                     accum.view(plain[key]["dq_accum"]), key == whole)   # the whole set's zeroed by its preprocess
            sets.append((slice(key[0], key[1]), keys[key], key[2], views, recs[key]))
        return flat[sizes[0] + sizes[1]:], sets

    def _rec(self, rows: int, cols: int, causal: bool, fold: bool = False):
        """FA4's kernels for a block of ``rows`` × ``cols`` (``fold``: its q heads folded into rows, MHA)."""
        q = self.q
        group = q.shape[2] // self.kv_heads if fold else 1
        return _record(q.shape[0], rows * group, cols, q.shape[2] // group, self.kv_heads, q.shape[3], q.dtype,
                       q.device, causal, self.scale)

    def _row_set(self, rows: slice, cols: int, causal: bool, shared=None, rec=None) -> _RowSet:
        key = (rows.start, rows.stop, causal)
        rs = self.sets.get(key)
        if rs is None:
            whole = rows.stop - rows.start == self.q.shape[1]
            if whole:
                q, out, dout, lse = self.q, self.out, self.dout, self.lse
            elif shared is not None and not shared[3]:   # the shared preprocess's rows: out and LSE not read here
                q, out, dout, lse = self.q[:, rows], None, self.dout[:, rows], None
            else:
                q, out, dout, lse = self.q[:, rows], self.out[:, rows], self.dout[:, rows], self.lse[:, :, rows]
            fold = self.folds(rows.stop - rows.start, causal)
            rec = rec or self._rec(rows.stop - rows.start, cols, causal, fold)
            bufs = kept = self.set_bufs.get(key) if shared is None else None
            written = False
            if fold and self.fold_pre and self.triton and shared is None:   # the fold and FA4's preprocess, one launch
                fp = _fold_pre()
                bufs = bufs or preprocess_buffers(rec, dout)
                if fp.fold_pre_takes((q, out, dout), lse, self.kv_heads, bufs):
                    (q, dout), written = fp.fold_preprocess_((q, out, dout), lse, self.kv_heads, bufs, True), True
            if fold and not written:   # once per row set: the blocks of this set all take these
                q, out, dout = self._folded((q, out, dout))
                lse = lse.reshape(lse.shape[0], self.kv_heads, -1)   # (B, H, rows) -> (B, Hkv, G·rows)
            rs = self.sets[key] = _RowSet(rec, q, out, dout, lse, fold, shared, bufs, written)
            if shared is None and kept is None:   # kept for the next backward of this ring shape (``prepare``)
                self.set_bufs[key] = (rs.dpsum, rs.lse_log2, rs.dq_accum)
        return rs

    def _folded(self, tensors):
        """``fold_heads`` of each tensor: in one Triton launch with the knob ``FA4_RING_GLUE`` (``1`` or ``fold``)
        where ``triton_ring_glue.fold_takes`` says it applies, else torch's permuted copy a tensor."""
        if self.glue in ("1", "fold") and self.triton:
            glue = _glue()
            if glue.fold_takes(tensors, self.kv_heads):
                return glue.fold_heads_(tensors, self.kv_heads, checked=True)
        return [fold_heads(t, self.kv_heads) for t in tensors]

    def share(self, part, keys: int, start: int, n: int):
        """The keys ``start`` … ``start + n`` of a block result ``part`` over ``keys`` keys (``block``'s return);
        of a kept scratch buffer (``prepare``'s ``keep_scratch``, held in ``kept``), the view made once per ring
        shape (``shares``)."""
        view = self.shares.get((id(part), start, n))
        if view is not None:
            return view
        if part.ndim == 5:
            view = part[:, :, start:start + n]
        else:
            per_key = part.shape[-1] // keys
            view = part[..., start * per_key:(start + n) * per_key]
        if id(part) in self.kept:
            self.shares[id(part), start, n] = view
        return view

    def own_accumulator(self, part):
        """The travelling accumulator that this rank's own block result ``part`` starts (fresh memory: ``part``
        may be a view into a fused block's result): FA4's float32 scratch as it is, a folded block's result in
        float32."""
        if part.ndim == 5:
            return part.to(_acc_dtype(part.dtype), copy=True)
        if self.fold:   # a folding ring's own unfolded block, its scratch as it is (``_raw_ok``): finished now
            glue = _glue()
            two, b, kv_heads, _ = part.shape
            acc = torch.empty((two, b, self.keys, kv_heads, self.q.shape[3]), dtype=part.dtype, device=part.device)
            return glue.dkv_finish_(acc, part, *self.raw[:3], add=False)
        return part.contiguous()

    def add_into(self, acc, cols: slice, part):
        """``acc``'s keys ``cols`` += ``part`` (a block's scratch for those keys; FA4's accumulator layout keeps
        each head's keys in order, in whole tiles: a key range is a slice of the last dimension; ``acc`` and
        ``part`` hold dK and dV along a leading dimension of 2, so one add does both)."""
        whole = cols.start == 0 and cols.stop == self.keys
        if acc.ndim == 5:   # folded blocks' layout (2, B, keys, Hkv, D): a key range is a slice of dim 2
            view = acc if whole else acc[:, :, cols]
            if part.ndim == 4:   # an unfolded block's scratch as it is (``_raw_ok``): finished into the view
                glue = _glue()
                glue.dkv_finish_(view, part, *self.raw[:3], add=True)
                return
            if self.glue in ("1", "add") and self.triton:   # one vectorized Triton pass
                glue = _glue()
                if glue.try_add_into_(view, part):
                    return
            view.add_(part)
            return
        per_key = acc.shape[-1] // self.keys
        view = acc if whole else acc[..., cols.start * per_key:cols.stop * per_key]
        if self.add_rows and not (view.is_contiguous() and part.is_contiguous()):
            # a share cut out of a fused block is strided (rows of one head's keys): one add per row, all in one
            # multi-tensor launch, is vectorized where the strided add is not (H100 S32768: 40-65 µs an add)
            torch._foreach_add_(view.flatten(0, -2).unbind(0), part.flatten(0, -2).unbind(0))
        else:
            view.add_(part)

    def block(self, k, v, rows: slice, cols: slice, causal: bool):
        """Run the block (rows × cols of this rank's q against k, v); dQ goes into its row set's accumulator;
        returns the block's dK and dV as one float32 tensor ``(2, *FA4's accumulator shape)`` for the keys
        ``cols`` (one add and one exchange carry both: host time a ring step, #24). What a block
        shape needs besides its tensors (its kernel and arguments, scratch shape, row set) is worked out once a
        ring shape (``prepare`` shares ``plans`` between the backward passes of one shape)."""
        key = (rows.start, rows.stop, cols.start, cols.stop, causal)
        plan = self.plans.get(key)
        if plan is None:
            n, fold = cols.stop - cols.start, self.folds(rows.stop - rows.start, causal)
            rec = self._rec(rows.stop - rows.start, n, causal, fold)
            _, (main_fn, main_args), _, shapes = rec
            plain = (2, self.q.shape[0], n, self.kv_heads, self.q.shape[3])   # folded: dK/dV in q's dtype, bshd
            shape, acc = (plain, self.q.dtype) if fold else ((2, *shapes["dkv_accum"]), _acc_dtype(k.dtype))
            plan = self.plans[key] = (n, shape, acc, main_fn, (rows.start, rows.stop, causal), main_args[9:],
                                      rec[2] if self.fold and not fold else None, plain)
        n, shape, acc, main_fn, set_key, rest, convert, plain = plan
        rs = self.sets.get(set_key) or self._row_set(rows, n, causal)
        if n != k.shape[1]:
            k, v = k[:, cols], v[:, cols]
        if self.zeroed_later is not None and (rows.stop - rows.start, causal) != (self.q.shape[1], self.causal):
            torch.cuda.current_stream(k.device).wait_event(self.zeroed_later)   # a later row set's first block
            self.zeroed_later = None
        ahead = self.zeroed.get(key)
        if ahead:   # zeroed beforehand on a side stream (``zero_ahead``)
            buf, done = ahead.pop(0)
            torch.cuda.current_stream(k.device).wait_event(done)
        elif self.scratch.get(key):   # kept (``keep_scratch``): zeroed by ``prepare``, or a folded block's
            buf = self.scratch[key].pop(0)
            if self.zeroed_later is not None and not rs.fold:   # zeroed on the side stream (FA4_RING_ZERO_BESIDE)
                torch.cuda.current_stream(k.device).wait_event(self.zeroed_later)
                self.zeroed_later = None
        elif rs.fold:   # written whole by the kernel
            buf = torch.empty(shape, dtype=acc, device=k.device)
        else:
            buf = torch.zeros(shape, dtype=acc, device=k.device)
        main_fn(rs.q, k, v, rs.dout, rs.lse_log2, rs.dpsum, rs.dq_accum, buf[0], buf[1], *rest)
        self.calls += 1
        if self.early is not None and self.calls == self.early[0] + 1 and key == self.early[1]:
            self._dq_early()
        if convert is not None and self._raw_ok(convert, k.device):   # finished by own_accumulator / add_into
            return buf
        if convert is not None:   # a causal block in a folding ring: its scratch in the folded blocks' layout
            out = torch.empty(plain, dtype=self.q.dtype, device=k.device)
            for i in (0, 1):
                convert[1 + i][0](buf[i], out[i], *convert[1 + i][1][2:])
            return out
        return buf

    def _raw_ok(self, posts, device) -> bool:
        """An unfolded block's scratch may go to ``add_into`` / ``own_accumulator`` as it is (knob
        ``FA4_RING_DKV_FINISH=1``; Triton on this device; float32 scratch; FA4's dK/dV postprocesses' tile order
        read, and every such block's the same): they finish it in one pass, ``triton_ring_glue.dkv_finish_``."""
        if not self.raw_finish or _acc_dtype(self.q.dtype) != torch.float32 or not self.triton:
            return False
        if self.raw is not None:
            return self.raw[3] == (posts[1][0], posts[2][0]) or self._raw_refused("a block's postprocesses differ")
        from distlab.kernels.triton_dq_finish import TileOrderUnknown

        try:
            orders = _glue().dkv_orders(posts[1:], self.q.shape[3], self.q.dtype, device)
        except TileOrderUnknown as err:
            return self._raw_refused(str(err))
        self.raw = (orders, posts[1][1][2], posts[2][1][2], (posts[1][0], posts[2][0]))
        return True

    def _raw_refused(self, why: str) -> bool:
        """The converted path from here on, said once per process (every rank runs the same FA4 and shapes)."""
        warnings.warn(f"FA4_RING_DKV_FINISH: {why}; dK/dV converted by FA4's postprocesses instead")
        self.raw_finish = False
        return False

    def zero_ahead(self, blocks, stream):
        """Zero the dK/dV scratch of these blocks (``(rows, cols, causal)``, each used once) now on ``stream``,
        beside the kernels already queued, instead of on the compute stream right before each block (a ring's
        fused blocks: 8 + 13 µs at S8192, 31 + 43 µs at S32768 on the H100, W=8). The buffers come from
        ``stream``'s pool and are marked as used by the compute stream, which waits for their fill."""
        main = torch.cuda.current_stream(self.q.device)
        stream.wait_stream(main)   # forked from the compute stream: what is queued there comes first, and a CUDA
        # graph's capture follows the fills onto the side stream (unforked, its capture fails: H100, 2026-12-05)
        for rows, cols, causal in blocks:
            if self.folds(rows.stop - rows.start, causal):   # a folded block's dK/dV need no zeroing
                continue
            key = (rows.start, rows.stop, cols.start, cols.stop, causal)
            shapes = self._rec(rows.stop - rows.start, cols.stop - cols.start, causal)[3]
            with torch.cuda.stream(stream):
                buf = torch.zeros((2, *shapes["dkv_accum"]), dtype=_acc_dtype(self.q.dtype), device=self.q.device)
                done = torch.cuda.Event()
                done.record(stream)
            buf.record_stream(main)
            self.zeroed.setdefault(key, []).append((buf, done))

    def dq(self):
        """The rank's dQ in q's dtype: each row set's accumulator converted by FA4's postprocess (scaled); the
        sets after the first added in q's dtype (float64 on the CPU's stand-ins). On the H100 (S32768, W=8,
        rank 0's two row sets) the end of the backward went 243 → 90 µs against a float32 sum (a zero fill, the
        adds in float32, a conversion); each set's part is already rounded once by its postprocess, so a bf16
        sum rounds at most twice more. By default (knob ``FA4_RING_DQ_FUSED=1``; H100 S8192, rank 1: the
        backward's kernels 550 -> 540 µs, slowest rank +1.5 points, ``docs/PERF.md``) one Triton kernel reads
        every set's accumulator in FA4's tile order, sums in float32 and rounds once
        (``distlab.kernels.triton_dq_finish``); this path is the fallback where that does not apply."""
        if self.early_done is not None:   # the other row sets finished beside the last kernels (``_dq_early``)
            return self._dq_after_early()
        if knobs.get("FA4_RING_DQ_FUSED") == "1" and self._dq_fusable():   # Triton runs here: importable
            from distlab.kernels.triton_dq_finish import TileOrderUnknown

            try:
                return self._dq_fused()
            except TileOrderUnknown as err:   # another FA4's postprocess: every rank runs the same FA4, so
                # every rank falls back alike (a warning once per process: Python's default filter)
                warnings.warn(f"FA4_RING_DQ_FUSED: {err}; dQ finished by FA4's postprocesses instead")
        return postprocessed_dq(self.q, [(rs.dq_accum, rs.rec[2][0], start, stop, rs.q, rs.fold)
                                         for (start, stop, _), rs in self.sets.items()])

    def _dq_early(self):
        """dQ of every row set but the last finished now, beside the last set's kernels (knob
        ``FA4_RING_DQ_EARLY``; on the side stream ``prepare`` was given, else in line): where the ring's last
        blocks all add into one later row set ``[a, s)`` (a causal zigzag ring's second half), the rows before
        ``a`` are final once the other sets' blocks ran — written in q's dtype now — and for rows ``a`` … ``s``
        the other sets' accumulators are summed into one float32 buffer in row order (kept per ring shape). The
        finish after the last kernel (``dq()``) then reads that buffer and the last set's accumulator for half the
        rows: at S32768, W=8 (rank 4: three sets of 4096, 4096 and 2048 rows) 84 MB moved after the last kernel
        instead of 201. The sums are the same float32 additions in the same order as the one-kernel finish's (the
        partial sum is scaled by 1, the last set added to it, then scaled): bit for bit the same dQ."""
        from distlab.kernels import triton_dq_finish as fin

        q, last = self.q, self.early[2]
        b, s, h, d = q.shape
        a = last[0]
        others = [(key, rs) for key, rs in self.sets.items() if key != last]
        if not 0 < len(others) <= fin.MAX_SETS:
            return
        try:
            sets = [self._finish_set(key, rs) for key, rs in others]
        except fin.TileOrderUnknown:   # dq() falls back alike on every rank
            return
        partial = self.plan["partial"]
        if partial is None:
            partial = self.plan["partial"] = torch.empty(b, h, (s - a) * d, dtype=torch.float32, device=q.device)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        scale = others[0][1].rec[2][0][1][2]   # the postprocess's own scale, every set's the same
        main = torch.cuda.current_stream(q.device) if self.beside is not None else None
        if main is not None:   # plain stream calls (host time: as the dK/dV adds, distlab.cp.ring_fused)
            self.beside.wait_stream(main)
            torch.cuda.set_stream(self.beside)
        try:
            fin.dq_finish(out[:, :a], sets, scale)
            fin.dq_finish(partial.view(b, h, s - a, d).transpose(1, 2), [(*t[:2], t[2] - a, *t[3:]) for t in sets],
                          1.0)
            done = None
            if main is not None:
                done = torch.cuda.Event()
                done.record(self.beside)
        finally:
            if main is not None:
                torch.cuda.set_stream(main)
        self.early_done = (out, partial, done)

    def _dq_after_early(self):
        """``dq()`` after ``_dq_early``: rows ``a`` … ``s`` from its float32 sum and the last set's accumulator."""
        from distlab.kernels import triton_dq_finish as fin

        (out, partial, done), self.early_done = self.early_done, None
        q, last = self.q, self.early[2]
        a, d = last[0], q.shape[3]
        if done is not None:
            torch.cuda.current_stream(q.device).wait_event(done)
        rs = self.sets[last]
        accum, order, start, n, group = self._finish_set(last, rs)
        sets = [(partial, fin.identity_order(d, q.device), 0, q.shape[1] - a, 1), (accum, order, start - a, n, group)]
        fin.dq_finish(out[:, a:], sets, rs.rec[2][0][1][2])
        return out

    def _dq_fusable(self) -> bool:
        """The one-kernel dQ finish applies: Triton runs on q's device, float32 accumulators, 2 or 3 row sets
        (every ring layout's ranks have at most 3). Where it does not, ``dq()`` takes FA4's postprocesses — the
        knob chooses a speed, not a result, and raising here, at the backward's end, could strand other ranks."""
        return 1 < len(self.sets) <= 3 and _acc_dtype(self.q.dtype) == torch.float32 and self.triton

    def _dq_fused(self):
        """``dq()`` in one kernel (``triton_dq_finish.dq_finish``); each set's tile order measured once on its
        own postprocess (``window_order``)."""
        from distlab.kernels import triton_dq_finish as fin

        sets = [self._finish_set(key, rs) for key, rs in self.sets.items()]
        scale = next(iter(self.sets.values())).rec[2][0][1][2]   # the postprocess's own (dQ held unscaled)
        return fin.dq_finish(torch.empty_like(self.q, memory_format=torch.contiguous_format), sets, scale)

    def _finish_set(self, key, rs):
        """Row set ``key`` as ``dq_finish`` takes it: ``(accumulator, tile order, start, rows, q heads per
        accumulator head)``; its tile order measured once on its own postprocess (``window_order``)."""
        from distlab.kernels import triton_dq_finish as fin

        q = self.q
        order = fin.window_order(rs.rec[2][0], q.shape[3], q.dtype, q.device)
        return rs.dq_accum, order, key[0], key[1] - key[0], q.shape[2] // self.kv_heads if rs.fold else 1

    def finish_dkv(self, acc, k, v):
        """A travelling dK/dV accumulator (``acc[0]`` dK, ``acc[1]`` dV), home: converted to k's and v's dtype (dK scaled) by FA4's
        postprocess (a folded ring's, ``(2, B, keys, Hkv, D)`` float32, already scaled: converted)."""
        if acc.ndim == 5 and k.dtype == v.dtype:   # one conversion launch for both (views of one tensor)
            return tuple(acc.to(k.dtype).unbind(0))
        if acc.ndim == 5:
            return acc[0].to(k.dtype), acc[1].to(v.dtype)
        post = (self.whole or self._rec(self.q.shape[1], self.keys, self.causal))[2]
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        post[1][0](acc[0].contiguous(), dk, *post[1][1][2:])
        post[2][0](acc[1].contiguous(), dv, *post[2][1][2:])
        return dk, dv
