"""A ``KeyMask`` as FlashAttention-4's variable-length arguments, when it is one: packed documents and windows
on ``backend="fa4"``.

    python -m pytest tests/test_fa4_varlen.py     # CPU: every mask the CP methods build; GPU: FA4 itself

FA4 takes packed documents as *sequences*: sequence s is the query rows ``[qa, qa + ql)`` against the key
rows ``[ka, ka + kl)`` (``cu_seqlens_q/k`` give the starts, ``seqused_q/k`` the lengths when the sequences
leave rows out), causal aligned bottom-right (local query i sees local keys ``j <= i + kl - ql``), a
window counting ``window_size_left`` keys back from that diagonal. distlab's ``KeyMask`` is more general
(per row, an interval of global key positions; keys of any ascending positions), so ``varlen_spec``
*compiles* a mask into sequences and then checks, row by row, that the sequences give every row exactly
the key rows the mask lets it see; a mask that is not exactly sequences gives None, and the caller runs it
on the masked Triton kernel. What compiles:

- causal: maximal runs of rows each seeing one more key than the row before (a document's rows against
  its own keys: one device, Ulysses, a ring's own shard, all-gather's queries against every key), with one
  window for all;
- full: runs of rows seeing the same keys (non-causal documents; a ring step whose rows see the whole of
  an earlier piece of their document).

FA4's backward writes dK/dV per sequence, it does not add, so two sequences must not share key rows. Where
they would (all-gather's rank holding two pieces of one document: both see the document's first keys), the
sequences get their own copies of their keys (``key_index``: the packed key rows' rows in the mask, at most
``MAX_KEY_COPIES`` times the mask's keys, and only for sequences of ``MIN_COPY_ROWS`` rows on average: a window
sliding across a ring block's keys would otherwise compile to a sequence a row); the wrapper gathers K/V by it
and adds the copies' dK/dV back. Sequences that need no copies are tried first.

Rows that see no key belong to no sequence: the caller writes them as every backend does (out 0, LSE −inf,
no gradient). The result is kept in ``mask.memo`` (one compile per mask; the ring reuses its step masks).
"""

from __future__ import annotations

import dataclasses

import torch

from distlab.kernels.masks import KeyMask


@dataclasses.dataclass(frozen=True)
class VarlenSpec:
    """FA4's varlen arguments for one mask (int32 tensors on the mask's device)."""

    cu_q: torch.Tensor            # (B+1,) query row starts; the last entry is seq_q
    cu_k: torch.Tensor            # (B+1,) key row starts; the last entry is seq_k
    used_q: torch.Tensor | None   # (B,) query rows per sequence, None when the sequences tile the rows
    used_k: torch.Tensor | None   # (B,) key rows per sequence, None when they tile the keys
    max_q: int
    max_k: int
    causal: bool
    window: int | None            # FA4's window_size_left (in key rows), None for none
    unseen: torch.Tensor | None   # query rows that see no key (no sequence holds them), or None
    keys_left_out: bool           # some key rows are in no sequence (their dK/dV stay 0)
    # When the sequences read their keys through an index (copies of shared keys, or keys in any order), int64:
    key_index: torch.Tensor | None = None   # (packed keys,) the K/V row each packed key row reads
    copy_order: torch.Tensor | None = None  # the packed rows in key-row order (a row's copies in packed order)
    copy_start: torch.Tensor | None = None  # (mask's keys + 1,) where each key row's copies start in copy_order

    def to(self, device) -> "VarlenSpec":
        move = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **move)


