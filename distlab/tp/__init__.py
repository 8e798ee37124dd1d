"""Tensor and sequence parallelism: parallel linears, SP RMSNorm, vocab-parallel loss, the TP Llama block.

    distlab run --nproc 4 -m distlab.tp --hidden 512 --ffn 1536 --heads 8 --kv-heads 2 --seq 1024 --sp --check
"""

from distlab.tp.block import LlamaBlock, TPLlamaBlock
from distlab.tp.linear import ColumnParallelLinear, RowParallelLinear
from distlab.tp.norm import RMSNorm
from distlab.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "RMSNorm", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "LlamaBlock", "TPLlamaBlock"]
