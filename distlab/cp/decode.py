"""Context-parallel decode: the KV cache stays sharded over the CP ranks; partial results are LSE-merged.

    distlab run --nproc 4 -m distlab.cp.decode --cache 16384 --steps 32 --check

After a context-parallel prefill each rank holds the K/V of its own tokens. For a new token, rank r
attends the token's query to its cache shard only, giving (o_r, lse_r); the attention over the whole
cache is their log-sum-exp merge:

    lse = log Σ_r exp(lse_r),   o = Σ_r exp(lse_r − lse) · o_r

computed with two collectives per step: an all-gather of the small LSE (batch × heads × new tokens,
float32), then an all-reduce of the weighted partial outputs. A rank whose shard is empty contributes
lse_r = −inf, i.e. weight 0. Every cached token precedes the new one, so no mask is needed; the new
token's own K/V is appended (``KVCacheShard.append``) to one rank — round-robin by position, which keeps
the shards within one token of each other — before it attends. No anchor has this (TransformerEngine
disables CP for decode).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from distlab import comm
from distlab.kernels.attention import attention_forward, check_qkv
from distlab.bench import DTYPES, StudyParser, add_common_args, positive_int, run_study, write_json


class KVCacheShard:
    """This rank's part of a KV cache: (batch, tokens, kv_heads, head_dim) K and V, grown by ``append``.

    The tokens live in buffers with spare room that double when full, so a decode step writes one row
    instead of copying the whole shard (``k``/``v`` are views of the filled part)."""

    def __init__(self, k, v, group=None, next_position=0):
        check_qkv(k, k, v, causal=False)
        self.group, self.length = group, k.shape[1]
        self._k, self._v = k, v
        self.position = next_position   # global position of the next token

    @property
    def k(self):
        return self._k[:, :self.length]

    @property
    def v(self):
        return self._v[:, :self.length]

    def owner(self, position: int) -> int:
        return position % comm.group_size(self.group)

    def append(self, k_new, v_new):
        """Add one token's K/V (batch, 1, kv_heads, head_dim) on the rank that owns its position."""
        if self.owner(self.position) == comm.group_rank(self.group):
            if self.length == self._k.shape[1]:          # full: double the room (at least 16 tokens)
                room = max(16, 2 * self.length)
                grow = lambda t: torch.cat([t[:, :self.length], t.new_empty(t.shape[0], room - self.length,  # noqa: E731
                                                                          *t.shape[2:])], 1)
                self._k, self._v = grow(self._k), grow(self._v)
            self._k[:, self.length] = k_new[:, 0]
            self._v[:, self.length] = v_new[:, 0]
            self.length += 1
        self.position += 1

    def attend(self, q, k, v, attention=None):
        """A decode step's attention through the cache (a block's ``cache``): append the new token's K/V
        (to the rank that owns its position) and attend q to every shard. ``attention`` is unused: decode
        attends the cache, not the CP method."""
        self.append(k, v)
        return cp_decode_attention(q, self)

    def local_attention(self, q, softmax_scale=None, backend="auto"):
        """(out, lse) of q over this rank's shard, or None when the shard is empty."""
        if not self.length:
            return None
        return attention_forward(q, self.k, self.v, False, softmax_scale, backend)


