"""Training the mini Llama: AdamW, clipping, data-parallel gradients, checkpoints that resume bit for bit.

    python -m distlab.train --config tiny                                  # one process, loss falls in ~1 min
    distlab run --nproc 2 -m distlab.train --config tiny --checkpoint-dir ckpt --json losses.json
    distlab run --nproc 2 -m distlab.train --config tiny --resume ckpt/step_100
    distlab run --nproc 4 -m distlab.train --config tiny --tp 2 --sp --ring 2
    distlab run --nproc 4 -m distlab.train --config tiny --dp-shard 4 --ac selective --memory   # ZeRO-3 + AC

Data parallelism over all ranks: every rank builds the same model from the seed, takes its slice of each
step's global batch (the batch is a pure function of the step, see ``distlab.model.data``), and the
gradients are averaged over the group in one flattened all-reduce before clipping and the AdamW step, so
every rank keeps identical weights. The learning rate warms up linearly, then follows a cosine to 10%.

Checkpoints (``distlab.model.checkpoint``: safetensors and a JSON manifest with checksums, written
atomically) hold the weights and AdamW's moments in the one-device layout, and the step. Because batches and the schedule depend only
on the step, a run resumed from step k gives exactly the losses of an uninterrupted run (tested bit for
bit on CPU), and it may resume in another layout (TP 2 × CP 2 → DP 2, say).

On a GPU the forward runs under bf16 autocast (float32 weights and AdamW) and the progress line shows MFU:
tokens/s × ``flops_per_token`` / (GPUs × the GPU's dense bf16 peak).

``--tp``, ``--sp``, ``--ring``, ``--ulysses`` shard the model itself (``distlab.model.parallel``; dp is
what remains of the world size, and MoE experts spread over dp × cp); its gradient norm for clipping is
the one-device norm. ``--dp-shard`` / ``--dp-replicate`` / ``--zero`` shard what data parallelism replicates
(ZeRO-1/2/3, HSDP: ``distlab.zero``; ``--fsdp-impl torch`` runs FSDP2 instead), ``--ac`` checkpoints the
blocks' activations, ``--fused-ce`` fuses the LM head with the loss, ``--memory`` prints each rank's bytes.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

from distlab import comm
from distlab.model import checkpoint
from distlab.model.config import ModelConfig, TrainConfig, load_config, load_layout
from distlab.model.data import batch, corpus_documents, packed_batch
from distlab.model.llama import Llama
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout, add_layout_args, init_runtime, shutdown
from distlab.bench import StudyParser, nonnegative_int, positive_int, run_study, write_json
from distlab.zero import checkpoint_blocks
from distlab.zero import memory as memory_model
from distlab.zero.memory import saved_activations
from distlab.zero.torch_fsdp import check_supported


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model, cfg: TrainConfig):
    params = model.optimizer_parameters() if hasattr(model, "optimizer_parameters") else model.parameters()
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def average_gradients(params, group=None) -> None:
    """Mean of every gradient over the data-parallel group, in one flattened all-reduce."""
    comm.all_reduce_mean_([p.grad for p in params], group)


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token, the PaLM / torchtitan convention: 6 × the weights a token multiplies
    (embedding lookup excluded; a MoE token meets top-k experts and the router) + 12 × layers × heads·head_dim (= hidden unless head_dim is set) × seq
    for attention's two matmuls (fwd + bwd, causal half not subtracted, as torchtitan counts)."""
    d = cfg.dims_per_head
    attn = cfg.hidden * (cfg.heads + 2 * cfg.kv_heads) * d + cfg.heads * d * cfg.hidden
    mlp = (cfg.moe_topk * 3 * cfg.hidden * cfg.ffn + cfg.hidden * cfg.moe_experts) if cfg.moe_experts \
        else 3 * cfg.hidden * cfg.ffn
    weights = cfg.layers * (attn + mlp) + cfg.hidden * cfg.vocab
    return 6 * weights + 12 * cfg.layers * cfg.heads * d * seq


PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "B200": 2250.0}   # dense


