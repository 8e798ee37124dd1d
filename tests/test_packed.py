"""Packed documents and sliding windows under every CP method and layout, against one device, on gloo.

The reference is whole-matrix float64 attention through autograd with the documents' mask
(``attention_reference(mask=...)``), a different code path from the blockwise masked kernel. In float64
the methods agree with it to ~1e-15; the bar of 1e-10 catches a key seen across a document boundary, a
window off by one, a block skipped that had a visible pair, or a dK/dV lost on the way home (each moves
some row by O(1/doc length)). In float32 the bar is 1e-5.
"""

import pytest
import torch

from distlab import comm
from distlab.cp import allgather_attention, gather_sequence, ring_attention, shard_sequence, ulysses_attention
from distlab.cp import usp_attention
from distlab.cp.documents import Documents, parse_docs
from distlab.cp.layout import balanced_units, shard_positions, units_per_rank, units_positions
from distlab.kernels.masks import document_mask

T = 96   # divisible by 2W for W in 1, 2, 3, 4, 8 (zigzag, balanced) and by U x R for the USP splits

CASES = {   # name: (cu_seqlens, causal, window)
    "one_doc": ([0, T], True, None),
    "one_token_docs": ([0, 1, 40, 41, 42, T], True, None),
    "spanning": ([0, 5, 90, T], True, None),
    "tiny_docs": ([0] + list(range(3, T, 3)) + [T], True, None),
    "zero_length_doc": ([0, 30, 30, T], True, None),
    "window_in_doc": ([0, 60, T], True, 7),
    "window_over_shards": ([0, 70, T], True, 40),
    "full_in_docs": ([0, 17, 50, T], False, None),
}


def _inputs(heads, kv_heads, seed=0, batch=2, head_dim=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, T, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, T, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, T, kv_heads, head_dim, generator=g, dtype=torch.float64)
    return q, k, v, torch.randn(batch, T, heads, head_dim, generator=g, dtype=torch.float64)


def definition_mask(cu, causal, window) -> torch.Tensor:
    """(T, T) bool, written from the definition alone (not from distlab's masks): i sees j iff one
    document holds both, j <= i when causal, i - j <= window when given."""
    doc = torch.zeros(T, dtype=torch.long)
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        doc[a:b] = d
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    seen = doc[:, None] == doc[None, :]
    if causal:
        seen &= j <= i
    if window is not None:
        seen &= i - j <= window
    return seen


def reference(q, k, v, dout, cu, causal, window):
    """Whole-matrix float64 attention through autograd with the definition's mask (empty rows give 0)."""
    seen = definition_mask(cu, causal, window)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    g = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(g, dim=2).transpose(1, 2) for t in full[1:])
    scores = (full[0].transpose(1, 2) @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~seen, float("-inf"))
    probs = torch.where(seen.any(-1, keepdim=True), scores.softmax(-1), torch.zeros_like(scores))
    out = (probs @ vh).transpose(1, 2)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in full]


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def methods(world, heads):
    """(name, attention fn(q, k, v, **docs), shard, gather) for every method and layout at this world size."""
    from distlab.runtime import Layout

    out = []
    for layout in ("contiguous", "zigzag", "balanced"):
        def sh(x, cu, layout=layout):
            return shard_sequence(x, None, layout, cu_seqlens=cu)

        def ga(x, cu, layout=layout):
            return gather_sequence(x, None, layout, cu_seqlens=cu)

        out.append((f"ring-{layout}", lambda q, k, v, layout=layout, **kw: ring_attention(q, k, v, None, layout=layout, **kw), sh, ga))
        out.append((f"allgather-{layout}", lambda q, k, v, layout=layout, **kw: allgather_attention(q, k, v, None, layout=layout, **kw), sh, ga))
        if layout == "zigzag":   # one kv-head group (the default is two): no head slices, no copies
            out.append(("allgather1-zigzag", lambda q, k, v, **kw: allgather_attention(q, k, v, None, layout="zigzag",
                                                                                        chunks=1, **kw), sh, ga))
        if heads % world == 0:
            out.append((f"ulysses-{layout}", lambda q, k, v, layout=layout, **kw: ulysses_attention(q, k, v, None, layout=layout, **kw), sh, ga))
    splits = {4: [(2, 2)], 8: [(2, 4), (4, 2)]}.get(world, [])
    for u, r in splits:
        mesh = Layout(world, cp=world, ulysses=u, ring=r).build_mesh("cpu")
        ug, rg = mesh.get_group("ulysses"), mesh.get_group("ring")
        for layout in ("zigzag", "balanced"):
            def sh(x, cu, layout=layout, ug=ug, rg=rg):
                return shard_sequence(x, rg, layout, ulysses_group=ug, cu_seqlens=cu)

            def ga(x, cu, layout=layout, ug=ug, rg=rg):
                return gather_sequence(x, rg, layout, ulysses_group=ug, cu_seqlens=cu)

            out.append((f"usp{u}x{r}-{layout}", lambda q, k, v, layout=layout, ug=ug, rg=rg, **kw:
                        usp_attention(q, k, v, ug, rg, layout=layout, **kw), sh, ga))
    return out


