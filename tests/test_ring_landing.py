"""K/V received straight into the fused blocks' buffers (``distlab.cp.ring_landing``): where each message
lands, and the emulator's ring (``ResidentRing.landing_buffer``) giving the same answer with no concatenation.
The parity of real gloo rings that land their K/V: ``test_ring.py`` (several blocks in flight, batch 1) and
``test_fa4_ring_backward.py`` (FA4's kept path on stand-in kernels, by groups)."""

import pytest
import torch

from distlab import knobs
from distlab.cp.ring_landing import landing_plan


def _cover(contents, size):
    """Every key of a buffer filled exactly once."""
    seen = torch.zeros(size, dtype=torch.long)
    for _, _, n, offset in contents:
        seen[offset:offset + n] += 1
    return bool((seen == 1).all())


def test_landing_plan_puts_each_fused_blocks_keys_in_one_buffer():
    """Zigzag W=8 in groups of 4 (0 | 1 2 3 | 4 5 6 7), shards of 64 keys (chunks of 32): every later step's two
    chunks of K land somewhere; a fused block's buffer holds its steps' keys in ``fuse_plan``'s order; a chunk a
    rank only forwards (the late chunk of an earlier rank's K/V) lands in its group's spare buffer."""
    from distlab.cp.ring import group_plans

    for rank in range(8):
        place, sizes, contents, runs = landing_plan(rank, 8, 64, True, "zigzag", 4)
        assert sorted(place) == list(range(1, 8)) and all(len(p) == 2 for p in place.values())
        for key, size in sizes.items():
            assert _cover(contents[key], size), (rank, key)
        groups = group_plans(rank, 8, 64, True, "zigzag", 4)
        for (g, i), key in runs.items():
            pieces = groups[g][1][i][2]
            assert sizes[key] == sum(c.stop - c.start for _, c in pieces)
            offset = 0
            for step, cols in pieces:   # chunk c of the step at its place in the joined keys
                for c, (where, off) in enumerate(place[step]):
                    if cols.start <= 32 * c < cols.stop:   # ``off``: in chunks of the buffer
                        assert (where, off * 32) == (key, offset + 32 * c - cols.start)
                    else:   # the group's spare buffer
                        assert where == ("spare", g) and (step, 32 * c, 32, off * 32) in contents[where]
                offset += cols.stop - cols.start
        fused = {step for g, i in runs for step, _ in groups[g][1][i][2]}
        spares = [k for k in sizes if k[0] == "spare"]
        # rank 0 sees every later rank's K/V whole (no spares), rank 7 the first chunk of each (7 spare chunks)
        assert sum(sizes[k] for k in spares) == {0: 0, 7: 7 * 32}.get(rank, sum(sizes[k] for k in spares))
        assert all(("step", s) in sizes for s in range(1, 8) if s not in fused)
    # rank 0: two fused blocks, 3 and 4 steps' whole shards; rank 7: steps 1-3 and 4-7, their first chunks
    assert sorted(landing_plan(0, 8, 64, True, "zigzag", 4)[1].values()) == [192, 256]
    assert sorted(v for k, v in landing_plan(7, 8, 64, True, "zigzag", 4)[1].items() if k[0] == "run") == [96, 128]
    # one step a launch: nothing fused, each step lands whole; contiguous: one message a tensor
    place, sizes, _, runs = landing_plan(2, 4, 16, True, "contiguous", 1)
    assert not runs and place == {s: ((("step", s), 0),) for s in (1, 2, 3)}
    place, sizes, _, runs = landing_plan(3, 4, 16, True, "contiguous", (4,))
    assert list(runs) == [(0, 1)] and sizes[("run", 0, 1)] == 48


def _emulated(landing: str, layout: str, causal: bool, rank: int):
    from distlab.cp import ring, ring_fused
    from distlab.cp.emulate import emulate_rank

    joined = []
    real = ring.group_kv

    def counting(got, pieces):
        joined.append(len(pieces))
        return real(got, pieces)

    ring.group_kv = ring_fused.group_kv = counting
    try:
        with knobs.override(RING_KV_LANDING=landing):
            res = emulate_rank(4, 64, 4, 2, 8, rank, layout, causal, "torch", torch.float64, torch.device("cpu"),
                               iters=1, warmup=0, keep_output=True, steps_per_launch=3)
    finally:
        ring.group_kv = ring_fused.group_kv = real
    return res, joined


def _one_device(res, causal):
    """The rank's rows of one-device attention over the whole sequence, and their dQ (which depends on those
    rows' dO only), in float64."""
    from distlab.kernels.attention import attention_backward, attention_forward

    q, k, v, rows = res["q"], res["k"], res["v"], res["rows"]
    out, lse = attention_forward(q, k, v, causal, backend="torch")
    dout = torch.zeros_like(q)
    dout[:, rows] = res["dout"]
    return out[:, rows], attention_backward(dout, q, k, v, out, lse, causal, backend="torch")[0][:, rows]


@pytest.mark.parametrize("layout,causal,rank", [("zigzag", True, 0), ("zigzag", True, 3), ("zigzag", False, 1),
                                                ("contiguous", True, 3)])
def test_the_emulated_rank_lands_its_kv_with_no_concatenation(layout, causal, rank):
    """``distlab.cp.emulate`` (a rank's schedule, K/V resident) by groups of 3 on W=4 (0 | 1 2 3): with landing
    its fused blocks read the buffers the exchanges filled (no ``group_kv`` of several steps), and out and dQ
    match one device's rows, as the concatenating path's do, in float64 (zigzag's rank 3 reads the first chunk
    of every earlier rank's K/V and forwards the other from a spare buffer)."""
    res, joined = _emulated("1", layout, causal, rank)
    res0, joined0 = _emulated("0", layout, causal, rank)
    assert max(joined0) > 1 and all(n == 1 for n in joined), (joined0, joined)
    want_out, want_dq = _one_device(res, causal)
    for name, got, want in (("out", res["out"], want_out), ("dq", res["dq"], want_dq),
                            ("out, copies", res0["out"], want_out), ("dq, copies", res0["dq"], want_dq)):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-12, (name, layout, causal, rank)


