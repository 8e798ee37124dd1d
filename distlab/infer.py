"""Inference: context-parallel prefill, then greedy decode with the KV cache sharded over the CP ranks.

    python -m distlab.infer --config tiny --steps 32 --check                      # one process
    distlab run --nproc 4 -m distlab.infer --config tiny --ring 4 --steps 32 --check
    distlab run --nproc 4 -m distlab.infer --config tiny --tp 2 --ring 2 --checkpoint ckpt/step_150
    distlab run --nproc 4 -m distlab.infer --config tiny --ring 4 --pack 40,64,23 --layout balanced --check

Prefill runs the prompt through the sharded model (``distlab.model.parallel``) exactly as training does —
each CP rank holds a piece of the prompt (zigzag or contiguous; ring, Ulysses or USP attention), TP splits
the heads — and every layer keeps the K/V of *this rank's* tokens as its cache shard
(``distlab.cp.decode.PagedKVCacheShard``: blocks of 16 tokens and a block table per row, attended by
``distlab.kernels.paged_attention``'s Triton kernel on a GPU; ``--kv-cache contiguous``: one growing
buffer, ``KVCacheShard``; K after RoPE). The next token comes from the logits at the prompt's
last position, held by one CP rank and shared with an all-reduce; the vocabulary is gathered over TP only
for that one row. Each decode step embeds the new token on every rank, appends its K/V to the one rank that
owns its position (round-robin), and attends it to every shard with ``cp_decode_attention`` (partial
(O, LSE) per rank, LSE-merged with two collectives). MoE layers route the token as in training.

``--pack 40,64,23`` prefills several prompts packed as documents in one CP pass (``generate_packed``) and
decodes them as a batch, each at its own position. ``--check`` decodes the same prompt with the one-device ``Llama`` (no cache: the whole sequence again at
every step) and compares the tokens and the logits. SP is a training layout (a one-token step cannot be
split over the sequence); inference uses TP without it. No anchor has CP decode (TransformerEngine
disables CP for decoding).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

from distlab import comm
from distlab.cp.decode import KVCacheShard, PagedKVCacheShard
from distlab.model import checkpoint
from distlab.model.config import load_config, load_layout
from distlab.model.data import corpus, decode, encode
from distlab.model.llama import Llama
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout, add_layout_args, init_runtime, shutdown
from distlab.bench import StudyParser, dtype_arg, positive_int, run_study, write_json


def _last_logits(model: ParallelLlama, logits, positions, last: int):
    """Full-vocabulary logits (b, vocab) at global position ``last``: one CP rank holds it, all get it."""
    b = logits.shape[0]
    here = (positions == last).nonzero().flatten() if positions is not None else torch.tensor([last])
    row = logits[:, here[0]] if len(here) else logits.new_zeros(b, logits.shape[-1])
    row = comm.all_reduce_raw(row, model.cp_group)          # zeros elsewhere: an exact copy
    return comm.all_gather_raw(row, model.tp_group, -1)       # the vocabulary, gathered over tp


class PrefillCache:
    """A block's cache during prefill: attends as the block would (CP attention over the prompt) and keeps
    this rank's K/V (after RoPE) as its shard of the cache (``shard``)."""

    def __init__(self, group, length: int, kv_cache: str = "paged", capacity: int | None = None, documents=None):
        """``documents``: packed prompts, (prompt index of each of this rank's tokens, prompt lengths)."""
        if kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"--kv-cache {kv_cache!r}: paged or contiguous")
        if documents is not None and kv_cache != "paged":
            raise ValueError("packed prompts need --kv-cache paged (each prompt's shard has its own length)")
        self.group, self.length, self.shard, self.kv_cache, self.capacity = group, length, None, kv_cache, capacity
        self.documents = documents

    def attend(self, q, k, v, attention):
        if self.kv_cache == "paged":   # blocks of 16 tokens, room for the whole generation
            self.shard = PagedKVCacheShard(k, v, self.group, next_position=self.length, capacity=self.capacity,
                                           documents=self.documents)
        else:
            self.shard = KVCacheShard(k.contiguous(), v.contiguous(), self.group, next_position=self.length)
        return attention(q, k, v)


