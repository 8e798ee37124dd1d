"""Packed documents and windows on ``backend="fa4"``: the KeyMask → FA4 sequences compiler on every mask the
CP methods build (CPU), the wrapper's arguments against FA4's varlen semantics (CPU), and FA4 itself against
the float32 reference (GPU).

    python -m pytest tests/test_fa4_varlen.py
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from distlab import knobs
from distlab.cp.documents import Documents, parse_docs
from distlab.cp.layout import shard_positions
from distlab.cp.ring_packed import step_blocks
from distlab.kernels.attention import attention_reference
from distlab.kernels.fa4_varlen import spec_key_rows, varlen_spec

PACKS = {   # name: (total, --docs, causal, window)
    "lognormal": (1536, "lognormal:mean=256,seed=0", True, None),
    "window": (1536, "lognormal:mean=384,seed=1", True, 40),
    "one-token documents": (96, "1,3,1,7", True, None),
    "non-causal": (1536, "300,1,500", False, None),
    "one sequence": (1536, None, True, None),
}


def _docs(name):
    total, spec, causal, window = PACKS[name]
    return Documents.from_args(total, parse_docs(spec, total) if spec else None, causal, window)


def _masks(name, world=3):
    """Every mask the CP methods build on this pack: one device / Ulysses, each layout's ring blocks, and
    all-gather's local queries against every key."""
    docs = _docs(name)
    every = torch.arange(docs.total)
    yield "one device", docs.mask(every, every)
    for layout in ("contiguous", "zigzag", "balanced"):
        positions = [shard_positions(docs.total, world, r, layout, docs.cu_seqlens) for r in range(world)]
        for r in range(world):
            for step, blocks in enumerate(step_blocks(docs, positions, r, "cpu")):
                for a, b, m in blocks:
                    yield f"{layout} r{r} step {step} rows {a}:{b}", m
            yield f"{layout} r{r} all-gather", docs.mask(positions[r], every)


@pytest.mark.parametrize("name", list(PACKS))
def test_varlen_spec_gives_every_row_exactly_its_keys(name):
    """Where a mask compiles to FA4 sequences, FA4's rule (bottom-right causal, window from the diagonal) on
    those sequences is the mask, entry by entry; the masks that must compile do."""
    compiled = {}
    for what, mask in _masks(name):
        spec = varlen_spec(mask)
        compiled[what] = spec is not None
        if spec is None:
            continue
        first, stop = spec_key_rows(spec, mask.q_lo.numel())
        cols = torch.arange(mask.k_pos.numel())
        fa4_rule = (cols[None, :] >= first[:, None]) & (cols[None, :] < stop[:, None])
        assert torch.equal(fa4_rule, mask.dense()), what
        if spec.unseen is not None:
            assert not mask.dense()[spec.unseen].any(), what
    assert compiled["one device"]
    assert all(ok for what, ok in compiled.items() if "all-gather" in what and "contiguous" in what)
    if PACKS[name][3] is None:   # on these packs, without a window, every mask is sequences (causal or full),
        #                          all-gather's balanced queries with copies of their keys where a rank holds
        #                          two pieces of one document (the key rows they share)
        assert all(compiled.values()), [w for w, ok in compiled.items() if not ok]


def test_sequences_that_share_keys_read_copies_of_them():
    """All-gather's rank holding two pieces of one document: both pieces' sequences start at the document's
    first key, so each reads its own copy (``key_index``), and FA4's rule on the copies is the mask. The copies
    are capped (keys copied, rows a sequence)."""
    from distlab.kernels import fa4_varlen

    docs = Documents.from_args(256, torch.tensor([0, 160, 256]), True, None)
    rows = torch.cat([torch.arange(20, 60), torch.arange(120, 140), torch.arange(200, 216)])   # two pieces of doc 0
    mask = docs.mask(rows, torch.arange(256))
    spec = varlen_spec(mask)
    assert spec is not None and spec.causal and spec.cu_q.tolist() == [0, 40, 60, 76]
    assert spec.key_index.tolist() == list(range(60)) + list(range(140)) + list(range(160, 216))
    assert spec.cu_k.tolist() == [0, 60, 200, 256] and spec.used_k is None and not spec.keys_left_out
    # where the backward sums the copies' dK/dV (per key row, its copies' packed rows): rows 0 ... 59 read by both
    # sequences (packed rows r and 60 + r), 60 ... 139 and 160 ... 215 once, 140 ... 159 and 216 ... 255 never
    reads = [[r, 60 + r] for r in range(60)] + [[60 + r] for r in range(60, 140)] + [[]] * 20 + \
        [[200 + r - 160] for r in range(160, 216)] + [[]] * 40
    start = spec.copy_start.tolist()
    assert [spec.copy_order[a:b].tolist() for a, b in zip(start[:-1], start[1:])] == reads
    first, stop = spec_key_rows(spec, rows.numel())
    cols = torch.arange(256)
    assert torch.equal((cols[None, :] >= first[:, None]) & (cols[None, :] < stop[:, None]), mask.dense())
    for knob, value in (("MAX_KEY_COPIES", 0.5), ("MIN_COPY_ROWS", 26)):   # 256 keys copied; 25.3 rows a sequence
        saved = getattr(fa4_varlen, knob)
        setattr(fa4_varlen, knob, value)
        try:
            assert varlen_spec(docs.mask(rows, torch.arange(256))) is None, knob
        finally:
            setattr(fa4_varlen, knob, saved)


