"""The whole model's decode step as one CUDA graph: launch overhead, the point of graphing decode (#29).

    python -m distlab.infer --config small --steps 64 --cuda-graph --check        # GPU: graphed vs one device
    python -m distlab.infer --config small --steps 64 --dtype bfloat16 --cuda-graph --json graph.json

A decode step launches a few hundred small kernels (per layer: norms, projections, RoPE, the cache append,
paged attention, the MLP) for one token per row; eager, the GPU waits for Python between them. A CUDA
graph replays the recorded launches at once, but only if nothing in the step depends on the host: so here
every input of a step lives in a static device buffer that the step itself moves on —

- the token: the step writes its argmax back into the buffer it read (greedy decode);
- the RoPE positions: ``+= 1`` in the graph;
- the cache append: each layer's paged cache (``StaticPagedCache``) has its blocks for the whole generation
  reserved before capture (``PagedKVCache.reserve``), so its block table stops changing; the new token's
  slot is computed on the device from the table and the device-side length (``table[len // block] · block
  + len % block``), written with ``index_copy_``, and the length is bumped in place;
- the outputs: logits and tokens go to row ``step`` of preallocated buffers (a device-side step counter).

So the host's work per token is one ``graph.replay()``. What it takes: one process (no CP/TP/DP: a captured
collective would need NCCL's graph support and ranks in lockstep — not here), a dense model (MoE routing
sizes its all-to-all on the host), the paged cache. ``decode_steps(..., capture=False)`` runs the very same
static-buffer step eagerly: the CPU tests check it against the ordinary decode, token for token.
"""

from __future__ import annotations

import time

import torch

from distlab.kernels.paged_attention import paged_decode, paged_decode_reference


def check_graphable(config, layout, kv_cache: str, device) -> None:
    """ValueError (before any collective) unless the decode step can be captured: see the module doc."""
    why = []
    if torch.device(device).type != "cuda":
        why.append("a CUDA device (a CUDA graph is a GPU object)")
    if layout.world_size != 1:
        why.append(f"one process (this run has {layout.world_size}: captured collectives are not supported here)")
    if kv_cache != "paged":
        why.append("--kv-cache paged")
    if config.moe_experts:
        why.append("a dense model (MoE routing sizes its all-to-all on the host)")
    d, g = config.dims_per_head, config.heads // config.kv_heads
    if d & (d - 1) or g & (g - 1):
        why.append(f"head_dim ({d}) and q heads per kv head ({g}) powers of two (the paged Triton kernel; the "
                   "reference it falls back to reads lengths on the host)")
    if why:
        raise ValueError(f"--cuda-graph needs {', '.join(why)}")


class StaticPagedCache:
    """A layer's paged cache shard (``PagedKVCacheShard``, one process) in the form a captured step can use:
    blocks for ``steps`` more tokens reserved, the device block table fixed, the lengths a device tensor the
    step advances itself. ``attend`` is the decode step's attention (as ``KVCacheShard.attend``)."""

    def __init__(self, shard, steps: int):
        paged = shard.paged
        for row in range(len(paged.tables)):
            paged.reserve(row, steps)
        self.paged, self.shard = paged, shard
        table, lengths = paged.block_tables()
        self.table = table.clone()
        self.table_long = self.table.long()
        self.lengths = lengths.clone()
        self.rows = torch.arange(len(paged.tables), device=self.table.device)

    def attend(self, q, k, v, attention=None):
        bs = self.paged.block_size
        length = self.lengths.long()
        slots = self.table_long[self.rows, length // bs] * bs + length % bs         # (rows,) on the device
        kvh, d = self.paged.k_cache.shape[2:]
        self.paged.k_cache.view(-1, kvh, d).index_copy_(0, slots, k[:, 0])
        self.paged.v_cache.view(-1, kvh, d).index_copy_(0, slots, v[:, 0])
        self.lengths.add_(1)
        if q.is_cuda:
            out, _ = paged_decode(q, self.paged.k_cache, self.paged.v_cache, self.table, self.lengths, check=False)
        else:
            out, _ = paged_decode_reference(q, self.paged.k_cache, self.paged.v_cache, self.table, self.lengths)
        return out.to(q.dtype)

    def finish(self, steps: int) -> None:
        """Hand the tokens the static steps appended back to the shard's host-side bookkeeping."""
        for row in range(len(self.paged.lengths)):
            self.paged.lengths[row] += steps
            self.shard.positions[row] += steps
        self.paged._device = None


def decode_steps(model, first_token, first_logits, caches, steps: int, position, timings: dict, capture: bool):
    """Greedy steps 1..steps-1 after the prefill's token ``first_token`` (rows,), through the static step:
    captured as a CUDA graph and replayed (``capture``), or run eagerly. ``position``: the RoPE position of
    step 1, a (1,) or (rows, 1) tensor. Returns (tokens (rows, steps), logits (rows, steps, vocab)) as
    ``distlab.infer``'s decode does; ``timings["decode_s"]`` gets each token's seconds."""
    device = first_token.device
    n = steps - 1
    static = [StaticPagedCache(c, n) for c in caches]
    token = first_token[:, None].clone()
    pos = position.to(device).clone()
    out_logits = torch.empty(max(n, 1), *first_logits.shape, dtype=first_logits.dtype, device=device)
    out_tokens = torch.empty(max(n, 1), *first_token.shape, dtype=first_token.dtype, device=device)
    index = torch.zeros(1, dtype=torch.long, device=device)

    def step():
        logits = model(token, positions=pos, caches=static)[:, 0]
        nxt = logits.argmax(-1)
        out_logits.index_copy_(0, index, logits[None])
        out_tokens.index_copy_(0, index, nxt[None])
        token.copy_(nxt[:, None])
        pos.add_(1)
        index.add_(1)

    run = step
    if capture and n:
        run = _capture(step, [token, pos, index, *(c.lengths for c in static)])
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings["decode_s"].append(time.perf_counter() - t0)
    for c in static:
        c.finish(n)
    tokens = torch.cat([first_token[:, None], out_tokens[:n].transpose(0, 1)], 1)
    logits = torch.cat([first_logits[:, None], out_logits[:n].transpose(0, 1)], 1)
    return tokens, logits


def _capture(step, state):
    """``step`` captured as a CUDA graph; its ``replay``. Warm-up runs (allocator, kernel compiles, cuBLAS
    workspaces) go on a side stream first, as PyTorch asks; they move the step's state on, so ``state`` (the
    tensors a step advances) is put back after them and after the capture (which runs nothing). The K/V
    they wrote sit in the slot the first real step overwrites."""
    saved = [t.clone() for t in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
            for t, s in zip(state, saved):
                t.copy_(s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t, s in zip(state, saved):
        t.copy_(s)
    return graph.replay