@torch.no_grad()
def generate(model: ParallelLlama, ids, steps: int, timings: dict | None = None, kv_cache: str = "paged",
             static_step: str | None = None):
    """Greedy decode: (new tokens (b, steps), their logits (b, steps, vocab)) for this dp rank's rows of
    the global prompt batch ``ids`` (B, L). Collective: every rank of the model's mesh calls it.
    ``timings`` (a dict) receives ``prefill_s`` and ``decode_s`` (a list, one per decoded token);
    ``kv_cache``: each rank's shard in fixed-size blocks with block tables (paged) or one growing buffer;
    ``static_step``: ``"graph"`` decodes with the step captured as a CUDA graph, ``"eager"`` runs that same
    static-buffer step without capturing it (``distlab.graphed_decode``; one process, paged cache)."""
    timings = {} if timings is None else timings
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    if model.sp:
        raise ValueError("inference runs TP without sequence parallelism (build the model with sp=False)")
    length = ids.shape[1]
    piece, _, ctx = model.shard_batch(ids, ids)
    prefill = [PrefillCache(model.cp_group, length, kv_cache, length + steps) for _ in model.blocks]
    t0 = time.perf_counter()
    logits = [_last_logits(model, model(piece, positions=ctx["positions"], caches=prefill), ctx["positions"], length - 1)]
    tokens = [logits[-1].argmax(-1)]
    sync()
    timings["prefill_s"], timings["decode_s"] = time.perf_counter() - t0, []
    caches = [c.shard for c in prefill]          # KVCacheShard.attend: append the new K/V, attend every shard
    return _decode(model, tokens, logits, caches, steps, lambda step: torch.tensor([length + step - 1]), timings, sync,
                   static_step)


def _decode(model, tokens, logits, caches, steps, position, timings, sync, static_step=None):
    """Greedy steps 1..steps-1 after the prefill's first token: feed the last token at ``position(step)``
    (a (1,) or (rows, 1) tensor), through the caches; (tokens (rows, steps), logits (rows, steps, vocab))."""
    if static_step is not None:
        from distlab.graphed_decode import decode_steps

        if static_step not in ("graph", "eager"):
            raise ValueError(f"static_step {static_step!r}: graph or eager")
        return decode_steps(model, tokens[0], logits[0], caches, steps, position(1), timings,
                            capture=static_step == "graph")
    for step in range(1, steps):
        t0 = time.perf_counter()
        logits.append(comm.all_gather_raw(model(tokens[-1][:, None], positions=position(step), caches=caches)[:, 0],
                                          model.tp_group, -1))
        tokens.append(logits[-1].argmax(-1))
        sync()
        timings["decode_s"].append(time.perf_counter() - t0)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@torch.no_grad()
def generate_packed(model: ParallelLlama, prompts: list, steps: int, timings: dict | None = None,
                    static_step: str | None = None):
    """Greedy decode of several prompts prefilled as one packed sequence: the prompts are documents
    (``cu_seqlens``: no attention across them, RoPE restarting in each; a pad document fills the layout's
    multiple), cut over the CP ranks like a training pack (any layout, balanced included). Each rank keeps
    its tokens of prompt p as row p of its paged cache; then every prompt decodes at its own position, a
    batch of rows. Returns (tokens (P, steps), logits (P, steps, vocab)). Needs dp 1 (one packed row).
    ``static_step``: as ``generate``'s."""
    from distlab.cp.layout import shard_sequence

    timings = {} if timings is None else timings
    sync = torch.cuda.synchronize if prompts[0].is_cuda else (lambda: None)
    if model.sp or comm.group_size(model.dp_group) != 1:
        raise ValueError("packed prefill runs one packed row: no data parallelism, no SP")
    lengths = [len(t) for t in prompts]
    total, div = sum(lengths), model.layout.seq_len_divisor
    padded = -(-total // div) * div
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist() + ([padded] if padded > total else []))
    device = prompts[0].device
    ids = torch.cat([t.cpu() for t in prompts] + [torch.zeros(padded - total, dtype=prompts[0].dtype)])[None]
    piece, _, ctx = model.shard_batch(ids, ids, docs=[cu])           # on the host, as training cuts a pack
    piece = piece.to(device)
    where = shard_sequence(torch.arange(padded)[None], model.ring_group, model.cp_layout, 1, model.ulysses_group,
                           cu_seqlens=cu)[0]                               # global index of each local token
    doc = torch.searchsorted(cu[1:], where, right=True)                    # its prompt (len(prompts): the pad)
    prefill = [PrefillCache(model.cp_group, None, "paged", max(lengths) + steps, (doc, lengths)) for _ in model.blocks]
    t0 = time.perf_counter()
    out = model(piece, docs=ctx["docs"], positions=ctx["positions"], caches=prefill)[0]   # (local tokens, vocab/tp)
    rows = torch.stack([out[(where == int(cu[p + 1]) - 1).to(out.device)].sum(0) for p in range(len(prompts))])
    logits = [comm.all_gather_raw(comm.all_reduce_raw(rows, model.cp_group), model.tp_group, -1)]
    tokens = [logits[-1].argmax(-1)]
    sync()
    timings["prefill_s"], timings["decode_s"] = time.perf_counter() - t0, []
    caches = [c.shard for c in prefill]
    starts = torch.tensor(lengths)[:, None]                               # each prompt at its own position
    return _decode(model, tokens, logits, caches, steps, lambda step: starts + step - 1, timings, sync, static_step)