class PagedKVCacheShard(KVCacheShard):
    """This rank's part of the KV cache in fixed-size blocks (``distlab.kernels.paged_attention``): one paged
    sequence per batch row; a decode step appends a token to the owning rank's blocks and attends through
    the block tables (the Triton paged kernel on CUDA, the gathered reference on CPU)."""

    def __init__(self, k, v, group=None, next_position=0, capacity=None, block_size=16, documents=None):
        """``documents``: packed prompts, ``(doc, next_positions)``: ``k``/``v`` hold one packed row
        (1, n, kv_heads, head_dim) whose token i belongs to prompt ``doc[i]``; row p of the cache keeps this
        rank's tokens of prompt p (maybe none) and its next token sits at in-prompt position
        ``next_positions[p]`` (each row then decodes at its own position)."""
        from distlab.kernels.paged_attention import PagedKVCache

        check_qkv(k, k, v, causal=False)
        b, n, kvh, d = k.shape
        if documents is None:
            rows, positions = [(k[i], v[i]) for i in range(b)], [next_position] * b
        else:
            doc, positions = documents
            if b != 1 or doc.shape != (n,):
                raise ValueError(f"packed prompts: one row of K/V and a document index per token; got K "
                                 f"{tuple(k.shape)} and {tuple(doc.shape)} indices")
            doc = doc.to(k.device)
            rows = [(k[0, doc == p], v[0, doc == p]) for p in range(len(positions))]
        capacity = max(capacity or 0, max(len(r[0]) for r in rows) + 1)
        blocks = len(rows) * (-(-capacity // block_size) + 1)
        self.paged = PagedKVCache(blocks, block_size, kvh, d, k.dtype, k.device)
        for kr, vr in rows:
            self.paged.append(self.paged.new_sequence(), kr, vr)
        self.group, self.positions = group, [int(p) for p in positions]

    @property
    def k(self):
        raise AttributeError("a paged cache has no contiguous K: read it through its block tables")

    @property
    def length(self) -> int:
        """Tokens this rank holds, over every row."""
        return sum(self.paged.lengths)

    def append(self, k_new, v_new):
        """Row i's new token goes to the rank that owns its position (rows may sit at different positions)."""
        me = comm.group_rank(self.group)
        for i in range(k_new.shape[0]):
            if self.owner(self.positions[i]) == me:
                self.paged.append(i, k_new[i], v_new[i])
            self.positions[i] += 1

    def local_attention(self, q, softmax_scale=None, backend="auto"):
        from distlab.kernels.paged_attention import paged_decode, paged_decode_reference

        if not self.length:
            return None
        table, lengths = self.paged.block_tables()
        d, g = q.shape[3], q.shape[2] // self.paged.k_cache.shape[2]
        fast = q.is_cuda and not d & (d - 1) and not g & (g - 1) and backend != "torch"
        if not fast:
            return paged_decode_reference(q, self.paged.k_cache, self.paged.v_cache, table, lengths, softmax_scale)
        # tables from our own allocator: valid by construction, no host-syncing checks per layer; a packed
        # prompt with no token here gives out 0 and LSE -inf (the kernel's empty splits)
        return paged_decode(q, self.paged.k_cache, self.paged.v_cache, table, lengths, softmax_scale, check=False)


def cp_decode_attention(q, cache: KVCacheShard, softmax_scale=None, backend="auto"):
    """Attention of new queries q (batch, n, heads, head_dim) over the whole sharded cache; full output
    (batch, n, heads, head_dim) on every rank."""
    group = cache.group
    shape = cache.paged.k_cache.shape[2:] if hasattr(cache, "paged") else cache.k.shape[2:]
    rows = len(cache.paged.tables) if hasattr(cache, "paged") else cache.k.shape[0]
    if q.shape[0] != rows or q.shape[3] != shape[1] or q.shape[2] % shape[0]:
        raise ValueError(f"query {tuple(q.shape)} does not fit the cache ({rows} rows, {shape[0]} kv heads of "
                         f"{shape[1]}): batch, head_dim, q heads a multiple of kv heads")
    b, n, h, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    local = cache.local_attention(q, softmax_scale, backend)
    if local is not None:
        o, lse = local[0].to(acc), local[1].to(acc)
    else:
        o, lse = torch.zeros(b, n, h, d, dtype=acc, device=q.device), torch.full((b, h, n), float("-inf"),
                                                                                 dtype=acc, device=q.device)
    if comm.group_size(group) == 1:
        return o.to(q.dtype)
    lses = comm.all_gather_raw(lse[None], group, 0)                  # (W, b, h, n)
    total = torch.logsumexp(lses, 0)
    safe = torch.where(total == float("-inf"), 0.0, total)
    weight = torch.where(lse == float("-inf"), 0.0, torch.exp(lse - safe))   # 0 for an empty shard; NaN shows
    part = o * weight.transpose(1, 2).unsqueeze(-1)
    return comm.all_reduce_raw(part, group).to(q.dtype)


def main(argv=None):
    from distlab.runtime import init_runtime, shutdown

    p = StudyParser(prog="python -m distlab.cp.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=positive_int, default=16384, help="cached tokens before decoding (all ranks)")
    p.add_argument("--steps", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=None)
    p.add_argument("--kv-heads", type=positive_int, default=None)
    p.add_argument("--head-dim", type=positive_int, default=None)
    p.add_argument("--check", action="store_true", help="compare every step with one-device attention")
    add_common_args(p, iters=False, warmup=False)
    a = p.parse_args(argv)
    rt = init_runtime(device=a.device)
    gpu = rt.device.type == "cuda"
    h, kv, d = a.heads or (32 if gpu else 4), a.kv_heads or (8 if gpu else 2), a.head_dim or (128 if gpu else 32)
    dtype = DTYPES[a.dtype or ("bfloat16" if gpu else "float32")]
    if h % kv:
        raise ValueError(f"--heads {h} must be a multiple of --kv-heads {kv}")
    if a.cache % rt.world_size:
        raise ValueError(f"--cache {a.cache} is not divisible by the {rt.world_size} CP ranks")
    g = torch.Generator(device="cpu").manual_seed(0)
    k_all = torch.randn(a.batch, a.cache + a.steps, kv, d, generator=g)
    v_all = torch.randn(a.batch, a.cache + a.steps, kv, d, generator=g)
    q_all = torch.randn(a.batch, a.steps, h, d, generator=g)
    per = a.cache // rt.world_size
    mine = slice(rt.rank * per, (rt.rank + 1) * per)
    cache = KVCacheShard(k_all[:, mine].to(rt.device, dtype), v_all[:, mine].to(rt.device, dtype), None, a.cache)
    worst, times = 0.0, []
    for step in range(a.steps):
        pos = a.cache + step
        cache.append(k_all[:, pos:pos + 1].to(rt.device, dtype), v_all[:, pos:pos + 1].to(rt.device, dtype))
        dist.barrier()
        t0 = time.perf_counter()
        out = cp_decode_attention(q_all[:, step:step + 1].to(rt.device, dtype), cache)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if a.check:
            ref, _ = attention_forward(q_all[:, step:step + 1].double(), k_all[:, :pos + 1].double(),
                                       v_all[:, :pos + 1].double(), backend="torch")
            worst = max(worst, ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item())
    median = sorted(times)[len(times) // 2]
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 3e-2)
    passed = worst < tol
    if rt.is_main:
        print(f"CP decode, W={rt.world_size}, {rt.device}: cache {a.cache} tokens (+{a.steps} decoded), heads {h} "
              f"(kv {kv}), head_dim {d}, {str(dtype)[6:]}; per step median {median * 1e3:.3f} ms, "
              f"cache per rank {cache.k.shape[1]} tokens")
        if a.check:
            print(f"check vs one device over {a.steps} steps: max rel error {worst:.2e}: {'PASS' if passed else 'FAIL'}")
        if a.json:
            write_json(a.json, {"args": vars(a), "world_size": rt.world_size, "device": str(rt.device),
                                "step_median_s": median, "step_s": times, "cache_per_rank": cache.k.shape[1],
                                **({"max_rel_error": worst, "check_passed": passed} if a.check else {})})
    shutdown()
    if a.check and not passed:
        sys.exit(1)


if __name__ == "__main__":
    run_study(main)
