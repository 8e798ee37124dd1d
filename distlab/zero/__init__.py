"""Sharded data parallelism (ZeRO-1/2/3, HSDP) and activation checkpointing for the mini Llama, by hand.

    distlab run --nproc 4 -m distlab.train --config tiny --dp-shard 4 --ac selective --memory

``ZeroEngine`` (``distlab.zero.sharded``) shards a ``ParallelLlama`` over its mesh's ``shard`` group
(``Layout(dp_shard=…, zero=…)`` builds it); ``FlatUnit`` (``distlab.zero.flat``) is one block's flat,
padded parameter buffer and its pieces; ``checkpoint_blocks`` (``distlab.zero.checkpointing``) is
``--ac none|full|selective``; ``distlab.zero.memory`` counts and predicts the bytes a rank holds.
"""

from distlab.zero.checkpointing import checkpoint_blocks
from distlab.zero.flat import FlatUnit
from distlab.zero.sharded import ZeroEngine

__all__ = ["FlatUnit", "ZeroEngine", "checkpoint_blocks"]
