"""Paged decode attention: a KV cache in fixed-size blocks, a block table per sequence, a decode kernel.

    python -m pytest tests/test_paged_attention.py
    distlab run --nproc 2 -m distlab.infer --config tiny --ring 2 --kv-cache paged --check   # CP decode, paged

**The cache.** ``BlockAllocator(num_blocks)`` hands out block ids (``allocate``, ``free``, reference counts
for ``fork``). ``PagedKVCache`` holds ``k_cache`` / ``v_cache`` of shape ``(num_blocks, block_size,
kv_heads, head_dim)`` and one block table per sequence; ``append(seq, k, v)`` writes a token into its
sequence's last block (a new block when it is full; a copy first when that block is shared after a
``fork``, copy-on-write), ``fork(seq)`` starts a beam that shares every block. **Layout choice**: vLLM's
documented ``k_cache [num_blocks, num_kv_heads, head_size/x, block_size, x]`` (x = 16 bytes of elements)
splits head_dim so its hand-written CUDA kernel loads 16-byte vectors of x consecutive dims of one token
while the threads of a warp walk the block's tokens. distlab keeps ``(block_size, kv_heads, head_dim)``
rows: a token's K/V for every kv head is one contiguous write at append (the cache is also where the CP
prefill copies its shard), and the Triton kernel loads a ``(block_size, head_dim)`` tile of one kv head
with row stride ``kv_heads·head_dim``: each row a contiguous 256-byte run (bf16, d 128), which Triton
vectorises itself, so the x-split buys nothing here.

**The kernel.** ``paged_decode(q, cache_k, cache_v, block_tables, lengths)`` for one new token per sequence
(``q`` (batch, 1, heads, head_dim)), GQA: one program per (sequence, kv head, split) walks its share of the
sequence's blocks through the table, 64 rows (several blocks) per step, scores the head's group of q heads
against each tile and keeps an online softmax (running max, sum, output) in float32; the splits (enough to
give every SM two programs: flash-decoding) are merged by LSE, and it returns ``(out, lse)`` so CP decode
can merge the ranks' partial results the same way. ``paged_decode_reference`` gathers the blocks and calls the attention
reference. Tables that point outside the cache, lengths past a table, shapes that disagree: ValueError.
"""

from __future__ import annotations

import math

import torch

from distlab.kernels.attention import attention_forward


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive; got {num_blocks}")
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks

    def allocate(self) -> int:
        if not self.free_ids:
            raise ValueError(f"the KV cache is full ({len(self.refs)} blocks): give more blocks")
        block = self.free_ids.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def free(self, block: int) -> None:
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_ids.append(block)


