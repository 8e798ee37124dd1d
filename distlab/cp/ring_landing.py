"""K/V received straight into the fused blocks' buffers: a launch group's keys with no concatenation.

    python -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 --steps-per-launch 4 --wall   # H100/H200
    DISTLAB_RING_STEPS_PER_LAUNCH=4 distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --backend torch --check

A backend with no in-kernel accumulation (FA4, cuDNN, torch) computes a launch group's blocks over the same
rows as one block over the steps' keys (``distlab.cp.ring.fuse_plan``). Those keys were concatenated out of
each step's received K/V: two copies a fused block, forward and backward (H100, W=8 zigzag: 6 µs each at
S8192, 16–24 µs at S32768 — at S8192 ~7% of the rank's GPU time). Here each step's K/V are instead
*received* where the fused block reads them: the ring allocates, per launch group, one buffer a fused block
holding its K and V (its keys in ``fuse_plan``'s order) and passes their slices to the exchange as receive
buffers (``comm.RingExchanger.exchange(..., recv=...)``), so the block's K/V are views and nothing is copied.
H100, W=8 zigzag, GPU clock against one FA4 call: S8192 f+b 71 → 77–78%, S32768 +1–4 points (docs/PERF.md).

The messages: a step's K (then V) travels as ``chunks_per_rank(layout)`` messages, one per chunk of the shard
(zigzag: 2), every hop and every rank alike (a send must match its receive's size). With zigzag a block
against an earlier rank's K/V reads their first chunk only: that chunk lands in the fused block's buffer and
the other one, which this rank only forwards, in its group's spare buffer. A step whose blocks are not all part of
fused blocks lands whole in a shard buffer, and is read as before. Same hops and bytes; 2× the messages of a
zigzag ring (4 sends and 4 receives a hop, one NCCL group).

Used for a ring of batch 1 (a chunk of a batch-2 shard is not contiguous: the copies stay) with launch groups
of several steps on a backend other than ``triton``; knob ``DISTLAB_RING_KV_LANDING=0`` turns it off. The
emulator (``distlab.cp.emulate.ResidentRing``) gives the same buffers already filled (``landing_buffer``):
no communication is timed there, as before. On CUDA a real ring's buffers come from its side stream's pool and
every exchange into them is posted on that stream (``comm.RingExchanger.landing_buffer``); that path has not
run over NCCL yet (no multi-GPU machine lent); gloo rings run it in the tests.
"""

from __future__ import annotations

import functools

import torch

from distlab import knobs
from distlab.cp.layout import chunks_per_rank


def use_landing(k, v, backend: str, groups) -> bool:
    """Whether a ring lands its K/V in the fused blocks' buffers: the same answer on every rank (it decides the
    messages): batch 1, K and V of one shape and dtype (a buffer holds both), a backend other than ``triton``,
    some launch group of several steps, the knob on."""
    return (k.shape[0] == 1 and k.shape == v.shape and k.dtype == v.dtype and backend != "triton"
            and any(len(steps) > 1 for steps, _ in groups) and knobs.get("RING_KV_LANDING") != "0")