def varlen_spec(mask) -> VarlenSpec | None:
    """The mask as FA4 sequences (module doc), or None when it is not exactly that; once per mask. Keys in any
    order (``mask.k_sorted`` False: all-gather's keys as they arrive, rank after rank) are compiled in position
    order and read through ``key_index``, which then points at the keys where they lie."""
    if "fa4_varlen" not in mask.memo:
        if mask.k_sorted:
            spec = _compile(mask)
        else:
            order = torch.argsort(mask.k_pos.cpu(), stable=True)
            spec = _compile(KeyMask(mask.q_lo, mask.q_hi, mask.k_pos.cpu()[order], True))
            spec = _read_through(spec, order) if spec is not None else None
        if spec is not None and spec.key_index is not None:
            spec = _copies_by_row(spec, mask.k_pos.numel())
        mask.memo["fa4_varlen"] = spec.to(mask.q_lo.device) if spec is not None else None
    return mask.memo["fa4_varlen"]


def _read_through(spec: VarlenSpec, order: torch.Tensor) -> VarlenSpec:
    """``spec``, compiled over the keys in position order (row i is the mask's key row ``order[i]``), reading
    the keys where the mask has them."""
    if spec.key_index is None:   # each sequence reads its own key rows: as copies that share nothing
        cu, used = spec.cu_k.long(), spec.used_k
        ka = cu[:-1]
        kb = ka + (used.long() if used is not None else cu[1:] - cu[:-1])
        spec = _with_key_copies(spec, ka, kb)
    return dataclasses.replace(spec, key_index=order[spec.key_index])


def _copies_by_row(spec: VarlenSpec, n_k: int) -> VarlenSpec:
    """``spec`` with its copies listed per key row (CSR, int32: what the one-pass sum of their gradients reads)."""
    index = spec.key_index
    counts = torch.bincount(index, minlength=n_k)
    start = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    return dataclasses.replace(spec, copy_order=torch.argsort(index, stable=True).to(torch.int32),
                               copy_start=start.to(torch.int32))


MAX_KEY_COPIES = 2   # copied keys (all sequences' key rows together) at most this many times the mask's keys
MIN_COPY_ROWS = 16   # and the sequences that read copies at least this many query rows on average


def _compile(mask) -> VarlenSpec | None:
    k_pos = mask.k_pos.cpu()
    s = torch.searchsorted(k_pos, mask.q_lo.cpu())   # per row, its first and one past its last visible key row
    e = torch.searchsorted(k_pos, mask.q_hi.cpu())
    n = s.numel()
    sees = e > s
    if n == 0 or not bool(sees.any()):
        return None
    prev_sees = torch.cat([torch.tensor([False]), sees[:-1]])
    s_prev = torch.cat([s[:1], s[:-1]])
    e_prev = torch.cat([e[:1], e[:-1]])
    for copies, causal in ((False, True), (False, False), (True, True), (True, False)):
        if causal:   # one key more than the row before, sharing some of its keys
            goes_on = prev_sees & (e == e_prev + 1) & (s >= s_prev) & (s < e_prev)
        else:        # the same keys as the row before
            goes_on = prev_sees & (e == e_prev) & (s == s_prev)
        starts = (sees & ~goes_on).nonzero().squeeze(1)                 # (a row that goes on sees)
        ends = (sees & ~torch.cat([goes_on[1:], torch.tensor([False])])).nonzero().squeeze(1) + 1
        seq = torch.cumsum((sees & ~goes_on).long(), 0) - 1            # each seeing row's sequence
        ka, kb = s[starts], e[ends - 1]
        overlap = bool((ka[1:] < kb[:-1]).any())   # key rows of two sequences overlap: copies, or not this way
        if overlap != copies or (copies and (int((kb - ka).sum()) > MAX_KEY_COPIES * k_pos.numel()
                                             or int(sees.sum()) < MIN_COPY_ROWS * starts.numel())):
            continue
        window = None
        if causal:
            seq_ka = ka[seq.clamp_min(0)]
            inside = sees & (s > seq_ka)       # rows whose first key is cut by a window
            if bool(inside.any()):
                back = (e - 1 - s)[inside]
                window = int(back[0])
                if bool((back != window).any()):
                    continue
                if bool(((e - 1 - seq_ka)[sees & ~inside] > window).any()):
                    continue
        spec = _spec(starts, ends, ka, kb, causal, window, sees, n, k_pos.numel())
        if _exact(spec, s, e, sees):
            return _with_key_copies(spec, ka, kb) if copies else spec
    return None