class PagedKVCache:
    def __init__(self, num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        self.block_size = block_size
        self.k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.allocator = BlockAllocator(num_blocks)
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []
        self._device = None       # (table, lengths) on the cache's device, kept current (block_tables)

    def new_sequence(self) -> int:
        self.tables.append([])
        self.lengths.append(0)
        self._device = None
        return len(self.tables) - 1

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq`` (a beam); the shared last block is copied on write."""
        for block in self.tables[seq]:
            self.allocator.share(block)
        self.tables.append(list(self.tables[seq]))
        self.lengths.append(self.lengths[seq])
        self._device = None
        return len(self.tables) - 1

    def release(self, seq: int) -> None:
        for block in self.tables[seq]:
            self.allocator.free(block)
        self.tables[seq], self.lengths[seq] = [], 0
        self._device = None

    def append(self, seq: int, k, v) -> None:
        """Write tokens (n, kv_heads, head_dim) at the end of sequence ``seq``: one copy per block they land
        in. A decode step that stays inside its block (15 of 16 steps at block size 16, or every step into
        blocks ``reserve`` allocated) leaves the table alone and bumps the device-side length in place; a new
        block or a copy on write rebuilds it."""
        i, n, table = 0, k.shape[0], self.tables[seq]
        while i < n:
            pos = self.lengths[seq]
            slot, index = pos % self.block_size, pos // self.block_size
            if index == len(table):                           # past the last block: a new one
                table.append(self.allocator.allocate())
                self._device = None
            elif self.allocator.refs[table[index]] > 1:       # shared with a fork: copy on write
                old, new = table[index], self.allocator.allocate()
                self.k_cache[new], self.v_cache[new] = self.k_cache[old], self.v_cache[old]
                self.allocator.free(old)
                table[index] = new
                self._device = None
            m = min(n - i, self.block_size - slot)
            self.k_cache[table[index], slot:slot + m] = k[i:i + m]
            self.v_cache[table[index], slot:slot + m] = v[i:i + m]
            self.lengths[seq] = pos + m
            i += m
        if self._device is not None and n:
            self._device[1][seq] += n

    def reserve(self, seq: int, tokens: int) -> None:
        """Allocate the blocks that ``tokens`` more tokens of ``seq`` will need, now (their table entries
        stop changing: what a CUDA-graphed decode step needs, ``distlab.graphed_decode``)."""
        table = self.tables[seq]
        while len(table) * self.block_size < self.lengths[seq] + tokens:
            table.append(self.allocator.allocate())
            self._device = None

    def block_tables(self, seqs=None):
        """(batch, max blocks) int32 table (unused entries -1) and (batch,) int32 lengths of ``seqs``. For every
        sequence (``seqs`` None) the device tensors are kept and returned again while no block changes: a
        decode step then copies nothing from the host (the lengths move on in place at ``append``)."""
        if seqs is None:
            if self._device is None:
                self._device = self._build(range(len(self.tables)))
            return self._device
        return self._build(seqs)

    def _build(self, seqs):
        width = max([len(self.tables[s]) for s in seqs] + [1])
        table = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for row, s in enumerate(seqs):
            table[row, :len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        lengths = torch.tensor([self.lengths[s] for s in seqs], dtype=torch.int32)
        dev = self.k_cache.device
        return table.to(dev), lengths.to(dev)


def check_paged(q, k_cache, v_cache, block_tables, lengths) -> None:
    b, n, h, d = q.shape
    nb, bs, kvh, kd = k_cache.shape
    if n != 1 or kd != d or h % kvh or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged decode: q (batch, 1, heads, d) {tuple(q.shape)} against caches {tuple(k_cache.shape)}"
                         f" / {tuple(v_cache.shape)} (num_blocks, block_size, kv_heads, d)")
    if block_tables.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"paged decode: {b} sequences, but block tables {tuple(block_tables.shape)} and lengths "
                         f"{tuple(lengths.shape)}")
    needed = (lengths.long() + bs - 1) // bs
    if bool((needed > block_tables.shape[1]).any()) or bool((lengths < 0).any()):
        raise ValueError(f"paged decode: lengths {lengths.tolist()} need more blocks than the tables hold "
                         f"({block_tables.shape[1]})")
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None] < needed[:, None]
    ids = block_tables[used]
    if bool(((ids < 0) | (ids >= nb)).any()):
        raise ValueError(f"paged decode: block tables point outside the cache's {nb} blocks: "
                         f"{ids[(ids < 0) | (ids >= nb)][:4].tolist()}")


def paged_decode_reference(q, k_cache, v_cache, block_tables, lengths, softmax_scale=None):
    """(out, lse) by gathering each sequence's blocks and calling the attention reference."""
    check_paged(q, k_cache, v_cache, block_tables, lengths)
    outs, lses = [], []
    for i in range(q.shape[0]):
        n = int(lengths[i])
        blocks = block_tables[i, :(n + k_cache.shape[1] - 1) // k_cache.shape[1]].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n][None]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n][None]
        acc = torch.promote_types(q.dtype, torch.float32)    # float32 LSE, float64 for float64 inputs
        if n == 0:
            outs.append(torch.zeros_like(q[i:i + 1]))
            lses.append(torch.full((1, q.shape[2], 1), float("-inf"), device=q.device, dtype=acc))
            continue
        o, lse = attention_forward(q[i:i + 1], k, v, False, softmax_scale, backend="torch")
        outs.append(o)
        lses.append(lse.to(acc))
    return torch.cat(outs), torch.cat(lses)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode(Q, K, V, TABLE, LENGTHS, OUT, LSE, scale, table_width, heads, kv_heads, blocks_per_split,
               BLOCK: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, STEP: tl.constexpr,
               PREC: tl.constexpr):
        """One (sequence, kv head, split): blocks [split·blocks_per_split, ...) of the sequence, STEP blocks
        (STEP·BLOCK rows, gathered through the table) per iteration; a partial (out, lse) per split."""
        seq = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2).to(tl.int64)
        splits = tl.num_programs(2).to(tl.int64)
        g = tl.arange(0, GP)                        # the group's q heads, padded to 16 rows for tl.dot
        dims = tl.arange(0, D)
        rows = tl.arange(0, STEP * BLOCK)
        q = tl.load(Q + (seq * heads + kvh * G + g)[:, None] * D + dims[None, :], mask=(g < G)[:, None], other=0.0)
        n = tl.load(LENGTHS + seq)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.cdiv(n, BLOCK))
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for j in range(first, last, STEP):
            blk = j + rows // BLOCK                                            # the block of each row
            token = blk * BLOCK + rows % BLOCK
            valid = (blk < last) & (token < n)
            block = tl.load(TABLE + seq * table_width + blk, mask=valid, other=0).to(tl.int64)
            offs = ((block * BLOCK + rows % BLOCK) * kv_heads + kvh)[:, None] * D + dims[None, :]
            k = tl.load(K + offs, mask=valid[:, None], other=0.0)
            v = tl.load(V + offs, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale                                 # (GP, STEP·BLOCK), float32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        part = (seq * splits + split) * heads + kvh * G + g
        mine = g < G
        tl.store(OUT + part[:, None] * D + dims[None, :], acc / tl.where(l > 0, l, 1.0)[:, None], mask=mine[:, None])
        tl.store(LSE + part, tl.where(l > 0, m + tl.log(l), float("-inf")), mask=mine)

    return decode


_DECODE = None


def paged_decode(q, k_cache, v_cache, block_tables, lengths, softmax_scale=None, check: bool = True,
                 splits: int | None = None):
    """(out (batch, 1, heads, d) like q, lse float32 (batch, heads, 1)); Triton (CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``). A sequence with no token gives out 0 and LSE −inf (every split of it is empty),
    as the reference does. ``check=False`` skips the table
    checks (they read the tables on the host): for a call captured in a CUDA graph, checked once before.
    ``splits``: programs per (sequence, kv head) (default: enough for ~2 programs per SM)."""
    global _DECODE
    if check:
        check_paged(q, k_cache, v_cache, block_tables, lengths)
    b, _, h, d = q.shape
    kvh = k_cache.shape[2]
    g = h // kvh
    if d & (d - 1) or g & (g - 1):
        raise ValueError(f"paged_decode: head_dim {d} and heads per kv head {g} must be powers of two")
    _DECODE = _DECODE or _kernel()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    tables = block_tables.contiguous()
    width = tables.shape[1]
    # flash-decoding: split each sequence's blocks over programs until the GPU has ~2 programs per SM
    # (sequences x kv heads alone leave most SMs idle at small batch), then merge the splits by LSE
    step = max(1, 64 // k_cache.shape[1])
    programs = b * kvh
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    splits = splits or max(1, min(-(-width // step), -(-2 * sms // programs)))
    per_split = -(-width // splits)
    per_split = -(-per_split // step) * step
    splits = -(-width // per_split)
    part_out = torch.empty(b, splits, h, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, splits, h, dtype=torch.float32, device=q.device)
    _DECODE[(b, kvh, splits)](q.contiguous(), k_cache, v_cache, tables, lengths.contiguous(), part_out, part_lse,
                              scale, width, h, kvh, per_split, BLOCK=k_cache.shape[1], D=d, G=g, GP=max(16, g),
                              STEP=step, PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    lse = torch.logsumexp(part_lse, 1)                                         # (b, h)
    weight = torch.exp(part_lse - torch.where(lse == float("-inf"), 0.0, lse)[:, None])
    out = (part_out * weight[..., None]).sum(1)
    return out[:, None].to(q.dtype), lse[..., None]


def main(argv=None):
    """GPU: the paged decode kernel's read bandwidth (K and V once) as % of a device copy, GPU and wall, eager
    and as a CUDA graph, next to one contiguous decode call of the attention backends."""
    from distlab.bench import StudyParser, add_common_args, device_of, positive_int, timeit, write_json
    from distlab.kernels.bench import copy_bandwidth

    p = StudyParser(prog="python -m distlab.kernels.paged_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--context", type=positive_int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--block-size", type=positive_int, default=16)
    add_common_args(p, iters=50, warmup=10, dtype=False, gpu_tool=True)
    a = p.parse_args(argv)
    dev = device_of(a, "the paged decode study", gpu_tool=True)
    if dev.type != "cuda":
        raise ValueError("the paged decode study times the Triton kernel: run it on a GPU")
    copy = copy_bandwidth(dev, a.iters, a.warmup)
    rows = []
    print(f"copy {copy / 1e9:.0f} GB/s; batch {a.batch}, heads {a.heads}/{a.kv_heads}, d {a.head_dim}, bf16, "
          f"blocks of {a.block_size}")
    print(f"{'context':>8} {'way':<22} {'GPU us':>8} {'wall us':>8} {'GB/s':>7} {'% copy':>7}")
    for ctx in a.context:
        per_seq = -(-ctx // a.block_size)
        blocks = a.batch * per_seq
        k_cache = torch.randn(blocks, a.block_size, a.kv_heads, a.head_dim, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device=dev, dtype=torch.int64).to(torch.int32).view(a.batch, per_seq)
        lengths = torch.full((a.batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(a.batch, 1, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16)
        nbytes = 2 * a.batch * ctx * a.kv_heads * a.head_dim * 2
        paged = lambda: paged_decode(q, k_cache, v_cache, table, lengths)   # noqa: E731
        paged()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_decode(q, k_cache, v_cache, table, lengths, check=False)
        k_flat = k_cache[table.long()].view(a.batch, -1, a.kv_heads, a.head_dim)[:, :ctx]
        v_flat = v_cache[table.long()].view(a.batch, -1, a.kv_heads, a.head_dim)[:, :ctx]
        contiguous = lambda: attention_forward(q, k_flat, v_flat, False)   # noqa: E731
        for name, fn in (("paged (Triton)", paged), ("paged, CUDA graph", graph.replay),
                         ("contiguous (auto backend)", contiguous)):
            gpu, wall = timeit(fn, a.iters, a.warmup, dev), timeit(fn, a.iters, a.warmup, dev, "wall")
            rows.append({"context": ctx, "way": name, "gpu_us": gpu * 1e6, "wall_us": wall * 1e6,
                         "GB_s": nbytes / gpu / 1e9, "pct_copy": 100 * nbytes / gpu / copy})
            r = rows[-1]
            print(f"{ctx:>8} {name:<22} {r['gpu_us']:>8.1f} {r['wall_us']:>8.1f} {r['GB_s']:>7.0f} {r['pct_copy']:>6.0f}%",
                  flush=True)
    if a.json:
        write_json(a.json, {"copy_GB_s": copy / 1e9, "args": vars(a), "rows": rows})


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