@functools.lru_cache(maxsize=256)
def landing_plan(rank: int, world: int, shard: int, causal: bool, layout: str, steps_per_launch, max_keys=0):
    """Where each message of each step lands, from the ring's ``group_plans`` (the same arguments; once per
    ring shape): ``(place, sizes, contents, runs)`` with
    ``place[step]`` a tuple over the shard's chunks of ``(buffer key, slot)`` (the slot-th chunk of the
    buffer); ``sizes[key]`` a buffer's keys and ``contents[key]`` its ``(step, chunk start, length, offset)``
    (what a stand-in ring fills it with); ``runs[(group, run)]`` the buffer key of a fused block read as a
    view. Buffer keys: ``("run", g, i)`` (fused block i of launch group g), ``("step", s)`` (step s whole)
    and ``("spare", g)`` (the chunks launch group g only forwards, one after another)."""
    from distlab.cp.ring import group_plans

    groups = group_plans(rank, world, shard, causal, layout, steps_per_launch, max_keys)
    n_chunks = chunks_per_rank(layout)
    chunk = shard // n_chunks
    blocks: dict = {}
    for g, (steps, plan) in enumerate(groups):
        for i, (_, _, pieces) in enumerate(plan):
            for step, cols in pieces:
                blocks.setdefault(step, []).append((g, i, len(pieces), cols))

    def fits(step):   # one block, a fused one, over whole chunks
        b = blocks.get(step, [])
        return len(b) == 1 and b[0][2] > 1 and b[0][3].start % chunk == 0 and b[0][3].stop % chunk == 0

    runs = {}
    for g, (steps, plan) in enumerate(groups):
        for i, (_, _, pieces) in enumerate(plan):
            if len(pieces) > 1 and all(step > 0 and fits(step) for step, _ in pieces):
                runs[(g, i)] = ("run", g, i)
    place, sizes, contents = {}, {}, {}
    for g, (steps, plan) in enumerate(groups):
        for i, (_, _, pieces) in enumerate(plan):
            if (g, i) not in runs:
                continue
            key, offset = runs[(g, i)], 0
            for step, cols in pieces:
                where = []
                for c in range(n_chunks):
                    lo = c * chunk
                    if cols.start <= lo < cols.stop:
                        where.append((key, (offset + lo - cols.start) // chunk))
                        contents.setdefault(key, []).append((step, lo, chunk, offset + lo - cols.start))
                    else:   # forwarded only: the group's spare buffer, one chunk after another
                        spare = ("spare", g)
                        slot = sizes.get(spare, 0) // chunk
                        where.append((spare, slot))
                        sizes[spare] = (slot + 1) * chunk
                        contents.setdefault(spare, []).append((step, lo, chunk, slot * chunk))
                place[step] = tuple(where)
                offset += cols.stop - cols.start
            sizes[key] = offset
    for step in sorted({s for steps, _ in groups for s in steps} - set(place) - {0}):
        key = ("step", step)
        place[step] = tuple((key, c) for c in range(n_chunks))
        sizes[key], contents[key] = shard, [(step, c * chunk, chunk, c * chunk) for c in range(n_chunks)]
    return place, sizes, {k: tuple(v) for k, v in contents.items()}, runs


class KVLanding:
    """One ring pass's landing buffers (``landing_plan``): the receive buffers of each step's messages
    (``recv``), a step's whole K/V where it landed whole (``step_kv``), a fused block's K/V (``run_kv``).
    A buffer holds K and V, ``(2, 1, keys, heads, dim)``; buffers come from ``ring.landing_buffer(shape,
    like, contents)`` where the exchanger has one (``comm.RingExchanger``: the side stream's pool; the
    emulator's ring: filled), else ``torch.empty``."""

    def __init__(self, ring, k, v, shape):
        """``shape``: the ring's ``group_plans`` arguments (rank, world, shard, causal, layout, steps per
        launch, key cap)."""
        self.k, self.shard = k, k.shape[1]
        self.sizes, self.contents, self.runs, self.slots, self.n_chunks = recv_slots(*shape)
        self.chunk = self.shard // self.n_chunks
        self.alloc = getattr(ring, "landing_buffer", None)
        self.bufs: dict = {}

    def messages(self, kv):
        """A step's K/V as its messages: each tensor cut into its chunks (views; ``view`` + ``unbind``, two
        C++ calls, where the tensor is contiguous)."""
        c, n = self.chunk, self.n_chunks
        return [m for t in kv for m in (t.view(n, 1, c, *t.shape[2:]).unbind(0) if t.is_contiguous()
                                        else [t[:, i * c:(i + 1) * c] for i in range(n)])]

    def _make(self, key):
        """Buffer ``key`` and its chunk views (K's, then V's: ``[1, chunk, ...]``, contiguous), made at first
        use; one ``view`` + ``unbind`` for all of a buffer's messages (C++ calls: a slice per message cost
        ~2 µs of host each, four a step, and ``Tensor.split`` has a Python wrapper). Spares are kept to the
        pass's end."""
        k = self.k
        shape = (2, 1, self.sizes[key], *k.shape[2:])
        buf = (self.alloc(shape, k, self.contents[key]) if self.alloc is not None
               else torch.empty(shape, dtype=k.dtype, device=k.device))
        views = buf.view(2 * self.sizes[key] // self.chunk, 1, self.chunk, *k.shape[2:]).unbind(0)
        self.bufs[key] = (buf, views)
        return self.bufs[key]

    def recv(self, step):
        """The receive buffers of step ``step``'s messages (K's chunks, then V's)."""
        bufs = self.bufs
        return [(bufs.get(key) or self._make(key))[1][i] for key, i in self.slots[step]]

    def step_kv(self, step):
        """Step ``step``'s (K, V) where they landed whole, else None (its keys are read through ``run_kv``)."""
        got = self.bufs.pop(("step", step), None)
        return None if got is None else (got[0][0], got[0][1])

    def run_kv(self, group: int, run: int):
        """Fused block ``run`` of launch group ``group``: its (K, V) as they landed, or None (concatenate)."""
        key = self.runs.get((group, run))
        if key is None:
            return None
        buf = self.bufs.pop(key)[0]
        return buf[0], buf[1]


@functools.lru_cache(maxsize=256)
def recv_slots(*shape):
    """``landing_plan``'s sizes, contents and runs, with per step its messages' ``(buffer key, index among
    the buffer's chunk views)``, K's then V's (a buffer's views: its K chunks, then its V chunks), and the
    chunks a shard is cut into; once per ring shape (``landing_plan``'s arguments)."""
    place, sizes, contents, runs = landing_plan(*shape)
    n_chunks = chunks_per_rank(shape[4])
    chunk = shape[2] // n_chunks
    slots = {step: tuple((key, t * (sizes[key] // chunk) + slot) for t in (0, 1) for key, slot in where)
             for step, where in place.items()}
    return sizes, contents, runs, slots, n_chunks
