"""Autograd-aware collectives, the ring exchanger, and a communication log.

    python -m pytest tests/test_comm.py

Every distributed piece of distlab talks through this file. Each collective takes its process group as
an argument (``None`` = the default group); nothing here keeps parallel state.

Mappings (forward ↔ backward, as in Megatron's ``mappings.py``):

=====================  =========================  =========================
function               forward                    backward
=====================  =========================  =========================
``copy_to_group``      identity                   all-reduce
``reduce_from_group``  all-reduce                 identity
``all_gather``         all-gather along ``dim``   reduce-scatter along ``dim``
``reduce_scatter``     reduce-scatter along dim   all-gather along ``dim``
``split_to_group``     keep this rank's slice     all-gather along ``dim``
``gather_from_group``  all-gather along ``dim``   keep this rank's slice
``all_to_all``         scatter one dim, gather    the reverse all-to-all
                       another
=====================  =========================  =========================

``RingExchanger`` posts the next send to rank+1 and receive from rank−1 (``batch_isend_irecv``) and
returns a handle to wait on, so a ring algorithm computes the current block while the next travels.

``CommLog`` counts calls and bytes per operation while it is active (``with CommLog() as log: ...``).
Bytes are what *this rank sends* under the bandwidth-optimal ring algorithm for a payload of ``N`` bytes
(the full tensor) in a group of ``n``: all-reduce ``2(n-1)/n·N``, all-gather / reduce-scatter /
all-to-all ``(n-1)/n·N``, point-to-point the bytes handed to ``isend``.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------------------------------------
# communication log
# --------------------------------------------------------------------------------------------------------
_ACTIVE_LOGS: list["CommLog"] = []  # instrumentation only (like a profiler), never parallel state


@dataclasses.dataclass
class CommLog:
    """Counts collective calls and bytes sent by this rank, per operation name, while active."""

    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __enter__(self) -> "CommLog":
        _ACTIVE_LOGS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE_LOGS.remove(self)

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "total_bytes": self.total_bytes()}


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for ``op`` on ``n`` ranks: the share of the payload each rank sends
    under the bandwidth-optimal ring algorithm. The one place distlab writes these formulas (``CommLog``'s
    bytes, the playground's busbw, the trace analyser, the CP cost model)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(COLLECTIVES)}")


def sent_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends when ``op`` moves a payload of ``nbytes`` (the full tensor) among ``n`` ranks."""
    if n == 1 and op not in ("broadcast", "sendrecv"):
        return 0
    numerator = {"all_reduce": 2 * (n - 1), "broadcast": n, "sendrecv": n}.get(op)
    if numerator is None:
        bus_factor(op, n)   # unknown op: its ValueError
        numerator = n - 1
    return numerator * int(nbytes) // n