@torch.no_grad()
def greedy_reference(model: Llama, ids, steps: int):
    """The one-device greedy decode without a cache: (tokens (B, steps), logits (B, steps, vocab))."""
    tokens, logits = [], []
    for _ in range(steps):
        logits.append(model(ids)[:, -1])
        tokens.append(logits[-1].argmax(-1))
        ids = torch.cat([ids, tokens[-1][:, None]], 1)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def pack_prompts(spec: str, kv_cache: str, layout: Layout) -> list:
    """``--pack 40,64,23``: prompts of those lengths, consecutive slices of the shipped corpus."""
    try:
        lengths = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--pack {spec!r}: comma-separated prompt lengths, e.g. 40,64,23") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--pack {spec!r}: every prompt needs at least one token")
    if kv_cache != "paged":
        raise ValueError("--pack needs --kv-cache paged (each prompt's shard has its own length)")
    if layout.dp != 1:
        raise ValueError(f"--pack prefills one packed row: the layout leaves {layout.dp} data-parallel ranks "
                         "(give the world to tp x ring x ulysses)")
    text, start, out = corpus(), 0, []
    if sum(lengths) > len(text):
        raise ValueError(f"--pack {spec!r}: {sum(lengths)} tokens in all, but the corpus has {len(text)}")
    for n in lengths:
        out.append(text[start:start + n])
        start += n
    return out


def prompt_ids(text, length: int, batch: int, multiple: int):
    """(B, L) prompt: ``text`` (or the start of the shipped corpus, ``length`` bytes) left-trimmed to a
    multiple of ``multiple`` (what the CP layout needs), repeated over the batch."""
    ids = encode(text) if text is not None else corpus()[:length]
    keep = len(ids) // multiple * multiple
    if keep == 0:
        raise ValueError(f"the prompt has {len(ids)} tokens; the layout needs a multiple of {multiple}")
    return ids[len(ids) - keep:][None].repeat(batch, 1)


