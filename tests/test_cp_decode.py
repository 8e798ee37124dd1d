"""Context-parallel decode against one-device attention over the whole (growing) cache."""

import pytest
import torch

from distlab import comm
from distlab.cp.decode import KVCacheShard, cp_decode_attention
from distlab.kernels.attention import attention_forward


def decode_steps(heads, kv_heads, cache_len, steps, uneven):
    w, r = comm.group_size(), comm.group_rank()
    g = torch.Generator().manual_seed(4)
    k_all = torch.randn(2, cache_len + steps, kv_heads, 8, generator=g, dtype=torch.float64)
    v_all = torch.randn(2, cache_len + steps, kv_heads, 8, generator=g, dtype=torch.float64)
    q_all = torch.randn(2, steps, heads, 8, generator=g, dtype=torch.float64)
    if uneven:   # rank 0 holds nothing at first, the last rank the most
        bounds = [0] + [cache_len * (i * (i + 1)) // (w * (w + 1)) for i in range(1, w + 1)]
    else:
        bounds = [cache_len * i // w for i in range(w + 1)]
    mine = slice(bounds[r], bounds[r + 1])
    cache = KVCacheShard(k_all[:, mine].float(), v_all[:, mine].float(), None, cache_len)
    errors = []
    with comm.CommLog() as log:
        for step in range(steps):
            pos = cache_len + step
            cache.append(k_all[:, pos:pos + 1].float(), v_all[:, pos:pos + 1].float())
            out = cp_decode_attention(q_all[:, step:step + 1].float(), cache)
            ref, _ = attention_forward(q_all[:, step:step + 1], k_all[:, :pos + 1], v_all[:, :pos + 1], backend="torch")
            errors.append(((out.double() - ref).abs().max() / ref.abs().max()).item())
    return max(errors), dict(log.calls), cache.k.shape[1] - (bounds[r + 1] - bounds[r])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven-with-empty-shard"])
def test_cp_decode_matches_one_device_for_32_steps(pools, world, heads, kv_heads, uneven):
    results = pools(world).run(decode_steps, heads, kv_heads, 24, 32, uneven)
    for err, calls, appended in results:
        assert err < 1e-5, err
        assert calls == ({} if world == 1 else {"all_gather": 32, "all_reduce": 32})   # two collectives a step
    assert sum(a for _, _, a in results) == 32 and max(a for _, _, a in results) - min(a for _, _, a in results) <= 1


def test_cp_decode_refuses_a_query_that_does_not_fit_the_cache():
    cache = KVCacheShard(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8))
    with pytest.raises(ValueError, match="does not fit the cache"):
        cp_decode_attention(torch.zeros(1, 1, 3, 8), cache)