def test_varlen_spec_refuses_what_is_not_sequences():
    """A window cutting across a ring step's earlier keys (rows see a sliding part of the same keys) is neither
    causal sequences nor full ones: None, and the caller runs the masked Triton kernel."""
    docs = Documents.from_args(64, None, True, 8)
    mask = docs.mask(torch.arange(32, 64), torch.arange(0, 32))
    assert mask.visible_pairs() > 0 and varlen_spec(mask) is None
    spec = varlen_spec(docs.mask(torch.arange(64), torch.arange(64)))
    assert spec.causal and spec.window == 8 and spec.cu_q.tolist() == [0, 64]


class _FA4VarlenSemantics:
    """FA4's ``_flash_attn_fwd``/``_flash_attn_bwd`` varlen rule written out in float64 (its interface and
    ``block_info``: sequence s is rows ``cu_seqlens[s]`` + ``seqused[s]``; causal bottom-right; the window
    counted back from that diagonal), with NaN wherever FA4 leaves memory as allocated, a float32 LSE, and a
    backward that reads the LSE and out it is given (a ring block's are the whole row's). It checks the
    arguments distlab passes and what it does with the results, not FA4: the GPU tests below do that."""

    def __init__(self):
        self.calls = []
        self.key_rows = []   # K rows each forward call read
        self.key_ptrs = {"fwd": [], "bwd": []}   # the memory each call read its K from

    @staticmethod
    def _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        for s in range(cu_seqlens_q.numel() - 1):
            qa, ka = int(cu_seqlens_q[s]), int(cu_seqlens_k[s])
            ql = int(seqused_q[s]) if seqused_q is not None else int(cu_seqlens_q[s + 1]) - qa
            kl = int(seqused_k[s]) if seqused_k is not None else int(cu_seqlens_k[s + 1]) - ka
            yield slice(qa, qa + ql), slice(ka, ka + kl)

    @staticmethod
    def _scores(q, k, scale, causal, window_size_left, window_size_right):
        """(heads, ql, kl) scores with what the sequence's rule removes at −inf; GQA's kv heads repeated."""
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        ql, kl = q.shape[0], k.shape[0]
        diag = torch.arange(ql)[:, None] + kl - ql
        j = torch.arange(kl)[None, :]
        keep = torch.ones(ql, kl, dtype=torch.bool)
        if causal or window_size_right is not None:
            keep &= j <= diag + (window_size_right or 0)
        if window_size_left is not None:
            keep &= j >= diag - window_size_left
        return scores.masked_fill(~keep, float("-inf"))

    def _flash_attn_fwd(self, q, k, v, softmax_scale, return_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                        max_seqlen_q, max_seqlen_k, causal, window_size_left, window_size_right=None, out=None,
                        lse=None):
        self.calls.append(("fwd", seqused_q is not None, seqused_k is not None))
        self.key_rows.append(k.shape[0])
        self.key_ptrs["fwd"].append(k.data_ptr())
        assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32 and return_lse
        if out is not None:   # what FA4 does not write stays as it was: here NaN, as if never initialised
            assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
        if lse is not None:
            assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        out = (out if out is not None else torch.empty_like(q)).fill_(float("nan"))
        lse = (lse if lse is not None else torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)).fill_(float("nan"))
        for qs, ks in self._sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
            assert qs.stop - qs.start <= max_seqlen_q and ks.stop - ks.start <= max_seqlen_k
            scores = self._scores(q[qs], k[ks], softmax_scale, causal, window_size_left, window_size_right)
            vr = v[ks].repeat_interleave(q.shape[1] // v.shape[1], 1)
            lse[:, qs] = scores.logsumexp(-1).float()
            out[qs] = torch.einsum("hqk,khd->qhd", (scores - scores.logsumexp(-1)[..., None]).exp(), vr)
        return out, lse, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, causal, window_size_left,
                        window_size_right=None):
        self.calls.append(("bwd", seqused_q is not None, seqused_k is not None))
        self.key_ptrs["bwd"].append(k.data_ptr())
        assert lse.shape == (q.shape[1], q.shape[0])
        dq, dk, dv = (t if t is not None else torch.full_like(like, float("nan")) for t, like in ((dq, q), (dk, k), (dv, v)))
        groups = q.shape[1] // k.shape[1]
        for qs, ks in self._sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
            # FA's backward with the LSE and out it is given (a ring step's: the whole row's, not this block's)
            scores = self._scores(q[qs], k[ks], softmax_scale, causal, window_size_left, window_size_right)
            p = (scores - lse[:, qs].to(q.dtype)[..., None]).exp()                      # (h, ql, kl)
            kr, vr = (t[ks].repeat_interleave(groups, 1) for t in (k, v))
            dp = torch.einsum("qhd,khd->hqk", dout[qs], vr)
            delta = (dout[qs] * out[qs]).sum(-1).transpose(0, 1)[..., None]            # (h, ql, 1)
            ds = p * (dp - delta) * softmax_scale
            dq[qs] = torch.einsum("hqk,khd->qhd", ds, kr)       # written, not added: FA4 writes per sequence
            dk[ks] = torch.einsum("hqk,qhd->khd", ds, q[qs]).unflatten(1, (-1, groups)).sum(2)
            dv[ks] = torch.einsum("hqk,qhd->khd", p, dout[qs]).unflatten(1, (-1, groups)).sum(2)
        return dq, dk, dv


