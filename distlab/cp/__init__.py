"""Context parallelism: ring, zigzag, Ulysses, USP and all-gather-KV attention, layouts, packed documents.

    from distlab.cp import ring_attention, ulysses_attention, usp_attention, allgather_attention
    from distlab.cp import shard_sequence, gather_sequence
"""

from distlab.cp.allgather import allgather_attention
from distlab.cp.documents import Documents, parse_docs
from distlab.cp.layout import LAYOUTS, gather_sequence, shard_positions, shard_sequence
from distlab.cp.merge import merge_attention
from distlab.cp.ring import ring_attention
from distlab.cp.ulysses import ulysses_attention
from distlab.cp.usp import usp_attention

__all__ = ["LAYOUTS", "Documents", "allgather_attention", "gather_sequence", "merge_attention", "parse_docs",
           "ring_attention", "shard_positions", "shard_sequence", "ulysses_attention", "usp_attention"]
