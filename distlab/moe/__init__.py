"""Mixture of experts with expert parallelism: router, all-to-all dispatch/combine, grouped-GEMM experts.

    distlab run --nproc 4 -m distlab.moe --experts 8 --topk 2 --hidden 256 --ffn 512 --tokens 4096 --check
"""

from distlab.moe.dispatch import combine, dispatch
from distlab.moe.layer import MoE, MoEReference
from distlab.moe.router import Router, route

__all__ = ["MoE", "MoEReference", "Router", "route", "dispatch", "combine"]
