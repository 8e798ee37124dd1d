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
The buffers and every view of them are made once per ring shape and kept (``kv_landing``; the forward and
the backward share them): made afresh, they cost a W=8 forward ~35 µs of host time on this project's CPU
machine (a view each of 28 messages, an ``unbind`` per buffer) — with the kernels stubbed, the forward's
bookkeeping went from 75 to 35 µs a pass (rank 0; rank 7 82 → 32). Their memory is what a pass held at its
peak anyway; ``release_landing_buffers()`` hands it back.

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

import collections
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


KEPT_SHAPES = 4   # ring shapes whose landing buffers ``kv_landing`` keeps (why: the module's docstring)
_KEPT: collections.OrderedDict = collections.OrderedDict()


class KVLanding:
    """A ring shape's landing buffers (``landing_plan``), made once and kept (``kv_landing``): the receive
    buffers of each step's messages (``recv``), a step's whole K/V where it landed whole (``step_kv``), a
    fused block's K/V (``run_kv``), all views made up front. A buffer holds K and V, ``(2, 1, keys, heads,
    dim)``; buffers come from ``ring.landing_buffer(shape, like, contents)`` where the exchanger has one
    (``comm.RingExchanger``: the side stream's pool; the emulator's ring: filled), else ``torch.empty``.

    Why reusing them is safe: a pass's first exchange sends this rank's own K/V, so on CUDA its side stream
    first waits for everything the compute stream has queued — the previous pass's reads of these buffers
    included — and every later receive of the pass is queued behind it on that stream; on CPU a pass's
    blocks are computed before it returns. Passes never overlap on the host (one ``_ring_forward`` or
    ``_ring_backward`` runs to its end before the next starts)."""

    def __init__(self, ring, k, shape):
        """``shape``: the ring's ``group_plans`` arguments (rank, world, shard, causal, layout, steps per
        launch, key cap)."""
        sizes, contents, runs, slots, n_chunks = recv_slots(*shape)
        chunk = shape[2] // n_chunks
        alloc = getattr(ring, "landing_buffer", None)
        bufs, views = {}, {}
        for key, size in sizes.items():
            buf_shape = (2, 1, size, *k.shape[2:])
            bufs[key] = (alloc(buf_shape, k, contents[key]) if alloc is not None
                         else torch.empty(buf_shape, dtype=k.dtype, device=k.device))
            views[key] = bufs[key].view(2 * size // chunk, 1, chunk, *k.shape[2:]).unbind(0)
        self.recv_views = {step: [views[key][i] for key, i in where] for step, where in slots.items()}
        self.whole = {key[1]: (buf[0], buf[1]) for key, buf in bufs.items() if key[0] == "step"}
        self.runs = {run: (bufs[key][0], bufs[key][1]) for run, key in runs.items()}
        self.message_shape = (n_chunks, 1, chunk, *k.shape[2:])
        self.chunk, self.n_chunks = chunk, n_chunks
        self.buffers = list(bufs.values())
        self.nbytes = sum(buf.numel() * buf.element_size() for buf in self.buffers)

    def messages(self, kv):
        """A step's K/V as its messages: each tensor cut into its chunks (views; ``view`` + ``unbind``, two
        C++ calls, where the tensor is contiguous)."""
        k, v = kv
        if k.is_contiguous() and v.is_contiguous():
            return [*k.view(self.message_shape).unbind(0), *v.view(self.message_shape).unbind(0)]
        c = self.chunk
        return [t[:, i * c:(i + 1) * c] for t in kv for i in range(self.n_chunks)]

    def recv(self, step):
        """The receive buffers of step ``step``'s messages (K's chunks, then V's)."""
        return self.recv_views[step]

    def step_kv(self, step):
        """Step ``step``'s (K, V) where they landed whole, else None (its keys are read through ``run_kv``)."""
        return self.whole.get(step)

    def run_kv(self, group: int, run: int):
        """Fused block ``run`` of launch group ``group``: its (K, V) as they landed, or None (concatenate)."""
        return self.runs.get((group, run))


def kv_landing(ring, k, shape) -> KVLanding:
    """The landing buffers of ring shape ``shape`` (``KVLanding``) for K/V like ``k``: kept in the ring's own
    ``landing_cache`` where it has one (the emulator's ring fills its buffers from its resident K/V), else
    among the last ``KEPT_SHAPES`` shapes of this process (``release_landing_buffers`` frees them)."""
    cache = getattr(ring, "landing_cache", None)
    kept = _KEPT if cache is None else cache
    key = (shape, k.shape[2:], k.dtype, k.device)
    landing = kept.get(key)
    if landing is None:
        with torch.inference_mode(False):   # plain tensors, even when made by a pass under inference mode (a
            landing = kept[key] = KVLanding(ring, k, shape)   # prefill): a later training pass writes them
        if cache is None and len(_KEPT) > KEPT_SHAPES:
            _release(_KEPT.popitem(last=False)[1])
    elif cache is None:
        _KEPT.move_to_end(key)
    return landing


def release_landing_buffers() -> int:
    """Drop the kept landing buffers of every ring shape (``kv_landing``); returns the bytes they held."""
    freed = 0
    while _KEPT:
        freed += _release(_KEPT.popitem()[1])
    return freed


def _release(landing: KVLanding) -> int:
    """On CUDA, wait for the device first: receives queued on a ring's side stream may still write into the
    buffers (they were allocated on the first pass's side stream; the later passes' streams are not recorded)."""
    if landing.buffers and landing.buffers[0].is_cuda:
        torch.cuda.synchronize(landing.buffers[0].device)
    return landing.nbytes


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