def every_method_vs_one_device(case, dtype=torch.float64, heads=8, kv_heads=2):
    """Runs on every rank: each method on shards vs the float64 masked reference on the full tensors."""
    cu, causal, window = CASES[case]
    q, k, v, dout = _inputs(heads, kv_heads)
    want = reference(q, k, v, dout, cu, causal, window)
    cu_t = torch.tensor(cu)
    errors, world = {}, comm.group_size()
    for name, fn, sh, ga in methods(world, heads):
        local = [sh(t.to(dtype), cu_t).requires_grad_(True) for t in (q, k, v)]
        out = fn(*local, causal=causal, cu_seqlens=cu_t, window=window)
        out.backward(sh(dout.to(dtype), cu_t))
        got = [ga(t, cu_t) for t in (out.detach(), *(x.grad for x in local))]
        errors[name] = max(rel_err(a, b) for a, b in zip(got, want))
    return errors


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_every_method_and_layout_matches_one_device_float64(pools, world, case):
    for rank, errors in enumerate(pools(world).run(every_method_vs_one_device, case)):
        bad = {name: f"{e:.1e}" for name, e in errors.items() if not e < 1e-10}
        assert not bad, f"W={world} {case} rank {rank}: {bad}"
        assert any(n.startswith("ulysses") for n in errors) == (8 % world == 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_float32_documents_and_window(pools, world):
    for errors in pools(world).run(every_method_vs_one_device, "window_in_doc", torch.float32):
        assert all(e < 1e-5 for e in errors.values()), errors


def one_document_equals_the_plain_path(layout):
    q, k, v, _ = _inputs(4, 2)
    local = [shard_sequence(t, None, layout) for t in (q, k, v)]
    plain = ring_attention(*local, causal=True, layout=layout)
    packed = ring_attention(*local, causal=True, layout=layout, cu_seqlens=torch.tensor([0, T]))
    return rel_err(packed, plain)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_one_document_is_the_plain_causal_ring(pools, layout):
    assert all(e < 1e-13 for e in pools(4).run(one_document_equals_the_plain_path, layout))


def grouped_ring_vs_one_device(groups):
    """Runs on every rank: the packed ring with its forward's steps in launch groups (``steps_per_launch``:
    each group's seen keys gathered in position order, ``distlab.cp.packed_groups``), every case and layout,
    float64, against the masked reference. Returns {name: error} and how many groups held keys to gather."""
    from distlab.cp.ring_packed import step_blocks

    q, k, v, dout = _inputs(8, 2)
    world, rank = comm.group_size(), comm.group_rank()
    errors, gathered = {}, 0
    for case, (cu, causal, window) in CASES.items():
        want = reference(q, k, v, dout, cu, causal, window)
        cu_t = torch.tensor(cu)
        docs = Documents.from_args(T, cu_t, causal, window)
        for layout in ("contiguous", "zigzag", "balanced"):
            pos = [shard_positions(T, world, r, layout, docs.cu_seqlens) for r in range(world)]
            for n in groups:
                plan = step_blocks(docs, pos, rank, "cpu", steps_per_launch=n).launches
                gathered += sum(g is not None and len(blocks) > 0 for _, g, blocks in plan or [])
                local = [shard_sequence(t, None, layout, cu_seqlens=cu_t).requires_grad_(True) for t in (q, k, v)]
                out = ring_attention(*local, None, causal, layout, cu_seqlens=cu_t, window=window, steps_per_launch=n)
                out.backward(shard_sequence(dout, None, layout, cu_seqlens=cu_t))
                got = [gather_sequence(t, None, layout, cu_seqlens=cu_t) for t in (out.detach(), *(x.grad for x in local))]
                errors[f"{case}-{layout}-{n}"] = max(rel_err(a, b) for a, b in zip(got, want))
    return errors, gathered


@pytest.mark.parametrize("world, groups", [(2, [(2,)]), (3, [2, (3,)]), (4, [3, (1, 2, 1)]), (8, [4])])
def test_ring_forward_in_launch_groups_matches_one_device_float64(pools, world, groups):
    """The packed ring's forward by launch groups (0 | 1 2 3 | ... : a group's keys gathered and run as one set
    of blocks, any backend) gives one device's outputs and gradients in float64, every case and layout."""
    for rank, (errors, gathered) in enumerate(pools(world).run(grouped_ring_vs_one_device, groups)):
        bad = {name: f"{e:.1e}" for name, e in errors.items() if not e < 1e-10}
        assert not bad, f"W={world} rank {rank}: {bad}"
        assert gathered > 0, (world, rank)   # some group did gather keys of several steps


def test_seen_key_rows_is_the_union_of_the_rows_intervals():
    from distlab.cp.packed_groups import seen_key_rows

    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        keys = torch.randperm(200, generator=g)[:60].sort().values
        lo = torch.randint(0, 200, (30,), generator=g)
        hi = lo + torch.randint(-5, 40, (30,), generator=g)
        from distlab.kernels.masks import KeyMask

        seen = ((keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])).any(0).nonzero().squeeze(1)
        assert torch.equal(seen_key_rows(KeyMask(lo, hi, keys)), seen)


# ------------------------------------------------------------------------------------------- what is skipped

def blocks_launched(layout, cu):
    """The ring steps whose block has a visible pair (the others launch nothing)."""
    from distlab.cp.ring_packed import step_blocks

    world, rank = comm.group_size(), comm.group_rank()
    docs = Documents.from_args(T, torch.tensor(cu), True, None)
    positions = [shard_positions(T, world, r, layout, docs.cu_seqlens) for r in range(world)]
    return [bool(blocks) for blocks in step_blocks(docs, positions, rank, "cpu")]


def test_a_ring_step_with_no_visible_pair_launches_nothing(pools):
    """Four documents, one per contiguous shard: each rank sees only its own keys, every other step is empty."""
    for rank, launched in enumerate(pools(4).run(blocks_launched, "contiguous", [0, 24, 48, 72, T])):
        assert launched == [True, False, False, False], (rank, launched)


def test_the_masked_kernel_skips_keys_outside_every_rows_interval():
    """Work follows the visible pairs: with documents, the blockwise kernel reads only the keys some row of
    the block sees (counted through a KeyMask's key_columns)."""
    pos = torch.arange(T)
    m = document_mask(pos, pos, torch.tensor([0, 32, 64, T]), True, None, T)
    assert m.rows(40, 50).key_columns() == slice(32, 50)
    assert m.rows(70, 80).key_columns() == slice(64, 80)
    w = document_mask(pos, pos, None, True, 5, T)
    assert w.rows(60, 70).key_columns() == slice(55, 70)
    assert w.visible_pairs() == sum(min(i, 5) + 1 for i in range(T))


# --------------------------------------------------------------------------------------------- the layout

def test_balanced_layout_is_within_5_percent_on_lognormal_documents():
    """Each rank's causal visible pairs within 5% of the mean, for realistic mixes at W = 2..8."""
    for world in (2, 4, 8):
        for seed in range(5):
            total = 32768
            cu = parse_docs(f"lognormal:mean=2048,seed={seed}", total)
            docs = Documents.from_args(total, cu, True, None)
            work = [docs.work(shard_positions(total, world, r, "balanced", cu)) for r in range(world)]
            mean = sum(work) / world
            assert max(work) / mean < 1.05, (world, seed, [w / mean for w in work])