@pytest.mark.parametrize("what", ["one device", "window", "ring block", "all-gather", "all-gather balanced"])
def test_fa4_masked_wrapper_passes_the_sequences(monkeypatch, what):
    """``fa4_masked_forward``/``_backward`` against whole-matrix masked attention in float64, with FA4's varlen
    rule standing in for FA4 (CPU): batch views, LSE (heads, rows), rows and keys in no sequence (out 0, LSE
    −inf, zero gradients), GQA."""
    from distlab.kernels import fa4

    fake = _FA4VarlenSemantics()
    monkeypatch.setattr(fa4, "_interface", lambda: fake)
    docs = _docs("window" if what == "window" else "lognormal")
    every = torch.arange(docs.total)
    pos = [shard_positions(docs.total, 4, r, "zigzag", docs.cu_seqlens) for r in range(4)]
    q_pos, k_pos = {"one device": (every, every), "window": (every, every), "ring block": (pos[1], pos[0]),
                    "all-gather": (pos[2], every), "all-gather balanced": (None, every)}[what]
    if what == "all-gather balanced":
        q_pos = _balanced_rank_with_shared_keys(docs)
    mask = docs.mask(q_pos, k_pos)
    spec = varlen_spec(mask)
    assert spec is not None
    if what == "ring block":
        assert spec.unseen is not None and spec.keys_left_out   # the case this test is for
    assert (spec.key_index is not None) == (what == "all-gather balanced")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, q_pos.numel(), 4, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, k_pos.numel(), 2, 16, dtype=torch.float64, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(16)
    out, lse = fa4.fa4_masked_forward(q, k, v, spec, scale)
    dq, dk, dv = fa4.fa4_masked_backward(dout, q, k, v, out, lse, spec, scale)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = attention_reference(*full, mask=mask)
    want.backward(dout)
    assert out.shape == q.shape and lse.shape == (1, 4, q.shape[1])
    torch.testing.assert_close(out, want.detach(), rtol=1e-9, atol=1e-9)   # (the gradients read FA4's float32 LSE)
    seen = mask.dense().any(1)
    assert torch.isneginf(lse[0, :, ~seen]).all() and torch.isfinite(lse[0, :, seen]).all()
    for got, ref in zip((dq, dk, dv), full):
        torch.testing.assert_close(got, ref.grad, rtol=1e-6, atol=1e-6)
    assert [c[0] for c in fake.calls] == ["fwd", "bwd"]