def main(argv=None):
    p = StudyParser(prog="python -m distlab.infer", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a preset in configs/, a JSON path (its model section) or a "
                   "checkpoint folder; default: the --checkpoint's model, else tiny")
    p.add_argument("--checkpoint", default=None, help="a training checkpoint (…/step_N); default: the seeded init")
    p.add_argument("--prompt", default=None, help="prompt text (default: the first --prompt-len corpus bytes)")
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--batch", type=positive_int, default=1, help="prompt copies (split over the data-parallel ranks)")
    p.add_argument("--pack", default=None, metavar="L1,L2,...",
                   help="prefill prompts of these lengths (consecutive corpus slices) packed as documents")
    p.add_argument("--steps", type=positive_int, default=32, help="tokens to generate")
    add_layout_args(p, sp=False)
    p.add_argument("--dtype", type=dtype_arg("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--check", action="store_true", help="compare with the one-device model's greedy decode")
    p.add_argument("--kv-cache", choices=("paged", "contiguous"), default="paged", help="each rank's cache shard "
                   "in 16-token blocks with block tables (default), or one growing buffer")
    p.add_argument("--cuda-graph", action="store_true", help="decode with the whole step captured as one CUDA "
                   "graph (distlab.graphed_decode: one GPU process, dense model, paged cache)")
    p.add_argument("--json", metavar="PATH", help="write tokens, timings and the check (rank 0)")
    p.add_argument("--device", default=None)
    a = p.parse_args(argv)
    rt = init_runtime(device=a.device)
    # bad input raises ValueError here, on every rank, before any collective
    if a.config is None:
        a.config = a.checkpoint if a.checkpoint and os.path.isfile(os.path.join(a.checkpoint, "distlab.json")) else "tiny"
    mcfg, tcfg = load_config(a.config)
    preset = {k: v for k, v in load_layout(a.config).items() if k != "sp"}   # SP is a training layout
    layout = Layout.from_args(a, rt.world_size, preset, a.batch)
    prompts = pack_prompts(a.pack, a.kv_cache, layout) if a.pack else None
    static = "graph" if a.cuda_graph else None
    if a.cuda_graph:
        from distlab.graphed_decode import check_graphable

        check_graphable(mcfg, layout, a.kv_cache, rt.device)
    if layout.cp_layout == "balanced" and prompts is None:
        raise ValueError("infer prefills one prompt: use --layout zigzag or contiguous (balanced is for --pack)")
    if layout.ring == 1 and layout.cp_layout != "balanced":
        layout = dataclasses.replace(layout, cp_layout="contiguous")
    layout_name = layout.cp_layout
    ids = torch.cat(prompts)[None] if prompts else prompt_ids(a.prompt, a.prompt_len, a.batch, layout.seq_len_divisor)
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(tcfg.seed)
    if a.checkpoint:
        checkpoint.check_folder(a.checkpoint, mcfg)
    elif rt.is_main:
        print(f"note: no --checkpoint: decoding from the seeded random initialisation of {a.config!r} "
              "(train one with python -m distlab.train --config tiny --checkpoint-dir ckpt)", flush=True)
    ref = checkpoint.load_weights(a.checkpoint, mcfg) if a.checkpoint else Llama(mcfg)
    ref = ref.to(rt.device, dtype)
    model = ParallelLlama(ref, layout, layout.build_mesh(rt.device.type))
    if prompts:
        run = lambda n, t=None: generate_packed(model, [q.to(rt.device) for q in prompts], n, t, static)  # noqa: E731
    else:
        run = lambda n, t=None: generate(model, ids.to(rt.device), n, t, a.kv_cache, static)             # noqa: E731
    run(2)   # warm-up (allocator, kernels, groups)
    timings = {}
    tokens, logits = run(a.steps, timings)
    decode_ms = sorted(timings["decode_s"])[len(timings["decode_s"]) // 2] * 1e3 if timings["decode_s"] else 0.0
    tokens = comm.all_gather_raw(tokens, model.dp_group, 0).cpu()
    logits = comm.all_gather_raw(logits, model.dp_group, 0).float().cpu()
    result = {"world_size": rt.world_size, "layout": layout.degrees(), "cp_layout": layout_name, "dtype": a.dtype,
              "kv_cache": a.kv_cache, "cuda_graph": a.cuda_graph,
              "prompt_tokens": ids.shape[1], "steps": a.steps, "tokens": tokens.tolist(),
              "prefill_s": timings["prefill_s"], "decode_ms_per_token_median": decode_ms}
    if a.check:
        if prompts:   # each prompt alone on one device
            refs = [greedy_reference(ref, q[None].to(rt.device), a.steps) for q in prompts]
            ref_tokens, ref_logits = torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs])
        else:
            ref_tokens, ref_logits = greedy_reference(ref, ids.to(rt.device), a.steps)
        ref_logits = ref_logits.float().cpu()
        same = int((tokens == ref_tokens.cpu()).all(0).long().cumprod(0).sum())
        err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        result.update(same_tokens=same, logits_max_rel_err=err)
    if rt.is_main:
        shown = " x ".join(f"{k} {v}" for k, v in layout.degrees().items())
        print(f"greedy decode on {rt.world_size} rank(s) ({shown}, {layout_name}), {rt.device}, {a.dtype}"
              f"{', CUDA-graphed step' if a.cuda_graph else ''}: "
              f"prompt {ids.shape[1]} tokens{f' (packed: {a.pack})' if prompts else ''}, {a.steps} new")
        print(f"prefill {timings['prefill_s'] * 1e3:.1f} ms ({ids.numel() / timings['prefill_s']:,.0f} tok/s), "
              f"decode {decode_ms:.2f} ms/token (median)")
        print(f"prompt : {decode(ids[0])!r}")
        print(f"decoded: {decode(tokens[0])!r}")
        if a.check:
            ok = same == a.steps
            print(f"check vs one-device greedy: {same}/{a.steps} tokens equal, logits max rel error {err:.2e}: "
                  f"{'PASS' if ok else 'FAIL'}")
        if a.json:
            write_json(a.json, result)
    shutdown()
    if a.check and same != a.steps:
        sys.exit(1)


if __name__ == "__main__":
    run_study(main)