def test_balanced_layout_holds_every_token_once():
    cu = parse_docs("3000,1200,800,17", 6144)
    for world in (3, 4, 8):
        units = balanced_units(6144, world, cu)
        assert sorted(u for r in units for u in r) == list(range(world * units_per_rank(6144, world, cu)))
        pos = torch.cat([shard_positions(6144, world, r, "balanced", cu) for r in range(world)])
        assert torch.equal(pos.sort().values, torch.arange(6144))
        units = torch.cat(units_positions(6144, world, cu))   # the units deal, the fallback
        assert torch.equal(units.sort().values, torch.arange(6144))


def test_documents_first_fills_every_rank_exactly():
    """``documents_first`` at every threshold ``balanced`` tries, on random packs (arbitrary lengths, W up to
    8, non-powers of two): every token once, T/W on each rank, positions ascending."""
    import random

    from distlab.cp.layout import HEAVY_STEPS, documents_first

    rng = random.Random(0)
    for _ in range(300):
        world = rng.choice([2, 3, 4, 5, 6, 8])
        total = 2 * world * rng.randint(1, 40)
        cu = [0] + sorted(rng.sample(range(1, total), min(rng.randint(1, 12), total - 1))) + [total]
        for heavy in HEAVY_STEPS:
            pos = documents_first(total, world, cu, heavy)
            assert all(p.numel() == total // world and bool((p[1:] > p[:-1]).all()) for p in pos), (cu, world, heavy)
            assert torch.equal(torch.cat(pos).sort().values, torch.arange(total)), (cu, world, heavy)


def test_balanced_layout_keeps_short_documents_whole():
    """Documents that fit are not cut: every pair of a pack of 12 equal documents stays on one rank, and
    without documents the layout is zigzag."""
    cu = torch.arange(0, T + 1, 8)
    docs = Documents.from_args(T, cu, True)
    for world in (2, 3, 4):
        pos = [shard_positions(T, world, r, "balanced", cu) for r in range(world)]
        assert [docs.work(p, p) for p in pos] == [docs.work(p) for p in pos] == [12 * 36 // world] * world
    for world in (3, 4):
        assert all(torch.equal(shard_positions(T, world, r, "balanced"), shard_positions(T, world, r, "zigzag"))
                   for r in range(world))


def test_parse_docs():
    assert parse_docs("3000,1200,800", 5000).tolist() == [0, 3000, 4200, 5000]
    assert parse_docs("10,20", 45).tolist() == [0, 10, 30, 40, 45]
    cu = parse_docs("lognormal:mean=100,seed=3", 4096)
    assert cu[0] == 0 and cu[-1] == 4096 and bool((cu[1:] > cu[:-1]).all())
    for bad in ("x", "lognormal:mean=0", "gamma:k=2", "10,-1", "lognormal:mean=10,bogus=1"):
        with pytest.raises(ValueError):
            parse_docs(bad, 100)


# ------------------------------------------------------------------------------------------- bad input

def bad_call(what):
    """Runs on every rank; what each rank raised (the same ValueError everywhere, before any K/V moved)."""
    q, k, v, _ = _inputs(4, 2)
    local = [shard_sequence(t, None, "zigzag") for t in (q, k, v)]
    rank = comm.group_rank()
    kwargs = {
        "not_zero": dict(cu_seqlens=torch.tensor([1, T]), causal=True),
        "not_total": dict(cu_seqlens=torch.tensor([0, T - 1]), causal=True),
        "decreasing": dict(cu_seqlens=torch.tensor([0, 50, 40, T]), causal=True),
        "float": dict(cu_seqlens=torch.tensor([0.0, T]), causal=True),
        "window_no_causal": dict(window=4, causal=False),
        "negative_window": dict(window=-1, causal=True),
        "differs_by_rank": dict(cu_seqlens=torch.tensor([0, 10 + rank, T]), causal=True),
        "launch_groups": dict(cu_seqlens=torch.tensor([0, 50, T]), causal=True, steps_per_launch=(1, 1)),  # sum != W
    }[what]
    with comm.CommLog() as log:
        try:
            ring_attention(*local, layout="zigzag", **kwargs)
        except ValueError as e:
            return str(e), dict(log.calls)
    return None, dict(log.calls)


@pytest.mark.parametrize("what", ["not_zero", "not_total", "decreasing", "float", "window_no_causal",
                                  "negative_window", "differs_by_rank", "launch_groups"])
def test_invalid_documents_fail_on_every_rank_before_any_exchange(pools, what):
    results = pools(3).run(bad_call, what)
    messages = {msg for msg, _ in results}
    assert None not in messages and len(messages) == 1, results
    assert all(calls == {} for _, calls in results), results      # no K/V exchange was posted


def triton_methods_vs_one_device(case):
    """Every method with the masked Triton kernel (Triton's CPU interpreter, float32, head_dim 16; batch 1: the
    kernel's batch strides are checked by ``kernel_checks.py masked``, the methods' by the float64 tests)."""
    cu, causal, window = CASES[case]
    q, k, v, dout = _inputs(4, 2, head_dim=16, batch=1)
    want = reference(q, k, v, dout, cu, causal, window)
    cu_t, world, errors = torch.tensor(cu), comm.group_size(), {}
    for name, fn, sh, ga in methods(world, 4):
        if name.startswith("usp") or name.endswith("contiguous") and not name.startswith("ring"):
            continue
        local = [sh(t.float(), cu_t).requires_grad_(True) for t in (q, k, v)]
        out = fn(*local, causal=causal, cu_seqlens=cu_t, window=window, backend="triton")
        out.backward(sh(dout.float(), cu_t))
        got = [ga(t, cu_t) for t in (out.detach(), *(x.grad for x in local))]
        errors[name] = max(rel_err(a, b) for a, b in zip(got, want))
    for layout in ("zigzag", "balanced"):   # the ring by launch groups: both steps in one (forward and dQ)
        local = [shard_sequence(t.float(), None, layout, cu_seqlens=cu_t).requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*local, None, causal, layout, "triton", cu_seqlens=cu_t, window=window,
                             steps_per_launch=(world,))
        out.backward(shard_sequence(dout.float(), None, layout, cu_seqlens=cu_t))
        got = [gather_sequence(t, None, layout, cu_seqlens=cu_t) for t in (out.detach(), *(x.grad for x in local))]
        errors[f"ring-{layout}-one-group"] = max(rel_err(a, b) for a, b in zip(got, want))
    return errors


@pytest.mark.parametrize("case", ["tiny_docs", "window_over_shards", "full_in_docs"])
def test_methods_with_the_masked_triton_kernel(interpreted_pools, case):
    """The masked Triton kernel under the ring, all-gather and Ulysses on real gloo ranks (the interpreter is
    switched on before the workers define the kernels)."""
    for errors in interpreted_pools(2).run(triton_methods_vs_one_device, case, timeout_s=400):
        assert errors and all(e < 2e-5 for e in errors.values()), errors


def triton_ring_blocks_vs_torch(case, layout):
    """One process, Triton's interpreter: every rank's packed ring schedule (``ring_packed``'s own forward and
    backward over resident K/V) with rows cut into many blocks (gap 1: steps of one block, whose kernel
    writes its keys' dK/dV, and of several, added into a zero fill), triton against torch. Returns the worst
    relative error and each rank's blocks per step."""
    from distlab.cp.emulate import ResidentRing
    from distlab.cp.ring_packed import _backward, _forward, step_blocks

    cu, causal, window = CASES[case]
    docs = Documents.from_args(T, torch.tensor(cu), causal, window)
    q, k, v, dout = (t[:1].float() for t in _inputs(4, 2, head_dim=16))
    world, worst, counts = 3, 0.0, []
    pos = [shard_positions(T, world, r, layout, docs.cu_seqlens) for r in range(world)]
    for r in range(world):
        blocks = step_blocks(docs, pos, r, "cpu", gap=1)
        counts.append([len(s) for s in blocks])
        kv = [(k[:, pos[(r - s) % world]].contiguous(), v[:, pos[(r - s) % world]].contiguous()) for s in range(world)]
        qr, dr = q[:, pos[r]].contiguous(), dout[:, pos[r]].contiguous()
        got = {}
        for backend in ("torch", "triton"):
            out, lse = _forward(qr, *kv[0], ResidentRing(world, r, kv), blocks, None, backend)
            got[backend] = (out, *_backward(dr, qr, *kv[0], out, lse, ResidentRing(world, r, kv), blocks, None, backend))
        worst = max(worst, *(rel_err(a, b) for a, b in zip(got["triton"], got["torch"])))
    return worst, counts


def test_triton_ring_steps_of_one_and_of_several_blocks(interpreted_pools):
    """The fused packed ring's backward: a step's only block writes its keys' dK/dV (no zero fill), a step of
    several adds into zeros; both equal the torch backend's sums (Triton's interpreter, float32)."""
    jobs = [("window_in_doc", "balanced"), ("full_in_docs", "zigzag")]
    for (case, layout), (worst, counts) in zip(jobs, interpreted_pools(2).map(triton_ring_blocks_vs_torch, jobs,
                                                                             timeout_s=400)):
        steps = [n for rank in counts for n in rank[1:]]
        assert 1 in steps and max(steps) >= 2, counts   # both kinds of step are exercised
        assert worst < 2e-5, (case, layout, worst)


def triton_ring_forward_orders(case, layout):
    """One process, Triton's interpreter: every rank's packed ring forward (blocks of one and of several
    runs, accumulated, each row written at its last block) with the masked kernel's query tiles in row order
    and longest first (``DISTLAB_TRITON_MASKED_ORDER=lpt``). Returns whether every output and LSE is
    bitwise equal between the two orders, and the worst relative error against the torch backend."""
    from distlab import knobs
    from distlab.cp.emulate import ResidentRing
    from distlab.cp.ring_packed import _forward, step_blocks

    cu, causal, window = CASES[case]
    docs = Documents.from_args(T, torch.tensor(cu), causal, window)
    q, k, v, _ = (t[:1].float() for t in _inputs(4, 2, head_dim=16))
    world, same, worst = 3, True, 0.0
    pos = [shard_positions(T, world, r, layout, docs.cu_seqlens) for r in range(world)]
    for r in range(world):
        blocks = step_blocks(docs, pos, r, "cpu", gap=1)
        kv = [(k[:, pos[(r - s) % world]].contiguous(), v[:, pos[(r - s) % world]].contiguous()) for s in range(world)]
        qr = q[:, pos[r]].contiguous()
        want = _forward(qr, *kv[0], ResidentRing(world, r, kv), blocks, None, "torch")
        got = {}
        for order in ("rows", "lpt"):
            with knobs.override(TRITON_MASKED_ORDER=order):
                got[order] = _forward(qr, *kv[0], ResidentRing(world, r, kv), blocks, None, "triton")
        same = same and all(torch.equal(a, b) for a, b in zip(got["rows"], got["lpt"]))
        finite = torch.isfinite(want[1])
        worst = max(worst, rel_err(got["lpt"][0], want[0]), rel_err(got["lpt"][1][finite], want[1][finite]))
    return same, worst


def test_masked_forward_longest_tiles_first_is_the_same_computation(interpreted_pools):
    """``DISTLAB_TRITON_MASKED_ORDER`` (lpt, the default for ring blocks) only changes which program the GPU
    starts first: the packed ring's forward gives bit-identical results in both orders, equal to the torch
    backend (Triton's interpreter)."""
    jobs = [("window_in_doc", "balanced"), ("full_in_docs", "zigzag")]
    for (case, layout), (same, worst) in zip(jobs, interpreted_pools(2).map(triton_ring_forward_orders, jobs,
                                                                           timeout_s=400)):
        assert same and worst < 2e-5, (case, layout, same, worst)


def triton_ring_forward_accumulators(case, layout):
    """One process, Triton's interpreter: every rank's packed ring forward with one running result and with two
    (``DISTLAB_PACKED_FWD_STREAMS=2``: the later steps' blocks into their own, merged at the end; on the CPU
    in order), then the fused backward from that forward's out and LSE. The rank's output and dQ rows against
    the one-device float64 reference; its dK/dV (a resident ring's accumulators come back as sent) and LSE
    against the torch backend's schedule. Returns the worst relative error per mode, and how many ranks had
    rows to merge."""
    from distlab import knobs
    from distlab.cp.emulate import ResidentRing
    from distlab.cp.ring_packed import _backward, _forward, step_blocks

    cu, causal, window = CASES[case]
    docs = Documents.from_args(T, torch.tensor(cu), causal, window)
    q, k, v, dout = (t[:1] for t in _inputs(4, 2, head_dim=16))
    want_out, want_dq, _, _ = reference(q, k, v, dout, cu, causal, window)
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    world, worst, merged = 3, {"1": 0.0, "2": 0.0, "groups": 0.0}, 0
    pos = [shard_positions(T, world, r, layout, docs.cu_seqlens) for r in range(world)]
    for r in range(world):
        blocks = step_blocks(docs, pos, r, "cpu", gap=1)
        grouped = step_blocks(docs, pos, r, "cpu", gap=1, steps_per_launch=(1, 2))   # 0 | 1 2, keys gathered
        merged += bool(blocks.side_runs)
        kv = [(k[:, pos[(r - s) % world]].contiguous(), v[:, pos[(r - s) % world]].contiguous()) for s in range(world)]
        qr, dr = q[:, pos[r]].contiguous(), dout[:, pos[r]].contiguous()

        def schedule(backend, plan=blocks):
            out, lse = _forward(qr, *kv[0], ResidentRing(world, r, kv), plan, None, backend)
            return (out, lse, *_backward(dr, qr, *kv[0], out, lse, ResidentRing(world, r, kv), plan, None, backend))

        want = schedule("torch")
        finite = torch.isfinite(want[1])
        for flag in worst:
            with knobs.override(PACKED_FWD_STREAMS="1" if flag == "groups" else flag):
                out, lse, dq, dk, dv = schedule("triton", grouped if flag == "groups" else blocks)
            assert torch.equal(torch.isinf(lse), torch.isinf(want[1])), (case, layout, r, flag)
            worst[flag] = max(worst[flag], rel_err(out, want_out[:, pos[r]]), rel_err(dq, want_dq[:, pos[r]]),
                              rel_err(lse[finite], want[1][finite]), rel_err(dk, want[3]), rel_err(dv, want[4]))
    return worst, merged


def test_triton_ring_two_forward_accumulators(interpreted_pools):
    """The packed ring's forward on two streams (``DISTLAB_PACKED_FWD_STREAMS=2``): my own step's blocks and
    the later steps' each into a running result, the rows both cover merged at the end — its output and the
    backward's gradients from it equal one device (float64 reference), as with one running result, and as
    with the later steps in one launch group (0 | 1 2: their keys gathered, the forward numbered by groups,
    the backward by steps) (Triton's interpreter, float32, in order on the CPU)."""
    jobs = [("window_in_doc", "balanced"), ("full_in_docs", "zigzag"), ("one_doc", "contiguous")]
    for (case, layout), (worst, merged) in zip(jobs, interpreted_pools(2).map(triton_ring_forward_accumulators, jobs,
                                                                             timeout_s=400)):
        assert merged >= 1, (case, layout)   # some rank had rows to merge
        assert max(worst.values()) < 2e-5, (case, layout, worst)


def test_masked_tile_order_knob_refuses_an_unknown_value():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from distlab import knobs
    from distlab.kernels.triton_masked_attention import _longest_first

    with knobs.override(TRITON_MASKED_ORDER="longest"), pytest.raises(ValueError, match="rows, lpt or auto"):
        _longest_first(True)
    with knobs.override(TRITON_MASKED_ORDER="auto"):
        assert _longest_first(True) and not _longest_first(False)


def test_masked_tiles_start_longest_first_for_a_ring_block_and_a_ranks_share_of_a_call():
    """``auto``: a ring step's block (accumulated) and all-gather CP's rank (its rows against every key) start
    their tiles longest first; a whole call (as many rows as keys) keeps row order; rows and lpt force."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from distlab import knobs
    from distlab.cp.allgather import _gathered_mask
    from distlab.kernels.triton_masked_attention import _longest_first

    docs = Documents.from_args(512, parse_docs("300,12,200", 512), True, None)
    every = torch.arange(512)
    whole = docs.mask(every, every)
    share, _ = _gathered_mask(docs, 4, 1, "balanced", "cpu")
    assert share.q_lo.shape[0] == 128 and share.k_pos.shape[0] == 512
    with knobs.override(TRITON_MASKED_ORDER="auto"):
        assert _longest_first(False, share) and not _longest_first(False, whole) and _longest_first(True, whole)
    for order, want in (("rows", False), ("lpt", True)):
        with knobs.override(TRITON_MASKED_ORDER=order):
            assert all(_longest_first(acc, m) is want for acc in (False, True) for m in (share, whole))


def test_packed_stream_knobs():
    """``DISTLAB_PACKED_BWD_STREAMS`` / ``_FWD_STREAMS``: an unknown value is refused; on the CPU the backward
    runs on the caller's stream in every mode (the GPU half, ``tests/kernel_checks.py packed_ring``: the
    backward on four streams, two and one bit for bit equal; the forward's two running results, merged, on
    the CPU too: ``test_triton_ring_two_forward_accumulators``)."""
    from distlab import knobs
    from distlab.cp.ring_packed import BackwardStreams

    from distlab.cp.ring_packed import forward_streams

    with knobs.override(PACKED_BWD_STREAMS="3"), pytest.raises(ValueError, match="use 1, 2 or 4"):
        BackwardStreams(torch.device("cpu"))
    with knobs.override(PACKED_FWD_STREAMS="4"), pytest.raises(ValueError, match="use 2"):
        forward_streams()
    for flag in ("1", "2", "4"):
        with knobs.override(PACKED_BWD_STREAMS=flag):
            plan = BackwardStreams(torch.device("cpu"))
            assert plan.main is None and plan.dq is None and plan.chain is None and plan.dkv_stream(1) is None


def test_packed_emulator_runs_and_writes_json(tmp_path):
    """The packed emulator's CPU code path (the GPU figures are in docs/PERF.md)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "distlab.cp.emulate_packed", "--device", "cpu", "--seq", "512",
                           "--world", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--iters", "1",
                           "--warmup", "0", "--docs", "lognormal:mean=64,seed=0", "--rate-means", "64",
                           "--layouts", "contiguous", "zigzag", "balanced", "units", "docs-first:0",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["layout"] for r in result["rows"]] == ["contiguous", "zigzag", "balanced", "units", "docs-first:0"]
    balanced = result["rows"][2]
    assert balanced["imbalance"] < 1.05 and set(balanced["efficiency"]) == {"fwd_wall", "fwd_gpu", "fwd_bwd_wall",
                                                                         "fwd_bwd_gpu"}
    for row in result["rows"]:   # every rank visits at least its share of the one call's tiles
        tiles = row["tiles"]
        assert all(0 < b <= 1 for b in tiles["bound"].values()) and tiles["most_blocks"] >= 1
        assert sum(r["fwd"] for r in tiles["ranks"]) >= tiles["one_call"]["fwd"]
    # all-gather CP's compute on the same layouts: one block a rank (its rows against every key)
    proc = subprocess.run([sys.executable, "-m", "distlab.cp.emulate_packed", "--device", "cpu", "--seq", "512",
                           "--world", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--iters", "1",
                           "--warmup", "0", "--docs", "lognormal:mean=64,seed=0", "--rate-means", "--method",
                           "allgather", "--chunks", "1", "--layouts", "zigzag", "balanced", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "all-gather rank" in proc.stdout, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["method"], r["tiles"]["most_blocks"]) for r in result["rows"]] == [("allgather", 1)] * 2
    assert result["chunks"] == 1


