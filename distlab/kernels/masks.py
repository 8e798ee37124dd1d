"""Attention masks as key intervals: packed documents, sliding windows and causality, for any block of
query rows against any set of key rows.

    python -m pytest tests/test_packed.py -k mask

Every mask distlab needs gives each query an *interval* of visible key positions: with documents given by
``cu_seqlens`` (global boundaries ``[0, l1, l1+l2, ..., T]``), query position i sees key position j iff

    doc_start(i) <= j < doc_end(i),   and  j <= i  when causal,   and  i - j <= window  when a window is given

so ``lo(i) = max(doc_start(i), i - window)`` and ``hi(i) = i + 1`` (causal) or ``doc_end(i)``. A block of
attention is then described by ``KeyMask(q_lo, q_hi, k_pos)``: per query row the global interval
``[q_lo, q_hi)`` it may see, and per key row its global position. That covers a ring step (my rows against
another rank's rows, in any layout), Ulysses' whole sequence and all-gather-KV's gathered keys alike, and
lets a kernel skip what the mask removes: rows whose interval holds no key, and keys outside the union of
a row block's intervals. Positions are int64; a key set whose positions ascend (every layout's shard)
is sliced, any other order is selected by index.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class KeyMask:
    """Query rows see the keys whose global position lies in ``[q_lo[i], q_hi[i])``."""

    q_lo: torch.Tensor      # (seq_q,) int64
    q_hi: torch.Tensor      # (seq_q,) int64
    k_pos: torch.Tensor     # (seq_k,) int64
    k_sorted: bool = True   # k_pos ascends (then a row block's keys are one slice)
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)   # a kernel's per-mask tables

    def rows(self, start: int, stop: int) -> "KeyMask":
        return KeyMask(self.q_lo[start:stop], self.q_hi[start:stop], self.k_pos, self.k_sorted)

    def to(self, device) -> "KeyMask":
        moved = KeyMask(self.q_lo.to(device), self.q_hi.to(device), self.k_pos.to(device), self.k_sorted)
        if "seen_columns" in self.memo:   # found on the host: the device copy needs no sync to know it
            moved.memo["seen_columns"] = self.memo["seen_columns"]
        return moved

    def seen_columns(self) -> slice | None:
        """``key_columns()`` of ascending keys, once per mask (kept by ``to``): the slice of key rows some
        query sees, or None."""
        if "seen_columns" not in self.memo:
            if not self.k_sorted:
                raise ValueError("seen_columns needs ascending key positions")
            self.memo["seen_columns"] = self.key_columns()
        return self.memo["seen_columns"]

    def key_columns(self) -> slice | torch.Tensor | None:
        """The key rows any query of this mask can see: a slice (ascending keys) or an index tensor; None
        when no query sees any key."""
        seeing = self.q_lo < self.q_hi
        if not bool(seeing.any()):
            return None
        lo, hi = self.q_lo[seeing].min(), self.q_hi[seeing].max()
        if self.k_sorted:
            a, b = torch.searchsorted(self.k_pos, torch.stack([lo, hi])).tolist()
            return slice(a, b) if b > a else None
        idx = ((self.k_pos >= lo) & (self.k_pos < hi)).nonzero().squeeze(1)
        return idx if idx.numel() else None

    def dense(self, cols=None) -> torch.Tensor:
        """(seq_q, keys) boolean: True where the query sees the key (``cols``: a subset of the keys)."""
        k = self.k_pos if cols is None else self.k_pos[cols]
        return (k[None, :] >= self.q_lo[:, None]) & (k[None, :] < self.q_hi[:, None])

    def visible_pairs(self) -> int:
        """How many (query, key) pairs the mask lets through: the attention's real work."""
        k = self.k_pos if self.k_sorted else self.k_pos.sort().values
        seen = torch.searchsorted(k, self.q_hi) - torch.searchsorted(k, self.q_lo)
        return int(seen.clamp_min(0).sum())


