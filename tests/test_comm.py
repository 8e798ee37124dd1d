"""distlab.comm on real gloo groups: every mapping's forward and backward against the one-device formula.

Each rank r builds every rank's inputs from seeds, so it can compute the one-device answer for the whole
group locally and compare it with what the collective gave it. Losses are sum_r <y_r, w_r> with a
different w_r per rank (a partial gradient on each rank), except after reduce_from_group, whose identity
backward assumes the replicated result feeds the same loss on every rank.
"""

import pytest
import torch

from distlab import comm


def _x(rank, shape=(6, 4, 3), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1000 + rank), dtype=torch.float64)


def mappings_vs_formulas():
    r, n = comm.group_rank(), comm.group_size()
    xs = [_x(s) for s in range(n)]                 # every rank's input
    ws = [_x(s, seed=1) for s in range(n)]         # every rank's loss weight for a same-shape output
    checks = {}

    def grad_of(fn, x, w):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        (y * w).sum().backward()
        return y.detach(), x.grad

    # copy_to_group: identity; grad = sum of the ranks' partial grads
    y, g = grad_of(lambda x: comm.copy_to_group(x), xs[r], ws[r])
    checks["copy"] = torch.equal(y, xs[r]) and torch.allclose(g, sum(ws))
    # reduce_from_group: sum; grad = the (replicated) upstream grad
    y, g = grad_of(lambda x: comm.reduce_from_group(x), xs[r], ws[0])
    checks["reduce"] = torch.allclose(y, sum(xs)) and torch.equal(g, ws[0])
    for dim in (0, 1):
        # all_gather along dim: cat; grad = this rank's slice of the summed grads
        wg = [torch.cat([_x(s, seed=2 + t) for t in range(n)], dim) for s in range(n)]
        y, g = grad_of(lambda x: comm.all_gather(x, None, dim), xs[r], wg[r])
        checks[f"all_gather{dim}"] = torch.equal(y, torch.cat(xs, dim)) and torch.allclose(g, sum(wg).chunk(n, dim)[r])
        # reduce_scatter along dim (size divisible by n): slice of the sum; grad = all ranks' w concatenated
        xr = [torch.cat([_x(s, seed=5 + t) for t in range(n)], dim) for s in range(n)]
        y, g = grad_of(lambda x: comm.reduce_scatter(x, None, dim), xr[r], ws[r])
        checks[f"reduce_scatter{dim}"] = torch.allclose(y, sum(xr).chunk(n, dim)[r]) and torch.equal(g, torch.cat(ws, dim))
        # split_to_group: keep my slice of a replicated x; grad = all ranks' w concatenated
        y, g = grad_of(lambda x: comm.split_to_group(x, None, dim), xr[0], ws[r])
        checks[f"split{dim}"] = torch.equal(y, xr[0].chunk(n, dim)[r]) and torch.equal(g, torch.cat(ws, dim))
    # all_to_all, sequence shards -> head shards (Ulysses): scatter dim 2 (heads), gather dim 1 (seq)
    xa = [_x(s, shape=(2, 3, 2 * n, 4)) for s in range(n)]
    wa = [_x(s, shape=(2, 3 * n, 2, 4), seed=9) for s in range(n)]
    y, g = grad_of(lambda x: comm.all_to_all(x, None, scatter_dim=2, gather_dim=1), xa[r], wa[r])
    full = torch.cat(xa, 1)
    checks["all_to_all"] = torch.equal(y, full.chunk(n, 2)[r]) and torch.equal(g, torch.cat(wa, 2).chunk(n, 1)[r])
    return checks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mappings_match_one_device(pools, world):
    for rank, checks in enumerate(pools(world).run(mappings_vs_formulas)):
        assert all(checks.values()), f"rank {rank}: {checks}"


def logged_bytes():
    n = comm.group_size()
    x = torch.zeros(n * 10, dtype=torch.float32)       # 40n bytes
    with comm.CommLog() as log:
        comm.all_reduce_raw(x)
        comm.all_gather_raw(x[:10])
        comm.reduce_scatter_raw(x)
        comm.all_to_all_raw(x)
        comm.all_reduce_raw(x)
    return dict(log.calls), dict(log.bytes)


@pytest.mark.parametrize("world", [2, 4])
def test_comm_log_counts_calls_and_ring_algorithm_bytes(pools, world):
    n, payload = world, 40 * world
    for calls, nbytes in pools(world).run(logged_bytes):
        assert calls == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
        assert nbytes == {"all_reduce": 2 * (2 * (n - 1) * payload // n), "all_gather": (n - 1) * payload // n,
                          "reduce_scatter": (n - 1) * payload // n, "all_to_all": (n - 1) * payload // n}


def ring_rotation():
    r = comm.group_rank()
    ring = comm.RingExchanger()
    a, b = torch.full((3,), float(r)), torch.full((2, 2), 10.0 * r)
    with comm.CommLog() as log:
        got_a, got_b = ring.exchange([a, b], op="test").wait()
    return got_a.tolist(), got_b.flatten().tolist(), log.calls["test"], log.bytes["test"]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_ring_exchanger_receives_from_previous_rank(pools, world):
    for r, (a, b, calls, nbytes) in enumerate(pools(world).run(ring_rotation)):
        prev = (r - 1) % world
        assert a == [float(prev)] * 3 and b == [10.0 * prev] * 4
        assert calls == 1 and nbytes == 7 * 4


def uneven_reduce_scatter():
    return comm.reduce_scatter_raw(torch.zeros(5, 2), None, 0)


def test_reduce_scatter_refuses_indivisible_dim_on_every_rank(pools):
    outcome = pools(3).run_all(uneven_reduce_scatter, timeout_s=30)
    assert all(not ok and "not divisible by group size 3" in msg for ok, msg in outcome)


def _job_and_rank(i):
    import torch.distributed as dist

    return i, dist.get_rank()


def test_pool_map_deals_the_jobs_over_the_ranks_and_keeps_their_order(pools):
    assert pools(3).map(_job_and_rank, [(i,) for i in range(7)]) == [(i, i % 3) for i in range(7)]
    assert pools(3).map(_job_and_rank, []) == []