def test_allgather_schedule_is_all_gather_cp_on_one_device():
    """``emulate_packed --method allgather`` times ``distlab.cp.allgather``'s own forward and backward at world
    1 over the gathered K/V: each rank's output and dQ are its rows of one-device masked attention, and the
    ranks' dK/dV (each over every key, in rank order) add up to one device's — float64, torch backend."""
    from distlab.cp.emulate_packed import allgather_schedule, placement_positions
    from distlab.kernels.attention import attention_backward, attention_forward

    t, world = 256, 4
    docs = Documents.from_args(t, parse_docs("lognormal:mean=40,seed=1", t), True, None)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, t, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, t, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    every = torch.arange(t)
    want = attention_forward(q, k, v, False, backend="torch", mask=docs.mask(every, every))
    dq_w, dk_w, dv_w = attention_backward(dout, q, k, v, *want, False, backend="torch", mask=docs.mask(every, every))
    for layout, chunks in (("balanced", None), ("units", None), ("balanced", 1)):   # kv-head groups: 2, 2, 1
        positions = placement_positions(layout, docs, world)
        everyone = torch.cat(list(positions))
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for rank in range(world):
            fwd, fwd_bwd = allgather_schedule(q, k, v, dout, docs, positions, rank, "torch", chunks=chunks)
            out, _ = fwd()
            assert torch.allclose(out, want[0][:, positions[rank]], atol=1e-12), (layout, rank)
            dq_r, dk_r, dv_r = fwd_bwd()
            assert torch.allclose(dq_r, dq_w[:, positions[rank]], atol=1e-12), (layout, rank)
            dk[:, everyone] += dk_r
            dv[:, everyone] += dv_r
        assert torch.allclose(dk, dk_w, atol=1e-12) and torch.allclose(dv, dv_w, atol=1e-12), layout