def check_cu_seqlens(cu_seqlens, total: int) -> torch.Tensor:
    """``cu_seqlens`` as an int64 CPU tensor, or a ValueError that says what is wrong with it."""
    if not isinstance(cu_seqlens, torch.Tensor):
        try:
            cu_seqlens = torch.tensor(cu_seqlens)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor of document boundaries; got "
                             f"{type(cu_seqlens).__name__}") from None
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
            or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [0, l1, l1+l2, ..., T] with at least two "
                         f"entries; got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {cu[0].item()}")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens must end at the sequence length {total}; got {cu[-1].item()}")
    if bool((cu[1:] < cu[:-1]).any()):
        i = int((cu[1:] < cu[:-1]).nonzero()[0])
        raise ValueError(f"cu_seqlens must not decrease; entry {i + 1} is {cu[i + 1].item()} after {cu[i].item()}")
    return cu


def check_window(window, causal: bool):
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an integer >= 0 (keys at most `window` positions back); got {window!r}")
    if not causal:
        raise ValueError("a sliding window needs causal=True (it counts keys back from each query)")
    return window


def key_interval(q_pos: torch.Tensor, cu_seqlens: torch.Tensor | None, causal: bool, window: int | None,
                 total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): global positions query ``q_pos`` may see (module doc); int64 on q_pos's device."""
    if cu_seqlens is None:
        start = torch.zeros_like(q_pos)
        end = torch.full_like(q_pos, total)
    else:
        cu = cu_seqlens.to(q_pos.device)
        doc = torch.searchsorted(cu, q_pos, right=True) - 1
        start, end = cu[doc], cu[doc + 1]
    hi = q_pos + 1 if causal else end
    lo = start if window is None else torch.maximum(start, q_pos - window)
    return lo, hi


def document_mask(q_pos, k_pos, cu_seqlens=None, causal=False, window=None, total=None) -> KeyMask:
    """The ``KeyMask`` of queries at ``q_pos`` against keys at ``k_pos`` (global positions)."""
    total = int(total if total is not None else max(int(q_pos.max()), int(k_pos.max())) + 1)
    lo, hi = key_interval(q_pos.long(), cu_seqlens, causal, window, total)
    k_pos = k_pos.long()
    return KeyMask(lo, hi, k_pos, bool((k_pos[1:] >= k_pos[:-1]).all()) if k_pos.numel() > 1 else True)


# ------------------------------------------------------------------------------- tile tables of a mask
# What a tiled kernel visits under a mask: per query tile its key rows, per key tile its query rows (the
# masked Triton kernel's loops; ``distlab.cp.emulate_packed`` counts the tiles a ring rank visits with them).

