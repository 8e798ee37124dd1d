"""One unit of sharded data parallelism: a module's parameters as one flat buffer, cut in equal pieces.

    python -m pytest tests/test_zero.py

A ``FlatUnit`` (a transformer block, or the root: embedding, final norm and LM head) lays its parameters
end to end in one flat buffer (each on a 64-byte boundary), padded with zeros to a multiple of the shard group's size n, and keeps
rank r's piece ``[r·c, (r+1)·c)`` (c = padded / n) as ``shard``: the parameter AdamW updates. The module's
own parameters stay the objects the module computes with; their ``.data`` points into a full buffer while
the unit is gathered, and at an empty tensor while it is released (ZeRO-3). Autograd saves the parameter
objects, not their storage, so a parameter released after the forward and gathered again before its
backward is what the backward reads (the trick FSDP1 uses).

- ``gather(async_op)``: all-gather the pieces into a new full buffer (``Pending``; ``install`` points the
  parameters into it);
- ``release()``: the parameters drop the full buffer (ZeRO-3);
- ``reduce_scatter(grads)``: the full gradients, flattened and padded, summed over the shard group into this
  rank's piece (``Pending``);
- ``owned_pieces()``: which part of which parameter this rank's piece holds (for the gradient norm and
  checkpoints).
"""

from __future__ import annotations

import torch

from distlab import comm


class Pending:
    """A collective in flight and the buffer it fills; ``wait()`` returns the buffer."""

    def __init__(self, work, out):
        self.work, self.out = work, out

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


class FlatUnit:
    def __init__(self, name: str, params: list, group, keep_full: bool):
        """``params``: the unit's parameters (unique, one dtype and device); ``group``: the shard group;
        ``keep_full``: ZeRO-1/2 keep the full parameters resident (the buffer the pieces are gathered into
        after each optimizer step), ZeRO-3 releases them."""
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError(f"unit {name}: its parameters mix dtypes or devices; ZeRO flattens one of each")
        self.name, self.params, self.group = name, params, group
        self.n, self.rank = comm.group_size(group), comm.group_rank(group)
        self.numels = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        # each parameter starts on a 64-byte boundary, as it would in its own allocation: CPU BLAS kernels
        # round differently for other alignments, which broke bit-equality with replicated DP
        align = max(1, 64 // params[0].element_size())
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + -(-n // align) * align)
        self.numel = self.offsets[-1] + self.numels[-1]
        self.chunk = -(-self.numel // self.n)
        self.padded = self.chunk * self.n
        full = self.flatten([p.detach() for p in params])
        mine = full[self.rank * self.chunk:(self.rank + 1) * self.chunk]
        # ZeRO-1/2: the piece is a view of the resident full buffer (AdamW updates it in place); ZeRO-3: its own
        self.shard = torch.nn.Parameter(mine if keep_full else mine.clone())
        self.shard.distlab_sharding = "zero"
        self.full = full if keep_full else None
        self.gathered = keep_full
        self.install(full) if keep_full else self.release()

    def flatten(self, tensors) -> torch.Tensor:
        """The tensors laid end to end and zero-padded to the unit's padded length."""
        ref = self.params[0]
        flat = torch.zeros(self.padded, dtype=ref.dtype, device=ref.device)
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        return flat

    def views(self, flat: torch.Tensor) -> list:
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def install(self, full: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(full)):
            p.data = v
        self.gathered = True

    def release(self) -> None:
        empty = self.params[0].new_empty(0)
        for p in self.params:
            p.data = empty
        self.gathered = False

    def gather(self, piece: torch.Tensor | None = None, async_op: bool = False, out=None) -> Pending:
        """All-gather ``piece`` (default: the shard) from every rank into ``out`` (default: a new buffer; the
        piece is copied first when it is a view of ``out``)."""
        piece = self.shard.detach() if piece is None else piece
        if out is not None and piece.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            piece = piece.clone()
        out = piece.new_empty(self.padded) if out is None else out
        if self.n == 1:
            out.copy_(piece)
            return Pending(None, out)
        comm.record("all_gather", comm.sent_bytes("all_gather", out.numel() * out.element_size(), self.n))
        return Pending(comm.all_gather_into(out, piece.contiguous(), self.group, async_op), out)

    def reduce_scatter(self, grads: list, async_op: bool = False) -> Pending:
        """The sum over the shard group of the flattened ``grads`` (a zero tensor for a missing one), this
        rank's piece."""
        flat = self.flatten([g if g is not None else torch.zeros(s, dtype=self.params[0].dtype,
                                                                  device=self.params[0].device)
                             for g, s in zip(grads, self.shapes)])
        if self.n == 1:
            return Pending(None, flat)
        comm.record("reduce_scatter", comm.sent_bytes("reduce_scatter", flat.numel() * flat.element_size(), self.n))
        out = flat.new_empty(self.chunk)
        pending = Pending(comm.reduce_scatter_into(out, flat, self.group, async_op), out)
        pending.source = flat   # alive until the collective finishes
        return pending

    def owned_pieces(self):
        """(parameter, start, stop, lo, hi): this rank's piece holds elements [start, stop) of the parameter's
        flattened tensor, at [lo, hi) of the piece."""
        mine = (self.rank * self.chunk, (self.rank + 1) * self.chunk)
        for p, o, n in zip(self.params, self.offsets, self.numels):
            a, b = max(o, mine[0]), min(o + n, mine[1])
            if a < b:
                yield p, a - o, b - o, a - mine[0], b - mine[0]