def test_fa4_masked_backward_refuses_key_copies_of_another_mask(monkeypatch):
    """``kept`` from a forward under another mask (copies of other keys): a clear ValueError, not wrong gradients."""
    from distlab.kernels import fa4

    monkeypatch.setattr(fa4, "_interface", lambda: _FA4VarlenSemantics())
    docs = _docs("lognormal")
    spec = varlen_spec(docs.mask(_balanced_rank_with_shared_keys(docs), torch.arange(docs.total)))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, spec.cu_q[-1].item(), 4, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, docs.total, 2, 16, dtype=torch.float64, generator=g) for _ in range(2))
    keep = {}
    out, lse = fa4.fa4_masked_forward(q, k, v, spec, 0.25, keep=keep)
    assert keep["fa4_keys_read"][0].shape[0] == spec.key_index.numel()
    wrong = {"fa4_keys_read": tuple(t[1:] for t in keep["fa4_keys_read"])}
    with pytest.raises(ValueError, match="were not read under this mask"):
        fa4.fa4_masked_backward(torch.randn_like(q), q, k, v, out, lse, spec, 0.25, kept=wrong)


def _balanced_rank_with_shared_keys(docs, world=4):
    """The positions of a rank of the balanced layout whose all-gather mask needs key copies."""
    every = torch.arange(docs.total)
    for r in range(world):
        rows = shard_positions(docs.total, world, r, "balanced", docs.cu_seqlens)
        spec = varlen_spec(docs.mask(rows, every))
        if spec is not None and spec.key_index is not None:
            return rows
    raise AssertionError("no balanced rank holds two pieces of one document on this pack")


def _pack_and_one_device(total, cu, causal, window, heads, dim, seed):
    """Float64 q, k, v, dout of one pack (batch 1; ``heads``: q and kv heads) and one device's masked attention
    on it: ``[out, dq, dk, dv]``."""
    from distlab.kernels.masks import document_mask

    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, total, heads[0], dim, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, total, heads[1], dim, generator=g, dtype=torch.float64) for _ in range(2))
    every = torch.arange(total)
    full = [x.clone().requires_grad_(True) for x in (q, k, v)]
    want = attention_reference(*full, mask=document_mask(every, every, cu, causal, window, total))
    want.backward(dout)
    return q, k, v, dout, [want.detach()] + [x.grad for x in full]


def methods_on_fa4_semantics(cu, causal, window):
    """Runs on every rank: ring (three layouts), all-gather and Ulysses with ``backend="fa4"`` on packed float64
    shards — FA4's varlen rule standing in for FA4, and the reference backend for the blocks that are not
    FA4 sequences — against whole-matrix masked attention on one device. Returns (errors, FA4 calls)."""
    from distlab.cp import allgather_attention, gather_sequence, ring_attention, shard_sequence, ulysses_attention
    from distlab.testing import fa4_pretended

    fake = _FA4VarlenSemantics()
    with fa4_pretended(fake):
        cu = torch.tensor(cu)
        q, k, v, dout, want = _pack_and_one_device(96, cu, causal, window, heads=(6, 3), dim=8, seed=0)
        runs = [(f"ring-{lay}", lay, ring_attention) for lay in ("contiguous", "zigzag", "balanced")]
        runs += [("allgather-zigzag", "zigzag", allgather_attention), ("ulysses-zigzag", "zigzag", ulysses_attention),
                 ("allgather-balanced", "balanced", allgather_attention),   # three kv-head groups: FA4 writes
                 ("allgather3-zigzag", "zigzag", functools.partial(allgather_attention, chunks=3))]   # into views
        errors = {}
        for name, layout, method in runs:
            local = [shard_sequence(x, None, layout, cu_seqlens=cu).requires_grad_(True) for x in (q, k, v)]
            out = method(*local, None, causal=causal, layout=layout, backend="fa4", cu_seqlens=cu, window=window)
            out.backward(shard_sequence(dout, None, layout, cu_seqlens=cu))
            got = [gather_sequence(x, None, layout, cu_seqlens=cu) for x in (out.detach(), *(t.grad for t in local))]
            errors[name] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))
        return errors, len(fake.calls)