def peak_tflops(device) -> float | None:
    """The GPU's dense bf16 peak by product name (spec sheets), or None (no MFU shown)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def train_step(model, optimizer, ids, targets, step, cfg: TrainConfig, group=None, amp_dtype=None, ctx=None,
               memory: dict | None = None) -> float:
    """One optimizer step on this rank's share of the batch; returns the loss averaged over the ranks that
    hold different data. A sharded model (``ParallelLlama``) synchronises and clips its own gradients.
    ``amp_dtype`` (bf16 on GPU): autocast the forward, weights and optimizer stay float32. ``ctx``: the
    packed documents' keyword arguments of ``model.loss`` (``docs``, and ``positions`` for a sharded model).
    ``memory``: a dict to fill with the bytes autograd saved (``activations``) and, on CUDA, the peak
    allocated over the forward and backward above what was allocated before (``cuda_peak``)."""
    for group_ in optimizer.param_groups:
        group_["lr"] = lr_at(step, cfg)
    optimizer.zero_grad(set_to_none=False)
    cuda = memory is not None and ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with torch.autocast(ids.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None), \
            (saved_activations() if memory is not None else contextlib.nullcontext()) as saved:
        loss = model.loss(ids, targets, **(ctx or {}), label_smoothing=cfg.label_smoothing)
    loss.backward()
    if memory is not None:
        memory["activations"] = saved.bytes
        if cuda:
            memory["cuda_peak"] = torch.cuda.max_memory_allocated() - before
    if hasattr(model, "sync_gradients"):
        model.sync_gradients()
        model.clip_grad_norm(cfg.grad_clip)
        group = model.replica_group
    else:
        params = [p for p in model.parameters() if p.grad is not None]
        average_gradients(params, group)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    if hasattr(model, "after_step"):
        model.after_step()
    return (comm.all_reduce_raw(loss.detach().reshape(1), group) / comm.group_size(group)).item()


def report_memory(model, optimizer, measured, mcfg, layout, tcfg, ac, rt) -> None:
    """Every rank's held bytes next to ``distlab.zero.memory.predict``; rank 0 prints the table."""
    row = {"rank": rt.rank, "held": {**memory_model.held(model, optimizer), "activations": measured["activations"]},
           "predicted": memory_model.predict(mcfg, layout, tcfg.batch, tcfg.seq, 4, ac)}
    if "cuda_peak" in measured:
        row["cuda"] = {"activations": measured["cuda_peak"]}
    rows = [None] * rt.world_size
    dist.all_gather_object(rows, row)
    if rt.is_main:
        print(f"memory per rank after step 1 ({layout.describe()}, --ac {ac}; held = counted tensors, CUDA = peak "
              "allocated over forward+backward above the step's start):\n" + memory_model.table(rows), flush=True)


def progress(step, total, loss, tokens_per_s, width=24, mfu=None) -> str:
    done = round(width * step / total)
    line = f"[{'#' * done}{'.' * (width - done)}] step {step:>5}/{total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
    return line if mfu is None else f"{line}  MFU {100 * mfu:.1f}%"


