"""Megatron-style tensor-parallel linears: ColumnParallelLinear and RowParallelLinear, with SP.

    python -m pytest tests/test_tp.py -k linear

A column-parallel linear keeps rows ``[r·out/tp, (r+1)·out/tp)`` of the weight (output features split), a
row-parallel one keeps columns ``[r·in/tp, ...)`` (input features split). Used as a pair (column, then
row), the activation between them stays sharded and the pair costs one collective each way:

==========================  ======================================  ======================================
mode                        forward                                 backward
==========================  ======================================  ======================================
TP: column input            identity (``copy_to_group``)            all-reduce of dX
TP: row output              all-reduce of Y (``reduce_from_group``)  identity
SP: column input            all-gather along seq                    reduce-scatter of dX along seq (and
                                                                    the input all-gathered again for dW)
SP: row output              reduce-scatter along seq                all-gather of dY along seq
==========================  ======================================  ======================================

With sequence parallelism, activations outside the pair are sharded along the sequence (dim 1 of
``(batch, seq, hidden)``). A parameter that is replicated over TP but used on a sequence shard (the row
layer's bias; an SP RMSNorm's weight) sees only part of the data, so its gradient is all-reduced over TP:
here that is done by using it through ``copy_to_group`` (identity forward, all-reduce backward).

Fused projections (QKV, gate/up) are several matrices stacked along the output features; ``segments``
gives their sizes, and each segment is split across ranks on its own, so rank r holds its q heads, its kv
heads and its half of gate and of up — not a contiguous slice of the stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab import comm
from distlab.tp.async_tp import all_gather_matmul, matmul_reduce_scatter


class _GatherLinear(torch.autograd.Function):
    """SP column GEMM that keeps only the local shard for backward (re-gathers it there, as Megatron does):
    saving the gathered input would undo most of the memory SP saves."""

    @staticmethod
    def forward(ctx, x_local, weight, group):
        ctx.save_for_backward(x_local, weight)
        ctx.group = group
        return F.linear(comm.all_gather_raw(x_local, group, 1), weight)

    @staticmethod
    def backward(ctx, dy):
        x_local, weight = ctx.saved_tensors
        x_full = comm.all_gather_raw(x_local, ctx.group, 1)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x_full.reshape(-1, x_full.shape[-1])
        dx = comm.reduce_scatter_raw(dy @ weight, ctx.group, 1)
        return dx, dw, None


def check_input(layer, x, features: int) -> None:
    """Before a TP linear's first collective: the same input shape and dtype on every rank of its group (else
    the same ValueError everywhere), then a real tensor with ``features`` input features in the weight's
    dtype (any dtype under autocast)."""
    comm.check_same_on_every_rank(type(layer).__name__, comm.tensor_signature(x), layer.group,
                                  comm.describe_signature)
    name = type(layer).__name__
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"{name}: the input must be a tensor (..., {features}); got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.device.type == "meta":
        raise ValueError(f"{name}: the input is a meta tensor (a shape without data)")
    if x.shape[-1] != features:
        raise ValueError(f"{name}: the input has {x.shape[-1]} features; this layer takes {features}")
    if x.dtype != layer.weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"{name}: the input is {x.dtype}, the weight {layer.weight.dtype} (cast one, or use autocast)")
    if layer.sequence_parallel and x.dim() != 3:
        raise ValueError(f"{name}: with sequence parallelism the input is (batch, seq shard, features); got "
                         f"{tuple(x.shape)}")


def _check_divides(name: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(f"{name} ({size}) is not divisible by the tensor-parallel size {tp}")


def shard_rows(weight: torch.Tensor, rank: int, tp: int, segments=None) -> torch.Tensor:
    """Rows of ``weight`` (out, in) that rank ``rank`` holds; each segment of ``segments`` split separately."""
    segments = segments or [weight.shape[0]]
    if sum(segments) != weight.shape[0]:
        raise ValueError(f"segments {segments} do not add up to the {weight.shape[0]} output features")
    pieces = []
    for seg in torch.split(weight, list(segments), dim=0):
        _check_divides("a fused segment's output features", seg.shape[0], tp)
        pieces.append(seg.chunk(tp, 0)[rank])
    return torch.cat(pieces, 0)


class ColumnParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with the output features split over ``group``.

    Input: replicated ``(..., in)``, or with ``sequence_parallel`` this rank's sequence shard
    ``(batch, seq/tp, in)``. Output: ``(..., out/tp)`` (full sequence), or ``(..., out)`` with
    ``gather_output`` (then replicated).
    """

    def __init__(self, in_features, out_features, bias=True, group=None, gather_output=False,
                 sequence_parallel=False, segments=None, device=None, dtype=None, async_tp=False):
        super().__init__()
        if async_tp and not sequence_parallel:
            raise ValueError("async_tp overlaps the sequence-parallel all-gather: it needs sequence_parallel")
        self.async_tp = async_tp
        self.group, self.tp = group, comm.group_size(group)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.segments = list(segments) if segments else [out_features]
        if sum(self.segments) != out_features:
            raise ValueError(f"segments {self.segments} do not add up to out_features {out_features}")
        for seg in self.segments:
            _check_divides("output features" if len(self.segments) == 1 else "a fused segment's output features",
                           seg, self.tp)
        if gather_output and len(self.segments) > 1:
            raise ValueError("gather_output of a fused (segmented) projection would interleave the segments")
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features // self.tp, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features // self.tp, device=device, dtype=dtype)) if bias else None
        torch.nn.init.normal_(self.weight, std=in_features ** -0.5)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group=None, gather_output=False, sequence_parallel=False,
                    segments=None, async_tp=False):
        """This rank's shard of a full ``nn.Linear`` (same numbers as the one-device layer)."""
        tp, rank = comm.group_size(group), comm.group_rank(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, gather_output,
                    sequence_parallel, segments, linear.weight.device, linear.weight.dtype, async_tp)
        with torch.no_grad():
            layer.weight.copy_(shard_rows(linear.weight, rank, tp, layer.segments))
            if linear.bias is not None:
                layer.bias.copy_(shard_rows(linear.bias[:, None], rank, tp, layer.segments)[:, 0])
        return layer

    def forward(self, x):
        check_input(self, x, self.in_features)
        if self.async_tp:
            y = all_gather_matmul(x, self.weight, self.group)
            return y + self.bias if self.bias is not None else y
        if self.sequence_parallel:
            y = _GatherLinear.apply(x, self.weight, self.group)
            y = y + self.bias if self.bias is not None else y
        else:
            y = F.linear(comm.copy_to_group(x, self.group), self.weight, self.bias)
        return comm.gather_from_group(y, self.group, dim=-1) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with the input features split over ``group``.

    Input: ``(..., in/tp)`` (``input_is_parallel``) or replicated ``(..., in)`` (split here). Output:
    replicated ``(..., out)``, or with ``sequence_parallel`` this rank's sequence shard ``(batch, seq/tp, out)``.
    The bias is added once, after the reduction.
    """

    def __init__(self, in_features, out_features, bias=True, group=None, input_is_parallel=True,
                 sequence_parallel=False, device=None, dtype=None, async_tp=False):
        super().__init__()
        if async_tp and not sequence_parallel:
            raise ValueError("async_tp overlaps the sequence-parallel reduce-scatter: it needs sequence_parallel")
        self.async_tp = async_tp
        self.group, self.tp = group, comm.group_size(group)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel (the column layer before it keeps the shard)")
        _check_divides("input features", in_features, self.tp)
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features // self.tp, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        torch.nn.init.normal_(self.weight, std=in_features ** -0.5)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group=None, input_is_parallel=True, sequence_parallel=False,
                    async_tp=False):
        tp, rank = comm.group_size(group), comm.group_rank(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, input_is_parallel,
                    sequence_parallel, linear.weight.device, linear.weight.dtype, async_tp)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(tp, 1)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        check_input(self, x, self.in_features // self.tp if self.input_is_parallel else self.in_features)
        if not self.input_is_parallel:
            x = comm.split_to_group(x, self.group, dim=-1)
        if self.async_tp:
            y = matmul_reduce_scatter(x, self.weight, self.group)
            bias = comm.copy_to_group(self.bias, self.group) if self.bias is not None else None
            return y + bias if bias is not None else y
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = comm.reduce_scatter(y, self.group, dim=1)
            bias = comm.copy_to_group(self.bias, self.group) if self.bias is not None else None
        else:
            y = comm.reduce_from_group(y, self.group)
            bias = self.bias
        return y + bias if bias is not None else y