@pytest.mark.parametrize("cu,causal,window", [([0, 5, 40, 41, 96], True, None), ([0, 30, 96], True, 12),
                                              ([0, 17, 50, 96], False, None)])
def test_cp_methods_on_fa4_blocks_match_one_device(pools, cu, causal, window):
    """The CP methods' use of ``fa4`` with documents and windows at W=3 (the ring's per-block merge and gradient
    sums over FA4 sequences, all-gather's and Ulysses' whole masks), FA4's varlen rule standing in for FA4:
    parity with one device in float64 (to FA4's float32 LSE), and FA4 called for some of the blocks."""
    for rank, (errors, calls) in enumerate(pools(3).run(methods_on_fa4_semantics, cu, causal, window)):
        bad = {name: f"{e:.1e}" for name, e in errors.items() if not e < 1e-6}   # FA4's LSE is float32
        assert not bad and calls > 0, f"rank {rank}: {bad}, {calls} FA4 calls"


def allgather_balanced_on_fa4_key_copies():
    """Runs on every rank (W=3): all-gather CP in the balanced layout on ``backend="fa4"`` (FA4's varlen rule
    standing in, float64), where every rank holds two pieces of one document, so its sequences read copies of
    the shared keys; against one device. Returns (max error, K rows each FA4 forward read)."""
    from distlab.cp import allgather_attention, gather_sequence, shard_sequence
    from distlab.testing import fa4_pretended

    fake = _FA4VarlenSemantics()
    cu = torch.tensor([0, 250, 300, 384])
    with fa4_pretended(fake):
        q, k, v, dout, want = _pack_and_one_device(384, cu, True, None, heads=(4, 2), dim=16, seed=1)
        local = [shard_sequence(x, None, "balanced", cu_seqlens=cu).requires_grad_(True) for x in (q, k, v)]
        out = allgather_attention(*local, None, causal=True, layout="balanced", backend="fa4", cu_seqlens=cu)
        out.backward(shard_sequence(dout, None, "balanced", cu_seqlens=cu))
        got = [gather_sequence(x, None, "balanced", cu_seqlens=cu) for x in (out.detach(), *(t.grad for t in local))]
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))
    return err, fake.key_rows, fake.key_ptrs


def test_allgather_ranks_that_share_keys_match_one_device_on_fa4(pools):
    """The key copies (``fa4_varlen.key_index``) through all-gather CP on gloo: outputs and dQ/dK/dV (the
    copies' dK/dV summed back, then reduce-scattered) equal one device; every rank's FA4 calls read copies
    (not the 384 gathered keys), and the backward reads the forward's copies (``keep=``), not new ones."""
    for rank, (err, key_rows, ptrs) in enumerate(pools(3).run(allgather_balanced_on_fa4_key_copies)):
        assert err < 1e-6, (rank, err)                      # FA4's LSE is float32
        assert key_rows and all(n != 384 for n in key_rows), (rank, key_rows)
        assert len(ptrs["bwd"]) == len(ptrs["fwd"]) and ptrs["bwd"] == ptrs["fwd"], (rank, ptrs)


# ------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("what", ["one device", "window", "non-causal", "ring block", "all-gather",
                                  "all-gather balanced", "all-gather as gathered", "head group"])
