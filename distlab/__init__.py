"""distlab: a distributed training-inference lab (TP/SP, ring/zigzag/Ulysses/USP attention, MoE EP)."""

__version__ = "0.1.0"
