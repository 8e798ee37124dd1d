"""Byte-level data: the tokenizer is the identity on UTF-8 bytes; the corpus ships with the repository.

    python -m distlab.train --config tiny

The corpus is distlab's own documentation and source (``README.md``, ``docs/``, ``distlab/``), read in a
fixed order, so a CPU run has real text to learn from without a download. Batches are drawn with a seeded
generator from the step number, so any step's batch can be recomputed after a restart.

Packed batches (``distlab.train --pack``): each file is a document. A row is the same random window as
``batch`` draws, with the boundaries of the documents inside it as its ``cu_seqlens``; the target of a
document's last token (the next document's first byte) is ignored (-100), since nothing in one document
may predict another.
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
    return corpus_documents()[0]


def corpus_documents() -> tuple[torch.Tensor, torch.Tensor]:
    """(the corpus, the offset where each of its documents — files — starts)."""
    paths = [os.path.join(ROOT, "README.md")]
    for sub in ("docs", "distlab"):
        for folder, _, files in sorted(os.walk(os.path.join(ROOT, sub))):
            paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith((".md", ".py"))]
    text = []
    for p in paths:
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                text.append(f.read())
    pieces = [encode(t + "\n\n") for t in text]
    starts = torch.tensor([0] + [len(p) for p in pieces[:-1]]).cumsum(0)
    return torch.cat(pieces)[:-2], starts


def batch(data: torch.Tensor, step: int, batch_size: int, seq: int, seed: int = 0):
    """(ids, targets) of shape (batch_size, seq) for ``step``: random windows, targets shifted by one."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g)
    windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def packed_batch(data: torch.Tensor, doc_starts: torch.Tensor, step: int, batch_size: int, seq: int, seed: int = 0):
    """(ids, targets, docs): ``batch``'s windows, each row's documents as cu_seqlens (a list), and the
    targets that would cross into the next document set to -100."""
    ids, targets = batch(data, step, batch_size, seq, seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g)   # batch's own windows
    docs, targets = [], targets.clone()
    for row, s in enumerate(starts.tolist()):
        inside = doc_starts[(doc_starts > s) & (doc_starts < s + seq)] - s
        cu = torch.cat([torch.tensor([0]), inside, torch.tensor([seq])])
        targets[row, cu[1:-1] - 1] = -100
        docs.append(cu)
    return ids, targets, docs
