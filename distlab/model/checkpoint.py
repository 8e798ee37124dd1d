"""Consolidated checkpoints: saved in the one-device layout, loadable into any parallel layout.

    distlab run --nproc 4 -m distlab.train --config tp2-cp2 --checkpoint-dir ckpt --stop-after 50
    distlab run --nproc 2 -m distlab.train --config tiny --resume ckpt/step_50          # now DP 2

What is saved (with ``torch.distributed.checkpoint``) is the model's weights and AdamW's two moments,
each gathered into the one-device ``Llama``'s names and shapes (``ParallelLlama.full_tensors``), plus the
step. Every rank holds the same full tensors, so DCP writes each once. Loading builds the one-device
model from the weights and shards it for the new layout with the same code that built the old one; the
moments are sharded the same way by building two more one-device models that hold them "as weights".
A resumed run in the same layout repeats the uninterrupted run bit for bit; in another layout it follows
it to float32 summation order. The price is that each rank materialises the full state when saving and
loading — right for a lab model, not for a 70B one (which would save DTensor shards instead).

Each checkpoint folder also holds ``distlab.json``: the step and the model config it was saved with.
Loading checks the folder first (it exists, it is one ``step_N`` checkpoint, its config equals the
current one field by field) and refuses with one line that says what is wrong, before DCP reads anything.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist

from distlab.model.llama import Llama

MANIFEST = "distlab.json"


def _dcp():
    """``torch.distributed.checkpoint``, imported when a checkpoint is saved or loaded: importing it costs
    1.4 s (DTensor, sympy) in every rank of every run, most of which never checkpoint."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _is_parallel(model) -> bool:
    return hasattr(model, "full_tensors")


def _full(model, get) -> dict:
    if _is_parallel(model):
        return model.full_tensors(get)
    return {name: get(p) for name, p in model.named_parameters()}


def _buffers(model) -> dict:
    """Router buffers (bias, logit offset) under their one-device names (replicated on every rank)."""
    out = {}
    for i, block in enumerate(model.blocks):
        moe = block.moe
        if moe is not None:
            out[f"blocks.{i}.moe.router.bias"] = moe.router.bias
            out[f"blocks.{i}.moe.router.logit_offset"] = moe.router.logit_offset
    return out


def save(path, model, optimizer, step: int) -> None:
    def moment(key):
        return lambda p: optimizer.state[p][key] if key in optimizer.state.get(p, {}) else torch.zeros_like(p)

    adam_step = next((s["step"] for s in optimizer.state.values() if "step" in s), torch.tensor(0.0))
    state = {"model": {**_full(model, lambda p: p.detach()), **_buffers(model)},
             "exp_avg": _full(model, moment("exp_avg")), "exp_avg_sq": _full(model, moment("exp_avg_sq")),
             "step": torch.tensor(step), "adam_step": adam_step.detach().clone().float()}
    _dcp().save(state, checkpoint_id=path)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        with open(os.path.join(path, MANIFEST), "w") as f:
            json.dump({"step": step, "model": dataclasses.asdict(model.cfg)}, f, indent=1)
        print(f"saved checkpoint {path} (step {step})", flush=True)
    if dist.is_initialized():
        dist.barrier()   # the manifest is there before any rank goes on (or resumes from it)


def check_folder(path, cfg) -> int:
    """Refuse a path that is not a checkpoint of this model, with what would be right; return its step."""
    if not os.path.exists(path):
        raise ValueError(f"no checkpoint at {path!r} (it does not exist)")
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is a file; a checkpoint is a folder such as ckpt/step_100")
    if not os.path.exists(os.path.join(path, ".metadata")):
        steps = sorted((d for d in os.listdir(path) if d.startswith("step_")), key=lambda d: int(d[5:] or 0)
                       if d[5:].isdigit() else -1)
        if steps:
            raise ValueError(f"{path!r} is a checkpoint directory, not a checkpoint: pass one of its step folders "
                             f"({', '.join(steps)}), e.g. {os.path.join(path, steps[-1])}")
        raise ValueError(f"{path!r} is not a checkpoint (no .metadata); a checkpoint is a step_N folder that "
                         "distlab.train --checkpoint-dir wrote")
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        raise ValueError(f"{path!r} has no {MANIFEST} (incomplete, or not written by distlab.train)")
    with open(manifest) as f:
        saved = json.load(f)
    now = dataclasses.asdict(cfg)
    diff = [f"{k}: saved {saved['model'].get(k)!r}, now {now.get(k)!r}" for k in sorted(set(now) | set(saved["model"]))
            if saved["model"].get(k) != now.get(k)]
    if diff:
        raise ValueError(f"checkpoint {path!r} holds another model than this config's ({'; '.join(diff)}); "
                         "use the config it was trained with")
    return int(saved["step"])


def load_weights(path, cfg) -> Llama:
    """Only the weights (and router buffers) of a checkpoint, as the one-device ``Llama`` (for inference)."""
    check_folder(path, cfg)
    model = Llama(cfg)
    state = {"model": dict(model.state_dict())}
    _dcp().load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return model


def load(path, cfg, build, make_optimizer):
    """(model, optimizer, step): ``build(one_device_llama)`` returns the model in the wanted layout."""
    check_folder(path, cfg)
    template_model = Llama(cfg)
    template = {"model": dict(template_model.state_dict()),
                "exp_avg": {n: torch.zeros_like(p) for n, p in template_model.named_parameters()},
                "exp_avg_sq": {n: torch.zeros_like(p) for n, p in template_model.named_parameters()},
                "step": torch.tensor(0), "adam_step": torch.tensor(0.0)}
    _dcp().load(template, checkpoint_id=path)
    ref = Llama(cfg)
    ref.load_state_dict(template["model"])
    model = build(ref)
    optimizer = make_optimizer(model)
    for key in ("exp_avg", "exp_avg_sq"):
        holder = Llama(cfg)
        holder.load_state_dict({**template["model"], **template[key]})
        for p, q in zip(model.parameters(), build(holder).parameters()):
            optimizer.state[p][key] = q.detach().clone()
            optimizer.state[p]["step"] = template["adam_step"].clone()
    return model, optimizer, int(template["step"])
