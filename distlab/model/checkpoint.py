"""Consolidated checkpoints: saved in the one-device layout, loadable into any parallel layout.

    distlab run --nproc 4 -m distlab.train --config tp2-cp2 --checkpoint-dir ckpt --stop-after 50
    distlab run --nproc 2 -m distlab.train --config tiny --resume ckpt/step_50          # now DP 2
    distlab run --nproc 2 -m distlab.train --config tiny --checkpoint-dir ckpt --resume latest

A checkpoint is a folder ``step_N`` holding three files:

- ``model.safetensors``: the weights (and MoE router buffers) under the one-device ``Llama``'s names and
  shapes (``ParallelLlama.full_tensors`` gathers them);
- ``optimizer.safetensors``: AdamW's two moments, ``exp_avg.<name>`` and ``exp_avg_sq.<name>``, in the same
  layout, and its step count (absent in a weights-only checkpoint, e.g. one converted from Hugging Face);
- ``distlab.json``: the step, the model config, and each file's size and SHA-256.

Loading builds the one-device model from the weights and shards it for the new layout with the same code
that built the old one; the moments are sharded the same way by building two more one-device models that
hold them "as weights". A resumed run in the same layout repeats the uninterrupted run bit for bit; in
another layout it follows it to float32 summation order. Each rank materialises the full state when saving
and loading: right for a lab model, not for a 70B one (which would save per-rank shards).

What a checkpoint promises (tested by fault injection in ``tests/test_faults.py``):

- **Atomic.** Rank 0 writes into a hidden ``.step_N.partial-<pid>`` folder beside the target and renames it
  into place only once every file and the manifest are written and synced. A write killed at any point
  leaves the previous checkpoints, and a previous ``step_N`` being rewritten, complete. ``--resume latest``
  takes the newest folder whose manifest is complete and says which.
- **Checked.** Loading verifies every file's size and SHA-256 against the manifest and the saved model
  config against the current one, field by field, and refuses with one line before reading a tensor.
- **Nothing executes.** Only JSON and safetensors are read (no pickle; the old ``torch.distributed.checkpoint``
  format, whose ``.metadata`` is a pickle, is refused). A crafted folder can hold wrong numbers, with
  checksums to match, but cannot run code: the checksums catch corruption, not malice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil

import torch
import torch.distributed as dist

from distlab.model.config import ModelConfig
from distlab.model.llama import Llama

MANIFEST = "distlab.json"
FORMAT = "distlab-checkpoint/2"
MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"
STEP_DIR = re.compile(r"^step_(\d+)$")


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as e:   # a core dependency: only a broken install gets here
        raise ValueError("checkpoints need the safetensors package: pip install safetensors") from e
    return safetensors.torch


def _is_parallel(model) -> bool:
    return hasattr(model, "full_tensors")


def _trained(model) -> list:
    """The tensors the optimizer steps: the parameters, or ZeRO's pieces (``distlab.zero``)."""
    return model.optimizer_parameters() if hasattr(model, "optimizer_parameters") else list(model.parameters())