def record(op: str, nbytes: float) -> None:
    """Add one call of ``op`` sending ``nbytes`` from this rank to every active CommLog."""
    for log in _ACTIVE_LOGS:
        log.calls[op] += 1
        log.bytes[op] += int(nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


NO_GROUP = "none"  # pass as a group to run a distributed function as if on one rank


def group_size(group=None) -> int:
    if group is NO_GROUP:
        return 1
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    if group is NO_GROUP:
        return 0
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


# --------------------------------------------------------------------------------------------------------
# inputs that must agree on every rank
# --------------------------------------------------------------------------------------------------------
_DTYPE_CODES = {dt: i for i, dt in enumerate((torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                              torch.int64, torch.int32, torch.bool, torch.uint8,
                                              torch.float8_e4m3fn, torch.float8_e5m2))}
_AGREED: set = set()   # (group, what, values) already checked: a cache of facts, not parallel state
_SIGNATURE_LEN = 64


def tensor_signature(*tensors) -> tuple:
    """(ndim, *shape, dtype code, device-is-meta) per tensor: what every rank must agree on before a collective."""
    sig = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            sig += [t.dim(), *t.shape, _DTYPE_CODES.get(t.dtype, 99), int(t.device.type == "meta")]
        else:
            sig += [-1, 99, 0]
    return tuple(sig)


def describe_signature(sig) -> str:
    """``tensor_signature`` read back: '(2, 16, 4, 8) float32, ...'."""
    names = {i: str(dt).replace("torch.", "") for dt, i in _DTYPE_CODES.items()}
    out, i = [], 0
    while i < len(sig):
        n = sig[i]
        if n < 0:
            out.append("not a tensor")
            i += 3
            continue
        shape = tuple(sig[i + 1:i + 1 + n])
        out.append(f"{shape} {names.get(sig[i + 1 + n], '?')}{' meta' if sig[i + 2 + n] else ''}")
        i += n + 3
    return ", ".join(out)


def forget_agreed() -> None:
    """Forget which inputs were checked (the next call of each shape checks again)."""
    _AGREED.clear()


def check_same_on_every_rank(what: str, values, group=None, describe=str) -> None:
    """Raise the same ValueError on every rank of ``group`` unless every rank passed equal ``values`` (ints).

    Call it before anything else that communicates: a rank that was given another sequence length (say)
    would otherwise meet the others in a collective of another size, and gloo aborts that process while
    NCCL hangs. One all-gather of 64 int64 per (group, what, values), not recorded by ``CommLog``; later
    calls with values already checked cost a set lookup. So a rank whose shapes change while the others'
    do not is caught only when its new shapes are new to it: checked at the first call of each shape.
    ``group`` may be a list of groups that together span the ranks (USP's Ulysses and ring groups): each
    is checked in turn, carrying whether an earlier one disagreed, so every rank of the union raises.
    ``describe(values)`` spells a rank's values in the error."""
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
    values = tuple(int(x) for x in values)
    error, odd = None, -1
    for g in groups:
        carried = values + ((odd,) if len(groups) > 1 else ())
        spell = describe if len(groups) == 1 else (
            lambda v: describe(v[:-1]) + (f" (in its other group rank {v[-1]} differs)" if v[-1] >= 0 else ""))
        found = _disagreement(what, carried, g, spell)
        if found and error is None:
            error, odd = found
    if error:
        raise ValueError(error)


def _disagreement(what, values, group, describe) -> tuple[str, int] | None:
    n = group_size(group)
    key = (_group_key(group), what, values)
    if n == 1 or key in _AGREED:
        return None
    if len(values) >= _SIGNATURE_LEN:
        raise ValueError(f"{what}: {len(values)} values to compare across ranks; at most {_SIGNATURE_LEN - 1}")
    mine = torch.full((_SIGNATURE_LEN,), -(2**62), dtype=torch.int64)
    mine[0] = len(values)
    mine[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    every = torch.empty(n * _SIGNATURE_LEN, dtype=torch.int64, device=device)
    all_gather_into(every, mine.to(device), group)
    rows = every.view(n, _SIGNATURE_LEN).cpu().tolist()
    seen = [tuple(r[1:1 + r[0]]) if 0 <= r[0] < _SIGNATURE_LEN else None for r in rows]
    if any(v != values for v in seen):
        by_value: dict = {}
        for rank, v in enumerate(seen):
            by_value.setdefault(v, []).append(dist.get_global_rank(group, rank) if group is not None else rank)
        parts = [f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {describe(v)}" for v, r in by_value.items()]
        usual = max(by_value, key=lambda v: (len(by_value[v]), v == seen[0]))   # the majority; a tie: rank 0's
        odd = min(r for v, ranks in by_value.items() if v != usual for r in ranks)
        return (f"{what}: the ranks of the group were given different inputs ({'; '.join(parts)}); every rank "
                "must pass the same shapes and settings"), odd
    if len(_AGREED) > 4096:
        _AGREED.clear()
    _AGREED.add(key)
    return None


def _group_key(group):
    """A process group's name, not the object: holding the object past ``destroy_process_group`` kept its
    gloo threads alive until interpreter exit, which then aborted ("terminate called without an active
    exception")."""
    return None if group is None else getattr(group, "group_name", None) or id(group)


def all_gather_into(out, x, group=None, async_op: bool = False):
    """Every rank's ``x`` into ``out`` along dim 0 (not counted in a CommLog); a work handle when
    ``async_op``. torch 2.13's name with a fallback to the older one."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out, x, group=None, async_op: bool = False):
    """The sum of ``x`` over ranks, this rank's dim-0 slice into ``out`` (not counted); a work handle when
    ``async_op``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=group, async_op=async_op)


# --------------------------------------------------------------------------------------------------------
# raw collectives along a tensor dim (torch 2.13 names with a fallback to the older ones)
# --------------------------------------------------------------------------------------------------------
def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_into(out, x.contiguous(), group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group)
    return out


def all_gather_raw(x: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order). No autograd."""
    n = group_size(group)
    if n == 1:
        return x
    record("all_gather", sent_bytes("all_gather", n * _nbytes(x), n))
    return _all_gather_dim0(x.movedim(dim, 0), group).movedim(0, dim)


def reduce_scatter_raw(x: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice of ``dim``. No autograd."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    record("reduce_scatter", sent_bytes("reduce_scatter", _nbytes(x), n))
    return _reduce_scatter_dim0(x.movedim(dim, 0), group).movedim(0, dim)


def all_reduce_raw(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks (returns a new tensor). No autograd."""
    n = group_size(group)
    if n == 1:
        return x
    record("all_reduce", sent_bytes("all_reduce", _nbytes(x), n))
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def all_to_all_raw(x: torch.Tensor, group=None, scatter_dim: int = 0, gather_dim: int = 0) -> torch.Tensor:
    """Split ``scatter_dim`` into n chunks, send chunk j to rank j, concatenate received chunks on ``gather_dim``."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} is not divisible by "
                         f"group size {n}")
    record("all_to_all", sent_bytes("all_to_all", _nbytes(x), n))
    chunk_shape = list(x.shape)
    chunk_shape[scatter_dim] //= n
    first = x.movedim(scatter_dim, 0)                           # chunk j = rows [j*c, (j+1)*c) of dim 0
    send = first.reshape((n, first.shape[0] // n) + tuple(first.shape[1:])).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] is rank j's chunk, laid out with scatter_dim first; put dims back, then stack chunks on gather_dim
    recv = recv.movedim(1, scatter_dim + 1)                    # (n, *chunk_shape)
    out = recv.movedim(0, gather_dim)                           # n just before the gathered dim
    shape = list(chunk_shape)
    shape[gather_dim] *= n
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------------------
# autograd mappings
# --------------------------------------------------------------------------------------------------------
def all_reduce_mean_(tensors, group=None) -> None:
    """Replace each tensor by its mean over the group, in one flattened all-reduce (gradient averaging)."""
    n = group_size(group)
    if n == 1 or not tensors:
        return
    flat = all_reduce_raw(torch.cat([t.reshape(-1) for t in tensors]), group) / n
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def all_to_all_uneven_raw(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group=None) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:j]) : ...+in_splits[j]]`` go to rank j; ``out_splits[j]`` rows come from rank j."""
    n = group_size(group)
    if n == 1:
        return x
    row = x.element_size() * math.prod(x.shape[1:])
    me = group_rank(group)
    record("all_to_all", row * (sum(in_splits) - in_splits[me]))
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_raw(g, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_raw(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_raw(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_raw(g, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_raw(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather_raw(g, ctx.group, ctx.dim), None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_raw(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        n, r = group_size(ctx.group), group_rank(ctx.group)
        return g.chunk(n, ctx.dim)[r].contiguous(), None, None


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        n, r = group_size(group), group_rank(group)
        if x.shape[dim] % n:
            raise ValueError(f"split: dim {dim} of size {x.shape[dim]} is not divisible by group size {n}")
        return x.chunk(n, dim)[r].clone()

    @staticmethod
    def backward(ctx, g):
        return all_gather_raw(g, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return all_to_all_raw(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all_raw(g, ctx.group, gather_dim, scatter_dim), None, None, None


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.args = (in_splits, out_splits, group)
        return all_to_all_uneven_raw(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, g):
        in_splits, out_splits, group = ctx.args
        return all_to_all_uneven_raw(g.contiguous(), out_splits, in_splits, group), None, None, None


def all_to_all_uneven(x, in_splits, out_splits, group=None):
    """Uneven all-to-all of rows (MoE dispatch/combine); backward sends the gradient rows back."""
    return _AllToAllUneven.apply(x, list(in_splits), list(out_splits), group)


def copy_to_group(x, group=None):
    """Identity forward, all-reduce of the gradient backward (enter a tensor-parallel region)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x, group=None):
    """All-reduce forward, identity backward (leave a tensor-parallel region)."""
    return _ReduceFromGroup.apply(x, group)


def all_gather(x, group=None, dim=0):
    """All-gather along ``dim`` forward, reduce-scatter of the gradient backward."""
    return _AllGather.apply(x, group, dim)


def reduce_scatter(x, group=None, dim=0):
    """Reduce-scatter along ``dim`` forward, all-gather of the gradient backward."""
    return _ReduceScatter.apply(x, group, dim)


def gather_from_group(x, group=None, dim=-1):
    """All-gather along ``dim`` forward, keep this rank's slice of the gradient backward (the gathered
    tensor feeds the same, replicated computation on every rank, so its gradient is already whole)."""
    return _GatherFromGroup.apply(x, group, dim)


def split_to_group(x, group=None, dim=0):
    """Keep this rank's contiguous slice of ``dim`` forward, all-gather of the gradient backward."""
    return _SplitToGroup.apply(x, group, dim)


def all_to_all(x, group=None, scatter_dim=0, gather_dim=1):
    """All-to-all forward (scatter ``scatter_dim``, gather ``gather_dim``), the reverse all-to-all backward."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


# --------------------------------------------------------------------------------------------------------
# ring exchange
# --------------------------------------------------------------------------------------------------------
class RingExchanger:
    """Send tensors to the next rank of ``group`` and receive the same shapes from the previous one.

    ``handle = ring.exchange([k, v], op="ring_kv")`` posts all sends and receives at once and returns
    immediately; ``recv = handle.wait()`` blocks until they have arrived. Post the next exchange *before*
    computing the current block to overlap communication with compute.
    """

    def __init__(self, group=None):
        self.group = group
        self.size = group_size(group)
        self.rank = group_rank(group)
        if self.size > 1:
            pg = group if group is not None else dist.group.WORLD
            self.next = dist.get_global_rank(pg, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(pg, (self.rank - 1) % self.size)

    def exchange(self, tensors, op: str = "ring_sendrecv", recv=None) -> "_Pending":
        """``recv``: where to receive (contiguous tensors of the sent shapes, on CUDA from ``landing_buffer``:
        slices of a buffer the received blocks are read from together, ``distlab.cp.ring_landing``); by
        default new tensors. On CUDA an exchange into such buffers is posted on the side stream, as
        ``exchange_after``'s are (after the caller's queued work, which made what it sends): every write into a
        landing buffer is then on the stream whose pool it came from."""
        if self.size == 1:
            raise RuntimeError("a ring of one rank has nobody to exchange with")
        if recv and recv[0].is_cuda and torch.cuda.current_stream(recv[0].device) != self._side_stream(recv[0].device):
            side = self._side_stream(recv[0].device)
            side.wait_stream(torch.cuda.current_stream(recv[0].device))
            for t in tensors:   # the caller's tensors, sent (or made contiguous, then sent) on the side stream
                t.record_stream(side)
            with torch.cuda.stream(side):
                return self.exchange(tensors, op, recv)
        tensors = [t.contiguous() for t in tensors]
        if recv is None:
            recv = [torch.empty_like(t) for t in tensors]
        elif len(recv) != len(tensors) or any(r.shape != t.shape or r.dtype != t.dtype or not r.is_contiguous()
                                              for r, t in zip(recv, tensors)):
            raise ValueError("ring exchange: receive buffers must be contiguous and of the sent shapes and dtypes")
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recv]
        record(op, sum(_nbytes(t) for t in tensors))
        return _Pending(dist.batch_isend_irecv(ops), recv)

    def shift_exchange(self, tensors, shift: int, recv, op: str = "ring_shift") -> "_Pending":
        """Send ``tensors`` to rank − ``shift`` of the group and receive into ``recv`` (contiguous tensors,
        sized by the caller: the other side's shapes) from rank + ``shift``; either list may be empty. Every
        rank posts the same shift at the same point of its program (a ring backward's step sending each dK/dV
        share straight to its owner: ``distlab.cp.ring_dkv_direct``). On CUDA posted on the current stream."""
        pg = self.group if self.group is not None else dist.group.WORLD
        to = dist.get_global_rank(pg, (self.rank - shift) % self.size)
        frm = dist.get_global_rank(pg, (self.rank + shift) % self.size)
        if any(not r.is_contiguous() for r in recv):
            raise ValueError("shift exchange: receive buffers must be contiguous")
        tensors = [t.contiguous() for t in tensors]
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, frm, self.group) for r in recv]
        record(op, sum(_nbytes(t) for t in tensors))
        return _Pending(dist.batch_isend_irecv(ops), recv)

    def exchange_after(self, pending: "_Pending", op: str = "ring_sendrecv", recv=None) -> "_Pending":
        """Post the exchange that forwards what ``pending`` receives, without making the caller's stream
        wait for it: on CUDA the wait and the new sends go on a side stream, so they are ordered after that
        receive only, not after compute already queued (the new receive buffers come from the side
        stream's pool — given ``recv``, from ``landing_buffer`` — and are marked as used by the caller's
        stream, which reads them); on CPU (gloo sends from host memory) it blocks until the tensors have
        arrived. What keeps two K/V blocks in flight (``distlab.cp.ring``)."""
        if not pending.recv[0].is_cuda:
            return self.exchange(pending.wait(), op, recv)
        side = self._side_stream(pending.recv[0].device)
        with torch.cuda.stream(side):
            handle = self.exchange(pending.wait(), op, recv)
        if recv is None:   # (landing buffers were marked when they were made)
            caller = torch.cuda.current_stream(pending.recv[0].device)
            for r in handle.recv:
                r.record_stream(caller)
        return handle

    def landing_buffer(self, shape, like, contents=None):
        """A buffer to receive K/V into (``distlab.cp.ring_landing``): on CUDA from the side stream's pool, where
        the exchanges that write into it are posted, and marked as used by the caller's stream, which reads it
        (``contents`` says what it will hold; a stand-in ring fills it from them)."""
        if not like.is_cuda:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        caller = torch.cuda.current_stream(like.device)
        with torch.cuda.stream(self._side_stream(like.device)):
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        buf.record_stream(caller)
        return buf

    def _side_stream(self, device):
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    _side = None


class _Pending:
    def __init__(self, works, recv):
        self.works, self.recv = works, recv

    def wait(self):
        """The received tensors, once the current stream (on CPU: the caller) has waited for them. May be
        called again: on CUDA each call makes the then current stream wait (NCCL works can be waited on by
        several streams); on CPU once is enough (a second wait on a gloo send would wait for another one)."""
        for w in self.works:
            w.wait()
        if not self.recv or not self.recv[0].is_cuda:
            self.works = []
        return self.recv