def allgather_schedule_triton_vs_one_device():
    """One process, Triton's interpreter: all-gather CP's schedule on the masked Triton kernel (float32, batch 1,
    two kv-head groups: the backward reads an LSE view of half the heads) against one-device masked attention:
    each rank's output and dQ are its rows of it, and the ranks' dK/dV add up to its dK/dV."""
    from distlab.cp.emulate_packed import allgather_schedule, placement_positions
    from distlab.kernels.attention import attention_backward, attention_forward

    t, world = 256, 4
    docs = Documents.from_args(t, parse_docs("lognormal:mean=40,seed=1", t), True, None)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, t, 4, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, t, 2, 16, generator=g) for _ in range(2))
    every = torch.arange(t)
    mask = docs.mask(every, every)
    want = attention_forward(q.double(), k.double(), v.double(), False, backend="torch", mask=mask)
    dq_w, dk_w, dv_w = attention_backward(dout.double(), q.double(), k.double(), v.double(), *want, False,
                                          backend="torch", mask=mask)
    positions = placement_positions("balanced", docs, world)
    everyone = torch.cat(list(positions))
    dk, dv, errors = torch.zeros_like(dk_w), torch.zeros_like(dv_w), []
    for rank in range(world):
        fwd, fwd_bwd = allgather_schedule(q, k, v, dout, docs, positions, rank, "triton")
        out, _ = fwd()
        dq_r, dk_r, dv_r = fwd_bwd()
        errors += [rel_err(out, want[0][:, positions[rank]]), rel_err(dq_r, dq_w[:, positions[rank]])]
        dk[:, everyone] += dk_r.double()
        dv[:, everyone] += dv_r.double()
    return errors + [rel_err(dk, dk_w), rel_err(dv, dv_w)]