def _exchange_into_slices():
    """On each gloo rank: a bad receive buffer refused before anything is posted; then K's two chunks received
    into two slices of one buffer, forwarded once more from there (``exchange_after``)."""
    from distlab import comm

    ring = comm.RingExchanger(None)
    mine = torch.full((1, 4, 2, 3), float(ring.rank))
    errors = []
    for bad in ([torch.empty(1, 3, 2, 3)], [torch.empty(1, 4, 2, 3, dtype=torch.float64)],
                [torch.empty(1, 4, 3, 2).transpose(2, 3)]):
        try:
            ring.exchange([mine], "test", recv=bad)
        except ValueError as e:
            errors.append(str(e))
    buf = torch.full((2, 1, 4, 2, 3), -1.0)   # K and V: chunk 0 and chunk 1 of K land in K's two halves
    slots = buf.view(4, 1, 2, 2, 3).unbind(0)
    first = ring.exchange([mine[:, :2], mine[:, 2:]], "test", recv=[slots[0], slots[1]])
    second = ring.exchange_after(first, "test", recv=[slots[2], slots[3]])
    second.wait()
    return errors, buf[0].unique().tolist(), buf[1].unique().tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_receives_into_given_slices(pools, world):
    """``comm.RingExchanger.exchange(..., recv=)`` on real gloo ranks: each rank's shard arrives from the
    previous rank in the given slices (two hops: the second forwards what the first received), and receive
    buffers of another shape, dtype, or not contiguous are refused with a ValueError before any send."""
    for rank, (errors, k_values, v_values) in enumerate(pools(world).run(_exchange_into_slices)):
        assert len(errors) == 3 and all("receive buffers" in e for e in errors), errors
        assert k_values == [float((rank - 1) % world)], (rank, k_values)
        assert v_values == [float((rank - 2) % world)], (rank, v_values)


def _ring_on_kv_halves(landing):
    """On each gloo rank: K and V as the two halves of one projection (strided views, batch 1), a zigzag ring by
    groups 0 | 1 2 (W=3) in float64, output and gradients against one device."""
    from distlab.cp.layout import gather_sequence, shard_sequence
    from distlab.cp.ring import ring_attention
    from distlab.kernels.attention import attention_reference

    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 48, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    kv = torch.randn(1, 48, 2, 16, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, kv)]
    attention_reference(full[0], full[1][..., :8], full[1][..., 8:], causal=True).backward(dout)
    want = attention_reference(q, kv[..., :8], kv[..., 8:], causal=True)
    lq, lkv = (shard_sequence(t, None, "zigzag").requires_grad_(True) for t in (q, kv))
    with knobs.override(RING_KV_LANDING=landing):
        out = ring_attention(lq, lkv[..., :8], lkv[..., 8:], causal=True, layout="zigzag", backend="torch",
                             steps_per_launch=(1, 2))
        out.backward(shard_sequence(dout, None, "zigzag"))
    got = [gather_sequence(t, None, "zigzag") for t in (out.detach(), lq.grad, lkv.grad)]
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, (want, full[0].grad, full[1].grad))]


def test_landing_with_strided_kv_matches_one_device(pools):
    """K and V handed in as strided views (halves of a fused K/V projection): the messages are cut from them
    and sent as contiguous copies; landing and copying rings both match one device, output and gradients."""
    for landing in ("1", "0"):
        for rank, errs in enumerate(pools(3).run(_ring_on_kv_halves, landing)):
            assert max(errs) < 1e-12, (landing, rank, errs)


def test_landing_buffers_are_kept_per_shape_and_released():
    """``kv_landing`` makes a ring shape's buffers once: the same object for the same shape and K/V dtype, a new
    one for another; at most ``KEPT_SHAPES`` shapes are kept (the least recently used goes); made under
    inference mode (a prefill) they are still plain tensors, which a later training pass may receive into;
    ``release_landing_buffers`` frees all and says how many bytes."""
    from distlab.cp import ring_landing

    class Ring:   # no landing_buffer / landing_cache: plain ``torch.empty`` buffers, kept by the module
        pass

    ring_landing.release_landing_buffers()
    k = torch.zeros(1, 8, 2, 4)
    shapes = [(0, 4, 8 * (i + 1), True, "zigzag", (1, 3), 0) for i in range(ring_landing.KEPT_SHAPES + 1)]
    with torch.inference_mode():
        first = ring_landing.kv_landing(Ring(), torch.zeros(1, 8, 2, 4), shapes[0])
    assert not first.buffers[0].is_inference()
    first.buffers[0].add_(1)   # a training pass's write: allowed
    assert ring_landing.kv_landing(Ring(), k, shapes[0]) is first
    assert ring_landing.kv_landing(Ring(), k.double(), shapes[0]) is not first
    for shape in shapes[1:]:
        ring_landing.kv_landing(Ring(), k, shape)
    assert len(ring_landing._KEPT) == ring_landing.KEPT_SHAPES
    assert ring_landing.kv_landing(Ring(), k, shapes[0]) is not first   # the oldest was let go
    want = sum(landing.nbytes for landing in ring_landing._KEPT.values())
    assert want > 0 and ring_landing.release_landing_buffers() == want and not ring_landing._KEPT