def main(argv=None):
    p = StudyParser(prog="python -m distlab.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a preset in configs/, a JSON path, or a checkpoint folder (its "
                   "model); default: the --resume checkpoint's model, else tiny")
    p.add_argument("--steps", type=positive_int, default=None, help="override the config's steps")
    p.add_argument("--stop-after", type=positive_int, default=None, help="stop (and checkpoint) after this many steps")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=nonnegative_int, default=None,
                   help="override the config's checkpoint_every")
    p.add_argument("--resume", default=None, help="a checkpoint folder (…/step_N), or 'latest': the newest complete "
                   "one in --checkpoint-dir (none yet: start from step 0)")
    p.add_argument("--json", metavar="PATH", help="write the loss curve (rank 0)")
    p.add_argument("--device", default=None)
    add_layout_args(p, data_parallel=True)
    p.add_argument("--fsdp-impl", choices=("hand", "torch"), default="hand", help="with --dp-shard: distlab.zero's "
                   "hand-written ZeRO, or PyTorch's FSDP2 (the anchor)")
    p.add_argument("--ac", choices=("none", "full", "selective"), default="none", help="activation checkpointing "
                   "of each block (selective: the attention core and matmul outputs kept, the rest recomputed)")
    p.add_argument("--fused-ce", nargs="?", type=positive_int, const=0, default=None, metavar="CHUNK",
                   help="the LM head and the loss fused and chunked (distlab.kernels.fused_linear_ce): the logits "
                   "are never held; CHUNK rows at a time (default: a chunk's logits no bigger than the hidden states)")
    p.add_argument("--memory", action="store_true", help="print each rank's bytes of parameters, gradients, AdamW "
                   "state and activations after the first step, next to the model's prediction (and ZeRO's "
                   "collectives per step)")
    p.add_argument("--pack", action="store_true", help="packed documents: each corpus file a document, no "
                   "attention across documents, RoPE restarting in each, the loss over non-ignored targets")
    p.add_argument("--amp", choices=("bf16", "none"), default=None, help="autocast (default: bf16 on GPU, none on CPU)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default: by GPU name)")
    a = p.parse_args(argv)
    if a.config is None:
        a.config = a.resume if a.resume and os.path.isfile(os.path.join(a.resume, "distlab.json")) else "tiny"
    mcfg, tcfg = load_config(a.config)
    if a.steps:
        tcfg.steps = a.steps
    if a.checkpoint_every is not None:
        tcfg.checkpoint_every = a.checkpoint_every
    rt = init_runtime(device=a.device, seed=tcfg.seed)
    layout = Layout.from_args(a, rt.world_size, load_layout(a.config), tcfg.batch)   # ValueError on every rank
    if a.fsdp_impl == "torch":
        if not layout.sharded:
            raise ValueError("--fsdp-impl torch is the FSDP2 anchor of sharded data parallelism: give --dp-shard N")
        check_supported(layout, mcfg)
    if a.resume == "latest":
        if not a.checkpoint_dir:
            raise ValueError("--resume latest looks in --checkpoint-dir: give one")
        a.resume = checkpoint.latest(a.checkpoint_dir)
        if rt.is_main:
            print(f"--resume latest: {a.resume or f'no complete checkpoint in {a.checkpoint_dir} yet, starting at step 0'}",
                  flush=True)
    if a.resume:
        checkpoint.check_folder(a.resume, mcfg)   # before any collective: wrong, damaged or another model's
    # every multi-rank run is a ParallelLlama (dp alone too): its loss is the global batch's mean over the
    # non-ignored targets, whatever share of them each rank holds
    mesh = layout.build_mesh(rt.device.type) if rt.world_size > 1 or layout.sharded else None

    def build(ref):
        model = ParallelLlama(ref.to(rt.device), layout, mesh, a.fsdp_impl) if mesh else ref.to(rt.device)
        if a.fused_ce is not None:
            model.fused_ce = a.fused_ce or True
        return checkpoint_blocks(model, a.ac)

    if a.resume:   # consolidated checkpoint: any layout can resume any other's
        model, optimizer, start = checkpoint.load(a.resume, mcfg, build, lambda m: make_optimizer(m, tcfg))
        if rt.is_main:
            print(f"resumed from {a.resume} at step {start}", flush=True)
    else:
        torch.manual_seed(tcfg.seed)
        model = build(Llama(mcfg))
        optimizer = make_optimizer(model, tcfg)
        start = 0
    data, doc_starts = corpus_documents()
    end = min(tcfg.steps, start + a.stop_after) if a.stop_after else tcfg.steps
    amp = {"bf16": torch.bfloat16, "none": None}[a.amp or ("bf16" if rt.device.type == "cuda" else "none")]
    peak = a.peak_tflops or peak_tflops(rt.device)
    flops = flops_per_token(mcfg, tcfg.seq)
    losses, t0, tokens, rates, counts = {}, time.perf_counter(), 0, [], {}
    measured = {} if a.memory else None
    for step in range(start, end):
        ctx = None
        if a.pack:
            ids, targets, docs = packed_batch(data, doc_starts, step, tcfg.batch, tcfg.seq, tcfg.seed)
            ids, targets, ctx = model.shard_batch(ids, targets, docs) if mesh else (ids, targets, {"docs": docs})
        else:
            ids, targets = batch(data, step, tcfg.batch, tcfg.seq, tcfg.seed)
            if mesh:
                ids, targets, ctx = model.shard_batch(ids, targets)
        losses[step] = train_step(model, optimizer, ids.to(rt.device), targets.to(rt.device), step, tcfg,
                                  amp_dtype=amp, ctx=ctx, memory=measured if step == start else None)
        if getattr(model, "zero", None) is not None:   # .item() of the loss above: the step has finished here
            counts = model.zero.step_counts()
        if a.memory and step == start:
            report_memory(model, optimizer, measured, mcfg, layout, tcfg, a.ac, rt)
        tokens += tcfg.batch * tcfg.seq
        if step % tcfg.log_every == 0 or step == end - 1:   # rate over the steps since the last line
            rate = tokens / (time.perf_counter() - t0)
            mfu = rate * flops / (rt.world_size * peak * 1e12) if peak else None
            if step > start:
                rates.append((rate, mfu))
            if rt.is_main:
                print(progress(step + 1, tcfg.steps, losses[step], rate, mfu=mfu), flush=True)
            t0, tokens = time.perf_counter(), 0
        if a.checkpoint_dir and tcfg.checkpoint_every and (step + 1) % tcfg.checkpoint_every == 0 and step + 1 < end:
            checkpoint.save(os.path.join(a.checkpoint_dir, f"step_{step + 1}"), model, optimizer, step + 1)
    if a.checkpoint_dir and end > start:
        checkpoint.save(os.path.join(a.checkpoint_dir, f"step_{end}"), model, optimizer, end)
    if rt.is_main:
        if losses:
            print(f"trained steps {start}..{end - 1} on {rt.world_size} rank(s), {layout.describe()}: loss "
                  f"{losses[start]:.4f} -> {losses[end - 1]:.4f}")
        if rates:
            rate, mfu = rates[-1]
            print(f"throughput (last window): {rate:,.0f} tok/s" + (f", MFU {100 * mfu:.1f}% of {peak:g} TFLOP/s "
                  f"x {rt.world_size} ({flops / 1e9:.2f} GFLOP/token)" if mfu else ""))
        if counts:
            print(f"ZeRO-{layout.zero} per step (the last): " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        if a.json:
            write_json(a.json, {"losses": {str(k): v for k, v in losses.items()}, "world_size": rt.world_size,
                                "layout": layout.describe(), "ac": a.ac, "zero_counts": counts,
                                "tokens_per_s": [r for r, _ in rates], "mfu": [m for _, m in rates],
                                "flops_per_token": flops, "peak_tflops": peak, "device": str(rt.device)})
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    run_study(main)