def test_allgather_schedule_on_the_masked_triton_kernel(interpreted_pools):
    """The H200/H100 run of ``emulate_packed --method allgather`` (2026-12-05) failed in the backward: the LSE of
    a kv-head group is a view whose batch stride is the whole tensor's, and the rows' check wanted delta's."""
    (errors,) = interpreted_pools(2).map(allgather_schedule_triton_vs_one_device, [()], timeout_s=300)
    assert errors and all(e < 2e-5 for e in errors), errors


def dq_final_on_and_off(ring):
    """One process, Triton's interpreter, float32: a rank's backward with ``DISTLAB_RING_DQ_FINAL`` 1 (each row's
    final dQ written by its last block's dQ kernel) and 0 (a float32 dQ converted after the ring) — the dense
    ring (``emulate_rank``, zigzag and contiguous) and the packed ring (every rank of a W=3 pack in the balanced
    layout, one launch a step and by launch groups 0 | 1 2), ``ring`` "dense" or "packed". Returns, per case,
    whether the two gradients are the same bit for bit."""
    from distlab import knobs
    from distlab.cp.emulate import ResidentRing, emulate_rank
    from distlab.cp.ring_packed import _backward, _forward, step_blocks

    same = {}
    for layout, rank in (("zigzag", 0), ("zigzag", 2), ("contiguous", 1)) if ring == "dense" else ():
        got = []
        for flag in ("1", "0"):
            with knobs.override(RING_DQ_FINAL=flag):
                got.append(emulate_rank(3, 96, 2, 1, 16, rank, layout, True, "triton", torch.float32,
                                        torch.device("cpu"), keep_output=True, iters=1, warmup=0)["dq"])
        same[f"dense {layout} r{rank}"] = torch.equal(*got)
    if ring == "dense":
        return same
    cu, causal, window = CASES["tiny_docs"]
    docs = Documents.from_args(T, torch.tensor(cu), causal, window)
    q, k, v, dout = (t[:1].float() for t in _inputs(4, 2, head_dim=16))
    world = 3
    pos = [shard_positions(T, world, r, "balanced", docs.cu_seqlens) for r in range(world)]
    for r, steps in ((r, steps) for r in range(world) for steps in (1, (1, 2))):   # one launch a step; 0 | 1 2
        blocks = step_blocks(docs, pos, r, "cpu", steps_per_launch=steps)
        kv = [(k[:, pos[(r - s) % world]].contiguous(), v[:, pos[(r - s) % world]].contiguous()) for s in range(world)]
        qr, dr = q[:, pos[r]].contiguous(), dout[:, pos[r]].contiguous()
        out, lse = _forward(qr, *kv[0], ResidentRing(world, r, kv), blocks, None, "triton")
        got = []
        for flag in ("1", "0"):
            with knobs.override(RING_DQ_FINAL=flag):
                got.append(_backward(dr, qr, *kv[0], out, lse, ResidentRing(world, r, kv), blocks, None, "triton"))
        same[f"packed r{r} steps {steps}"] = all(torch.equal(a, b) for a, b in zip(*got))
    return same