def test_fa4_masked_matches_the_float32_reference(what):
    """FA4's varlen path through ``attention_forward``/``_backward(backend="fa4", mask=...)`` against whole-matrix
    float32 masked attention: documents, a window, non-causal documents, a ring block (rows and keys in no
    sequence), all-gather's queries (zigzag; balanced: sequences reading copies of shared keys; as gathered:
    the keys in rank order, read through an index), and the balanced rank's tensors as strided views of a
    wider head set (all-gather CP's kv-head groups); GQA, head_dim 128, bf16."""
    from distlab.kernels import fa4
    from distlab.kernels.attention import attention_backward, attention_forward

    if not fa4.runs_on("cuda", torch.bfloat16):
        pytest.skip(f"fa4 cannot run here: {fa4.why_not('cuda', torch.bfloat16)}")
    total = 4096
    causal, window = what != "non-causal", 300 if what == "window" else None
    docs = Documents.from_args(total, parse_docs("lognormal:mean=768,seed=2", total), causal, window)
    every = torch.arange(total)
    pos = [shard_positions(total, 4, r, "zigzag", docs.cu_seqlens) for r in range(4)]
    q_pos, k_pos = {"ring block": (pos[1], pos[0]), "all-gather": (pos[2], every),
                    "all-gather as gathered": (pos[2], torch.cat(pos))}.get(what, (every, every))
    if what in ("all-gather balanced", "head group"):
        q_pos = _balanced_rank_with_shared_keys(docs)
    mask = docs.mask(q_pos, k_pos, "cuda")
    assert varlen_spec(mask) is not None
    assert (varlen_spec(mask).key_index is not None) == (what in ("all-gather balanced", "all-gather as gathered",
                                                                  "head group"))
    g = torch.Generator(device="cuda").manual_seed(0)
    wide = 2 if what == "head group" else 1   # the tensors: the second half of twice the heads
    q = torch.randn(1, q_pos.numel(), 8 * wide, 128, device="cuda", dtype=torch.bfloat16, generator=g)[:, :, -8:]
    k, v = (torch.randn(1, k_pos.numel(), 2 * wide, 128, device="cuda", dtype=torch.bfloat16, generator=g)[:, :, -2:]
            for _ in range(2))
    dout = torch.randn_like(q)
    full = [t.float().requires_grad_(True) for t in (q, k, v)]
    want = attention_reference(*full, mask=mask)
    want.backward(dout.float())
    _, want_lse = attention_forward(*(t.detach() for t in full), backend="torch", mask=mask)
    keep = {}
    out, lse = attention_forward(q, k, v, backend="fa4", mask=mask, keep=keep)
    assert ("fa4_keys_read" in keep) == (varlen_spec(mask).key_index is not None)
    if wide > 1:   # out, dO and the LSE as all-gather's backward hands them over: views of the whole heads' tensors
        assert not q.is_contiguous()
        out = torch.cat([torch.zeros_like(out), out], 2)[:, :, -8:]
        dout = torch.cat([torch.zeros_like(dout), dout], 2)[:, :, -8:]
        lse = torch.cat([torch.zeros_like(lse), lse], 1)[:, -8:]
    grads = attention_backward(dout, q, k, v, out, lse, backend="fa4", mask=mask)
    rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    seen = mask.dense().any(1)
    assert rel(out, want.detach()) < 2e-2
    assert (lse[:, :, seen] - want_lse[:, :, seen]).abs().max() < 2e-2 and torch.isneginf(lse[:, :, ~seen]).all()
    for got, ref in zip(grads, (t.grad for t in full)):
        assert got.shape == ref.shape and rel(got, ref) < 3e-2
    if keep:   # the backward on the forward's copies of the keys (all-gather CP's way) against its own gathers
        for got, again in zip(attention_backward(dout, q, k, v, out, lse, backend="fa4", mask=mask, kept=keep), grads):
            assert rel(got, again.float()) < 1e-2
    if wide > 1:   # and with contiguous copies (knob FA4_MASKED_CONTIGUOUS=1; the default hands FA4 the views)
        with knobs.override(FA4_MASKED_CONTIGUOUS="1"):
            views = attention_backward(dout, q, k, v, out, lse, backend="fa4", mask=mask)
        for got, ref in zip(views, (t.grad for t in full)):
            assert got.shape == ref.shape and rel(got, ref) < 3e-2
    if varlen_spec(mask).key_index is not None:   # the copies' dK/dV summed by torch (knob FA4_COPIES_KERNEL=0)
        # against one Triton pass (the default), here into views of wider NaN-filled tensors
        into = tuple(torch.full((1, t.shape[1], 2 * t.shape[2], 128), float("nan"), device="cuda",
                                dtype=torch.bfloat16)[:, :, -t.shape[2]:] for t in (q, k, v))
        with knobs.override(FA4_COPIES_KERNEL="1"):
            one_pass = attention_backward(dout, q, k, v, out, lse, backend="fa4", mask=mask, into=into)
        with knobs.override(FA4_COPIES_KERNEL="0"):
            torch_path = attention_backward(dout, q, k, v, out, lse, backend="fa4", mask=mask)
        for got, by_torch, ref in zip(one_pass, torch_path, (t.grad for t in full)):
            assert rel(got, ref) < 3e-2 and rel(got, by_torch.float()) < 1e-2, (rel(got, ref), rel(got, by_torch.float()))
