"""Context parallelism: ring, zigzag, Ulysses, USP and all-gather-KV attention, layouts, packed documents.

    from distlab.cp import ring_attention, ulysses_attention, usp_attention, allgather_attention
    from distlab.cp import shard_sequence, gather_sequence, Documents, parse_docs

The names are loaded on first use (PEP 562), so ``python -m distlab.cp.ring`` does not import the ring
module twice (once as the package's, once as ``__main__``).
"""

import importlib

_WHERE = {"allgather_attention": "allgather", "Documents": "documents", "parse_docs": "documents",
          "LAYOUTS": "layout", "gather_sequence": "layout", "shard_positions": "layout", "shard_sequence": "layout",
          "merge_attention": "merge", "ring_attention": "ring", "ulysses_attention": "ulysses",
          "usp_attention": "usp"}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'distlab.cp' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distlab.cp.{_WHERE[name]}"), name)