def test_the_final_dq_from_the_last_block_is_the_converted_accumulator(interpreted_pools):
    """``DISTLAB_RING_DQ_FINAL`` 1 (the default) and 0 give the same gradients bit for bit (float32 on the CPU;
    the one-device parity tests of both rings run with 1)."""
    same = interpreted_pools(2).map(dq_final_on_and_off, [("dense",), ("packed",)], timeout_s=300)
    assert all(case and all(case.values()) for case in same), same


def test_packed_emulator_refuses_unknown_layouts_before_any_clock():
    from distlab.cp.emulate_packed import check_layout_names

    check_layout_names(["contiguous", "zigzag", "balanced", "units", "docs-first:0.25", "docs-first:0"])
    for bad in ("nope", "docs-first:x", "docs-first:2", "docs-first:"):
        with pytest.raises(ValueError, match="--layouts"):
            check_layout_names(["zigzag", bad])


def test_visited_tiles_of_one_causal_sequence():
    """Forward: query tile i (128 rows) of a causal 1024-token sequence visits key tiles 0..2i+1 (64 keys each);
    backward: dQ's 64-row tiles visit i+1 key tiles, dK/dV's key tile j the 64-row tiles j..15."""
    from distlab.cp.emulate_packed import visited_tiles

    every = torch.arange(1024)
    tiles = visited_tiles(document_mask(every, every, None, True), 128)
    half = sum(i + 1 for i in range(16))   # dQ's tiles, and as many for dK/dV's
    assert tiles == {"fwd": sum(2 * i + 2 for i in range(8)), "bwd": 2 * half, "dq": half, "dkv": half}


FUSED_QKV_VIEWS = """
import torch
from distlab.kernels.masks import document_mask
from distlab.kernels.triton_masked_attention import masked_backward, masked_forward
from distlab.kernels.attention import attention_backward, attention_forward
torch.manual_seed(0)
n, h, kv, d = 48, 4, 2, 16
qkv = torch.randn(1, n, (h + 2 * kv) * d)
q, k, v = (t.view(1, n, -1, d) for t in qkv.split([h * d, kv * d, kv * d], -1))
q, k = q.contiguous(), k.contiguous()          # RoPE's outputs are new tensors; v stays a view of the fused output
pos = torch.arange(n)
mask = document_mask(pos, pos, torch.tensor([0, 20, 48]), True, None, n)
out, lse = masked_forward(q, k, v, mask, d ** -0.5)
want, want_lse = attention_forward(q, k, v.contiguous(), False, backend="torch", mask=mask)
dout = torch.randn_like(out)
got = masked_backward(dout, q, k, v, out, lse, mask, d ** -0.5)
ref = attention_backward(dout, q, k, v.contiguous(), want, want_lse, False, backend="torch", mask=mask)
err = max([(out - want).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(got, ref)])
print("OK" if err < 1e-4 else f"BAD {err}")
"""


def test_masked_kernel_takes_a_fused_qkv_view():
    """The masked Triton kernel with V a view of a fused QKV output (strides unlike K's): it walked V with K's
    strides, so packed training and prefill in bf16 on a GPU attended the wrong values (found by
    ``distlab.infer --pack`` against each prompt alone)."""
    from distlab.testing import run_in_triton_interpreter

    proc = run_in_triton_interpreter(FUSED_QKV_VIEWS)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr[-3000:]


SKIPPED_GAP_IS_EXACT = """
import torch
from distlab.kernels import masks, triton_masked_attention as tma
from distlab.kernels.masks import document_mask
torch.manual_seed(0)
h, kv, d = 4, 2, 16
rows = torch.cat([torch.arange(24), torch.arange(80, 96)])   # a 16-row tile straddles two far documents
mask = document_mask(rows, torch.arange(96), torch.tensor([0, 1, 31, 31, 71, 96]), True, None, 96)
q, do = torch.randn(1, 40, h, d), torch.randn(1, 40, h, d)
k, v = torch.randn(1, 96, kv, d), torch.randn(1, 96, kv, d)
def run():
    out, lse = tma.masked_forward(q, k, v, mask, d ** -0.5)
    return (out, lse, *tma.masked_backward(do, q, k, v, out, lse, mask, d ** -0.5))
skipping = run()
assert masks.key_tiles(mask, 16, 16).tolist() == [1, 4, 2]
# the same kernels told there is no gap: they loop over every key between the two documents
from distlab import knobs
end = masks.key_ranges(mask, 16)[1]
assert tma._gaps(mask, 16, 16, end)[0].tolist() != end.tolist()   # a tile to skip
with knobs.override(TRITON_MASKED_GAPS="0"):
    assert tma._gaps(mask, 16, 16, end)[0].tolist() == end.tolist()   # none
    whole = run()
print("OK" if all(torch.equal(a, b) for a, b in zip(skipping, whole)) else "DIFFERENT")
"""