def masked_tiles(device: torch.device, d: int, kind: str = "fwd") -> tuple[int, int, int, int]:
    """The masked Triton kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) for head_dim ``d`` on ``device``: the
    backward holds more tiles, so smaller ones (at 128 x 64 and 3 stages its dK/dV kernel asked for 246 KiB of
    shared memory; the H200 has 227)."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    if kind == "fwd":
        return (128, 64, 8, 3) if d <= 128 else (64, 64, 8, 2)
    return (64, 64, 8, 2) if d <= 128 else (32, 32, 4, 1)


def key_ranges(mask, block_m: int):
    """Per query tile, the key rows [begin, end) its rows can see (int32, on the mask's device); computed
    once per mask and tile size (a ring reuses its step masks every iteration)."""
    key = ("key_ranges", block_m)
    if key not in mask.memo:
        mask.memo[key] = _tile_key_ranges(mask, block_m, every=False)
    return mask.memo[key]


def full_key_ranges(mask, block_m: int):
    """Per query tile, the key rows [begin, end) that *every* row of the tile sees (empty when one of its rows
    sees nothing): key tiles inside it run without the mask (the bulk of a causal or document block)."""
    key = ("full_key_ranges", block_m)
    if key not in mask.memo:
        mask.memo[key] = _tile_key_ranges(mask, block_m, every=True)
    return mask.memo[key]


def _tile_key_ranges(mask, block_m: int, every: bool):
    """The union (``every`` False) or the intersection (True) of the key intervals of each tile's rows, as key
    rows. A row that sees nothing drops out of a union and empties an intersection; padding rows do neither."""
    n = mask.q_lo.shape[0]
    tiles = (n + block_m - 1) // block_m
    pad = tiles * block_m - n
    seeing = mask.q_lo < mask.q_hi
    big = 2 ** 62   # past every position; int64's max would not do: pad's fill value goes through a double and
    #                 wraps to int64's min (every partial tile's key range then started at key 0)
    lo = torch.where(seeing, mask.q_lo, torch.full_like(mask.q_lo, big))
    hi = torch.where(seeing, mask.q_hi, torch.full_like(mask.q_hi, -big))
    lo = torch.nn.functional.pad(lo, (0, pad), value=-big if every else big).view(tiles, block_m)
    hi = torch.nn.functional.pad(hi, (0, pad), value=big if every else -big).view(tiles, block_m)
    lo, hi = (lo.amax(1), hi.amin(1)) if every else (lo.amin(1), hi.amax(1))
    begin = torch.searchsorted(mask.k_pos, lo)
    end = torch.searchsorted(mask.k_pos, hi)
    end = torch.where(end > begin, end, begin)            # a tile that sees nothing loops zero times
    return begin.to(torch.int32), end.to(torch.int32)


def key_gaps(mask, block_m: int, block_n: int):
    """Per query tile, the key tiles [gap_begin, gap_end) to skip: the whole tiles of ``block_n`` keys, on the
    grid the tile's loop walks from its range's begin, inside the widest run of keys that no row of the tile
    sees (none: gap_begin = gap_end = the range's end). The kernels loop over the tiles starting in
    [begin, gap_begin) and [gap_end, end): the tiles they visit are the ones they visited before, less the
    skipped ones, whose keys add nothing — so the results are bit for bit the same. A tile whose rows end one
    document and start another far off — a rank holding documents from all over a gathered sequence
    (all-gather CP, the balanced layout) — would otherwise visit every key between them. The run: every row
    up to some row j ends before it, every row after j starts past it."""
    key = ("key_gaps", block_m, block_n)
    if key not in mask.memo:
        mask.memo[key] = _tile_key_gaps(mask, block_m, block_n)
    return mask.memo[key]


def key_tiles(mask, block_m: int, block_n: int) -> torch.Tensor:
    """Per query tile, the key tiles of ``block_n`` the kernels visit: its key range less its gap."""
    (begin, end), (gap_begin, gap_end) = key_ranges(mask, block_m), key_gaps(mask, block_m, block_n)
    return range_tiles(begin, gap_begin, block_n) + range_tiles(gap_end, end, block_n)


def range_tiles(begin, end, size: int) -> torch.Tensor:
    """Per range [begin, end) (empty when end <= begin), the tiles of ``size`` a loop over it visits."""
    return ((end - begin).clamp_min(0) + size - 1).div(size, rounding_mode="floor")


def _tile_key_gaps(mask, block_m: int, block_n: int):
    n = mask.q_lo.shape[0]
    tiles = (n + block_m - 1) // block_m
    pad = tiles * block_m - n
    big = 2 ** 62
    seeing = mask.q_lo < mask.q_hi
    lo = torch.where(seeing, mask.q_lo, torch.full_like(mask.q_lo, big))
    hi = torch.where(seeing, mask.q_hi, torch.full_like(mask.q_hi, -big))
    lo = torch.nn.functional.pad(lo, (0, pad), value=big).view(tiles, block_m)
    hi = torch.nn.functional.pad(hi, (0, pad), value=-big).view(tiles, block_m)
    ends = hi.cummax(1).values                                   # the furthest end of rows 0..j
    starts = lo.flip(1).cummin(1).values.flip(1)                 # the nearest start of rows j..
    starts = torch.cat([starts[:, 1:], torch.full_like(starts[:, :1], big)], 1)   # ... of rows j+1..
    gap_begin = torch.searchsorted(mask.k_pos, ends.contiguous())
    gap_end = torch.searchsorted(mask.k_pos, starts.contiguous())
    width = torch.where((ends > -big) & (starts < big), gap_end - gap_begin, torch.zeros_like(gap_end))
    best = width.argmax(1, keepdim=True)
    begin, end = (t.to(gap_begin.dtype) for t in key_ranges(mask, block_m))
    # whole tiles of the loop's grid inside the run: from the first tile start at or past its begin to the
    # last tile start whose tile ends by its end
    first = begin + (gap_begin.gather(1, best).squeeze(1) - begin + block_n - 1) // block_n * block_n
    last = begin + (gap_end.gather(1, best).squeeze(1) - begin) // block_n * block_n
    keep = (width.gather(1, best).squeeze(1) > 0) & (last > first)
    return torch.where(keep, first, end).to(torch.int32), torch.where(keep, last, end).to(torch.int32)


def query_ranges(mask, seq_k: int, block_n: int):
    """Per key tile, the query rows [begin, end) that can see it: one range when the rows' intervals ascend
    (every layout's shard); else every row. Computed once per mask and tile size."""
    key = ("query_ranges", seq_k, block_n)
    if key not in mask.memo:
        mask.memo[key] = _tile_query_ranges(mask, seq_k, block_n, every=False)
    return mask.memo[key]


def full_query_ranges(mask, seq_k: int, block_n: int):
    """Per key tile, the query rows [begin, end) that see every key of it (rows' intervals ascending; else
    none): the dK/dV kernel runs them without the mask."""
    key = ("full_query_ranges", seq_k, block_n)
    if key not in mask.memo:
        mask.memo[key] = _tile_query_ranges(mask, seq_k, block_n, every=True)
    return mask.memo[key]


def _tile_query_ranges(mask, seq_k: int, block_n: int, every: bool):
    """Rows that see some key of each key tile (``every`` False) or all of them (True)."""
    tiles = (seq_k + block_n - 1) // block_n
    lo, hi = mask.q_lo, mask.q_hi
    monotone = lo.numel() < 2 or bool(((lo[1:] >= lo[:-1]) & (hi[1:] >= hi[:-1])).all())
    if not monotone:
        ends = torch.tensor([0, 0 if every else lo.numel()], dtype=torch.int32, device=lo.device)
        return ends[0].expand(tiles).contiguous(), ends[1].expand(tiles).contiguous()
    pad = tiles * block_n - seq_k
    kpos = torch.nn.functional.pad(mask.k_pos, (0, pad), value=int(mask.k_pos[-1])).view(tiles, block_n)
    kmin, kmax = kpos[:, 0].contiguous(), kpos[:, -1].contiguous()
    # rows whose interval ends past the tile's first (some) or last (every) key, and starts at or before
    # its last (some) or first (every) key
    begin = torch.searchsorted(hi, kmax if every else kmin, right=True)
    end = torch.searchsorted(lo, kmin if every else kmax, right=True)
    end = torch.where(end > begin, end, begin)
    return begin.to(torch.int32), end.to(torch.int32)


def seen_keys(mask):
    """``(cols, sub)``: the slice of key rows some query of ``mask`` sees and the mask of those keys alone, or
    ``(None, mask)`` when that is every key (or none); once per mask. A packed ring block's rows see a few of
    the other rank's keys: its dK/dV grid then covers those tiles only (the others held no work, but loaded
    K/V and loaded and stored the float32 dK/dV accumulators)."""
    if "seen_keys" not in mask.memo:
        cols = mask.seen_columns()
        if cols is None or (cols.start, cols.stop) == (0, mask.k_pos.shape[0]):
            mask.memo["seen_keys"] = (None, mask)
        else:
            mask.memo["seen_keys"] = (cols, KeyMask(mask.q_lo, mask.q_hi, mask.k_pos[cols], True))
    return mask.memo["seen_keys"]