def _full(model, get) -> dict:
    """``get(t)`` of every trained tensor ``t``, in the one-device names (ZeRO's pieces gathered)."""
    if getattr(model, "zero", None) is not None:
        return model.zero.full_tensors(get)
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


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host(tensors: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def write_folder(path, step: int, cfg, model_tensors: dict, optimizer_tensors: dict | None = None) -> None:
    """Write a checkpoint folder atomically (one process): files into a hidden partial folder, synced,
    then renamed over ``path``. Also what ``distlab.model.convert`` writes."""
    path = os.path.normpath(path)
    parent, name = os.path.split(path)
    parent = parent or "."
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    _restore_replaced(parent)
    for stale in os.listdir(parent):   # what a killed writer left (ours included, from a reused pid)
        if stale.startswith(f".{name}.partial-") or stale.startswith(f".{name}.replaced-"):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    os.makedirs(partial)
    files = {MODEL_FILE: model_tensors}
    if optimizer_tensors is not None:
        files[OPTIMIZER_FILE] = optimizer_tensors
    sums = {}
    for file, tensors in files.items():
        target = os.path.join(partial, file)
        _safetensors().save_file(_host(tensors), target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
        sums[file] = {"bytes": os.path.getsize(target), "sha256": _sha256(target)}
    manifest = {"format": FORMAT, "step": int(step), "model": dataclasses.asdict(cfg), "files": sums}
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
    replaced = None
    if os.path.exists(path):   # a rewrite of this step: the old folder stays whole until the new one is
        replaced = os.path.join(parent, f".{name}.replaced-{os.getpid()}")
        os.rename(path, replaced)
    os.rename(partial, path)
    _fsync_dir(parent)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)


def save(path, model, optimizer, step: int) -> None:
    """Every rank calls it (the full tensors are gathered collectively); rank 0 writes."""
    def moment(key):
        return lambda p: optimizer.state[p][key] if key in optimizer.state.get(p, {}) else torch.zeros_like(p)

    adam_step = next((s["step"] for s in optimizer.state.values() if "step" in s), torch.tensor(0.0))
    weights = {**_full(model, lambda p: p.detach()), **_buffers(model)}
    moments = {**{f"exp_avg.{n}": t for n, t in _full(model, moment("exp_avg")).items()},
               **{f"exp_avg_sq.{n}": t for n, t in _full(model, moment("exp_avg_sq")).items()},
               "adam_step": adam_step.detach().float().reshape(1)}
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        write_folder(path, step, model.cfg, weights, moments)
        print(f"saved checkpoint {path} (step {step})", flush=True)
    if dist.is_initialized():
        dist.barrier()   # the folder is in place before any rank goes on (or resumes from it)


def read_manifest(path) -> dict | None:
    """The manifest of a complete checkpoint folder, or None when there is none that parses."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    return manifest


def _restore_replaced(directory) -> None:
    """A writer killed between its two renames left ``step_N`` absent and the old one as
    ``.step_N.replaced-<pid>``: put the old one back."""
    for d in os.listdir(directory):
        m = re.match(r"^\.(step_\d+)\.replaced-\d+$", d)
        if m and not os.path.exists(os.path.join(directory, m.group(1))) \
                and read_manifest(os.path.join(directory, d)) is not None:
            try:   # every rank may try at once: the first wins
                os.rename(os.path.join(directory, d), os.path.join(directory, m.group(1)))
            except OSError:
                pass


def latest(directory) -> str | None:
    """The newest complete ``step_N`` folder in ``directory`` (by N), or None."""
    if not os.path.isdir(directory):
        return None
    _restore_replaced(directory)
    steps = sorted(((int(m.group(1)), d) for d in os.listdir(directory) if (m := STEP_DIR.match(d))), reverse=True)
    for _, d in steps:
        if read_manifest(os.path.join(directory, d)) is not None:
            return os.path.join(directory, d)
    return None


def check_folder(path, cfg, verify: bool = True) -> int:
    """Refuse a path that is not a complete, intact checkpoint of this model, with what would be right;
    return its step. ``verify``: also check every file's size and SHA-256."""
    if not os.path.exists(path):
        raise ValueError(f"no checkpoint at {path!r} (it does not exist)")
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is a file; a checkpoint is a folder such as ckpt/step_100")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        steps = sorted((d for d in os.listdir(path) if STEP_DIR.match(d)), key=lambda d: int(d[5:]))
        if steps:
            raise ValueError(f"{path!r} is a checkpoint directory, not a checkpoint: pass one of its step folders "
                             f"({', '.join(steps)}), e.g. {os.path.join(path, steps[-1])}, or --resume latest")
        raise ValueError(f"{path!r} is not a checkpoint (no {MANIFEST}); a checkpoint is a step_N folder that "
                         "distlab.train --checkpoint-dir wrote")
    manifest = read_manifest(path)
    if manifest is None:
        if os.path.exists(os.path.join(path, ".metadata")):
            raise ValueError(f"{path!r} was written by an older distlab (torch.distributed.checkpoint, whose "
                             ".metadata is a pickle, which distlab no longer reads); save it again with this one")
        raise ValueError(f"{path!r}: {MANIFEST} is damaged or not distlab's ({FORMAT})")
    now = dataclasses.asdict(cfg)
    saved = manifest.get("model", {})
    diff = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in sorted(set(now) | set(saved))
            if saved.get(k, _DEFAULTS.get(k)) != now.get(k)]
    if diff:
        raise ValueError(f"checkpoint {path!r} holds another model than this config's ({'; '.join(diff)}); "
                         "use the config it was trained with")
    files = manifest.get("files", {})
    if MODEL_FILE not in files:
        raise ValueError(f"{path!r}: the manifest lists no {MODEL_FILE}")
    for file, meta in files.items():
        target = os.path.join(path, file)
        if not os.path.exists(target):
            raise ValueError(f"{path!r}: {file} is missing")
        size = os.path.getsize(target)
        if size != meta.get("bytes"):
            raise ValueError(f"{path!r}: {file} has {size} bytes, the manifest says {meta.get('bytes')} (truncated "
                             "or replaced)")
        if verify and _sha256(target) != meta.get("sha256"):
            raise ValueError(f"{path!r}: {file} does not match its SHA-256 in {MANIFEST} (the file is corrupted)")
    return int(manifest["step"])