def _with_key_copies(spec: VarlenSpec, ka, kb) -> VarlenSpec:
    """``spec`` with each sequence reading its own copy of its key rows ``[ka, kb)``, packed one after another."""
    lengths = kb - ka
    index = torch.repeat_interleave(ka - torch.cumsum(lengths, 0) + lengths, lengths) + torch.arange(int(lengths.sum()))
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]).to(torch.int32)
    return dataclasses.replace(spec, cu_k=cu_k, used_k=None, keys_left_out=False, key_index=index)


def _spec(starts, ends, ka, kb, causal, window, sees, n, n_k) -> VarlenSpec:
    qa, qb = starts, ends
    tiles_q = bool((qa[1:] == qb[:-1]).all()) and int(qa[0]) == 0 and int(qb[-1]) == n
    tiles_k = bool((ka[1:] == kb[:-1]).all()) and int(ka[0]) == 0 and int(kb[-1]) == n_k
    i32 = torch.int32
    unseen = (~sees).nonzero().squeeze(1)
    return VarlenSpec(cu_q=torch.cat([qa, torch.tensor([n])]).to(i32),
                      cu_k=torch.cat([ka, torch.tensor([n_k])]).to(i32),
                      used_q=None if tiles_q else (qb - qa).to(i32), used_k=None if tiles_k else (kb - ka).to(i32),
                      max_q=int((qb - qa).max()), max_k=int((kb - ka).max()), causal=causal, window=window,
                      unseen=unseen if unseen.numel() else None, keys_left_out=not tiles_k)


def spec_key_rows(spec: VarlenSpec, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the key rows ``[first, stop)`` FA4 lets it see under ``spec`` (its semantics as written in
    the module doc; an empty range for a row in no sequence): what ``_exact`` and the tests compare with the mask.
    For a spec of keys in position order (a mask's keys in any order are checked before ``_read_through``)."""
    cu_q, cu_k = spec.cu_q.cpu().long(), spec.cu_k.cpu().long()
    b = cu_q.numel() - 1
    ql = spec.used_q.cpu().long() if spec.used_q is not None else cu_q[1:] - cu_q[:-1]
    kl = spec.used_k.cpu().long() if spec.used_k is not None else cu_k[1:] - cu_k[:-1]
    seq = torch.repeat_interleave(torch.arange(b), ql)                  # each covered row's sequence
    local = torch.arange(seq.numel()) - torch.repeat_interleave(torch.cumsum(ql, 0) - ql, ql)
    row, ka, kls = cu_q[seq] + local, cu_k[seq], kl[seq]
    if spec.causal:
        right = local + kls - ql[seq]                                    # bottom-right diagonal, inclusive
        left = right - spec.window if spec.window is not None else torch.zeros_like(right)
        lo, hi = torch.minimum(left.clamp_min(0), kls), torch.minimum((right + 1).clamp_min(0), kls)
    else:
        lo, hi = torch.zeros_like(local), kls
    first, stop = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    first[row], stop[row] = ka + lo, ka + torch.maximum(lo, hi)
    if spec.key_index is not None:   # packed copies -> the key rows they are copies of (a sequence's are a run)
        index, seen = spec.key_index.cpu(), stop > first
        first[seen], stop[seen] = index[first[seen]], index[stop[seen] - 1] + 1
        first[~seen] = stop[~seen] = 0
    return first, stop


def _exact(spec: VarlenSpec, s, e, sees) -> bool:
    """Every row sees under ``spec`` exactly the key rows the mask gives it (rows that see nothing: none)."""
    first, stop = spec_key_rows(spec, s.numel())
    return bool(((first == s) & (stop == e))[sees].all()) and bool((stop == first)[~sees].all())
