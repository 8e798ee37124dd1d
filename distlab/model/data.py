"""Byte-level data: the tokenizer is the identity on UTF-8 bytes; the corpus ships with the repository.

    python -m distlab.train --config tiny

The corpus is distlab's own documentation and source (``README.md``, ``docs/``, ``distlab/``, ``kernels/``),
read in a fixed order, so a CPU run has real text to learn from without a download. Batches are drawn
with a seeded generator from the step number, so any step's batch can be recomputed after a restart.
"""

from __future__ import annotations

import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def corpus() -> torch.Tensor:
    """All shipped text as one byte tensor (README, docs, then the Python sources, sorted)."""
    paths = [os.path.join(ROOT, "README.md")]
    for sub in ("docs", "distlab"):
        for folder, _, files in sorted(os.walk(os.path.join(ROOT, sub))):
            paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith((".md", ".py"))]
    text = []
    for p in paths:
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                text.append(f.read())
    return encode("\n\n".join(text))


def batch(data: torch.Tensor, step: int, batch_size: int, seq: int, seed: int = 0):
    """(ids, targets) of shape (batch_size, seq) for ``step``: random windows, targets shifted by one."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g)
    windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