# a field added to ModelConfig after a checkpoint was saved reads as its default (the behaviour it had then)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def _read(path, file) -> dict:
    try:
        return _safetensors().load_file(os.path.join(path, file))
    except Exception as e:   # safetensors raises its own error types for a malformed header
        raise ValueError(f"{path!r}: {file} is not a readable safetensors file ({e})") from None


def saved_names(state: dict, cfg) -> dict:
    """The tensors of a one-device state dict that a checkpoint stores: all but a tied LM head (it is the
    embedding)."""
    return {k: v for k, v in state.items() if not (cfg.tie_embeddings and k == "head.weight")}


def saved_config(path) -> ModelConfig:
    """The model config a checkpoint folder was saved with."""
    manifest = read_manifest(path)
    if manifest is None:
        check_folder(path, ModelConfig())   # raises the right error for what the folder is
    return ModelConfig(**manifest["model"])


def check_tensor_names(path, file, got: dict, want: dict) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"{path!r}: {file} does not hold this model's tensors (missing {missing[:4]}, "
                         f"unexpected {extra[:4]})")
    bad = [f"{n} {tuple(got[n].shape)} != {tuple(t.shape)}" for n, t in want.items() if got[n].shape != t.shape]
    if bad:
        raise ValueError(f"{path!r}: {file} has tensors of other shapes ({'; '.join(bad[:4])})")


def load_weights(path, cfg) -> Llama:
    """Only the weights (and router buffers) of a checkpoint, as the one-device ``Llama`` (for inference)."""
    check_folder(path, cfg)
    model = Llama(cfg)
    state = _read(path, MODEL_FILE)
    check_tensor_names(path, MODEL_FILE, state, saved_names(model.state_dict(), cfg))
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    return model


def load(path, cfg, build, make_optimizer):
    """(model, optimizer, step): ``build(one_device_llama)`` returns the model in the wanted layout. A
    weights-only checkpoint starts AdamW afresh."""
    step = check_folder(path, cfg)
    template = Llama(cfg)
    weights = _read(path, MODEL_FILE)
    check_tensor_names(path, MODEL_FILE, weights, saved_names(template.state_dict(), cfg))
    ref = Llama(cfg)
    ref.load_state_dict(weights, strict=not cfg.tie_embeddings)
    model = build(ref)
    optimizer = make_optimizer(model)
    if not os.path.exists(os.path.join(path, OPTIMIZER_FILE)):
        return model, optimizer, step
    moments = _read(path, OPTIMIZER_FILE)
    names = dict(template.named_parameters())
    want = {f"{key}.{n}": p for key in ("exp_avg", "exp_avg_sq") for n, p in names.items()}
    want["adam_step"] = torch.zeros(1)
    check_tensor_names(path, OPTIMIZER_FILE, moments, want)
    for key in ("exp_avg", "exp_avg_sq"):
        holder = Llama(cfg)
        holder.load_state_dict({**weights, **{n: moments[f"{key}.{n}"] for n in names}}, strict=not cfg.tie_embeddings)
        for p, q in zip(_trained(model), _trained(build(holder))):
            optimizer.state[p][key] = q.detach().clone()
            optimizer.state[p]["step"] = moments["adam_step"].reshape(()).clone()
    return model, optimizer, step