def test_skipping_a_tiles_gap_changes_no_bit():
    """The keys a tile skips (``key_gaps``) are keys none of its rows sees, so the forward, dQ and dK/dV are
    bit for bit those of the kernels looping over every key of the tile's range (knob
    ``DISTLAB_TRITON_MASKED_GAPS=0``; Triton's interpreter)."""
    from distlab.testing import run_in_triton_interpreter

    proc = run_in_triton_interpreter(SKIPPED_GAP_IS_EXACT)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr[-3000:]


def test_masked_kernel_tile_ranges_are_tight_for_partial_tiles():
    """The key range a query tile loops over is the union of its rows' intervals, also for a tile the rows do
    not fill (a ring block's last tile): its padding once turned into "from key 0" (an int64-max fill value
    wrapped through a double), so a 5-row block of a late document looped over every key of the step."""
    pytest.importorskip("triton")
    from distlab.kernels.masks import full_key_ranges, key_ranges, query_ranges

    rows, keys = torch.arange(200, 205), torch.arange(300)
    mask = document_mask(rows, keys, torch.tensor([0, 50, 300]), True, None, 300)
    for block_m in (4, 128):   # several tiles, the last one partial; one partial tile
        (kb, ke), (fb, fe) = key_ranges(mask, block_m), full_key_ranges(mask, block_m)
        assert kb.tolist()[0] == 50 and ke.tolist()[-1] == 205, (block_m, kb, ke)
        assert fb.tolist()[-1] == 50 and fe.tolist()[-1] == (205 if block_m == 4 else 201), (block_m, fb, fe)
    qb, qe = query_ranges(mask, 300, 64)   # key tiles 0 (keys 0..63) .. 4: rows see keys 50..204
    assert qb.tolist() == [0, 0, 0, 0, 5] and qe.tolist() == [5, 5, 5, 5, 5]


def test_a_query_tile_skips_the_keys_between_two_far_documents():
    """``key_gaps``: the widest run of keys inside a tile's key range that no row of the tile sees (at least a
    key tile long) — all-gather's rows of a balanced rank, whose tile ends one document and starts another far
    off — is skipped, exactly: no row sees a key in it, every seen key lies outside it. On random packs of
    documents, windows and row subsets, against the mask itself."""
    from distlab.kernels.masks import key_gaps, key_ranges, key_tiles

    cu = torch.tensor([0, 1, 31, 31, 71, 96])
    mask = document_mask(torch.cat([torch.arange(24), torch.arange(80, 96)]), torch.arange(96), cu, True, None, 96)
    (kb, ke), (gb, ge) = key_ranges(mask, 16), key_gaps(mask, 16, 16)
    assert (kb.tolist(), ke.tolist(), gb.tolist(), ge.tolist()) == ([0, 1, 71], [16, 88, 96], [16, 33, 96],
                                                                    [16, 65, 96])
    assert key_tiles(mask, 16, 16).tolist() == [1, 2 + 2, 2]   # tile 1 sees keys 1..23, 71..87: tiles 33, 49 skipped
    assert key_gaps(mask, 16, 64)[0].tolist() == [16, 88, 96]  # a gap shorter than a key tile is kept
    g, gaps = torch.Generator().manual_seed(0), 0
    for trial in range(40):
        total = int(torch.randint(64, 400, (1,), generator=g))
        cuts = torch.randint(1, total, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).unique()
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
        rows = torch.randperm(total, generator=g)[:int(torch.randint(1, total, (1,), generator=g))].sort().values
        window = None if trial % 3 else int(torch.randint(0, 50, (1,), generator=g))
        mask = document_mask(rows, torch.arange(total), cu, True, window, total)
        for bm, bn in ((16, 16), (32, 8)):
            (kb, ke), (gb, ge) = key_ranges(mask, bm), key_gaps(mask, bm, bn)
            assert bool(((kb <= gb) & (gb <= ge) & (ge <= ke)).all())
            for t in range((rows.numel() + bm - 1) // bm):
                lo, hi = mask.q_lo[t * bm:(t + 1) * bm], mask.q_hi[t * bm:(t + 1) * bm]
                seen = ((mask.k_pos[None, :] >= lo[:, None]) & (mask.k_pos[None, :] < hi[:, None])).any(0)
                assert not seen[gb[t]:ge[t]].any(), (trial, t)
                assert ge[t] == gb[t] or (ge[t] - gb[t]) % bn == 0 and (gb[t] - kb[t]) % bn == 0
                gaps += int(ge[t] > gb[t])
    assert gaps >= 10   # the packs above have tiles to skip in (15 with this seed)


def test_cached_plan_builds_once_per_pack_and_key():
    """A CP method's masks and blocks are built once per (method, pack, key) and kept for the next layer or
    step on the same pack; another pack, window or key builds anew; the cache keeps the last PLAN_CACHE_SIZE."""
    from distlab.cp import documents

    built = []

    def plan(docs, *key):
        return documents.cached_plan("test", docs, *key, build=lambda: built.append(key) or object())

    a = Documents.from_args(64, torch.tensor([0, 10, 64]), True, None)
    first = plan(a, 4, 0)
    assert plan(Documents.from_args(64, [0, 10, 64], True, None), 4, 0) is first and len(built) == 1
    plan(Documents.from_args(64, [0, 11, 64], True, None), 4, 0)
    plan(Documents.from_args(64, [0, 10, 64], True, 5), 4, 0)
    plan(a, 4, 1)
    assert len(built) == 4
    for i in range(documents.PLAN_CACHE_SIZE):
        plan(a, 8, i)
    assert plan(a, 4, 0) is not first and len(built) == 5 + documents.PLAN_CACHE_SIZE
