"""The planner's cost model: compute from calibrated kernel rates, communication from link models, and
what each method can hide. Every term of a prediction is named here, in one place.

    python -m distlab.plan --model llama3-8b --seq 131072 --cluster 2x8 --intra nvlink4 --inter ib-ndr400

**Compute.** A call costs ``max(launch, work / rate(size))``, the rate read off the calibration at the call's
size (``distlab.plan.calibration``): GEMMs by FLOPs, attention by visible (query, key) pairs per head —
causal, packed documents and windows all count the pairs a mask leaves (``distlab.cp.documents``) — and
memory-bound kernels (norms, RoPE, SwiGLU, the LSE merge, residual adds, the optimizer) by bytes at the
``copy`` rate. Backward GEMMs are two calls of the forward's size (dX, dW); attention's backward is 2.5× its
forward's FLOPs at the ``attention_bwd`` rate. On a CPU, ``slowdown`` = processes × threads / cores when the
ranks share cores, and a ring step costs max(its slowest rank alone, all ranks' work over the cores).
Calls with a ``KeyMask`` (packed documents, windows, the balanced layout, all-gather KV's causal
positions) take the masked kernels' rate.

**Communication.** ``Link.time``: α + bytes·factor/busbw (``distlab.plan.links``); the bytes are those
``distlab.cp.cost`` and ``distlab.comm.CommLog`` count.

**Overlap** (on links that overlap compute; gloo on a shared CPU does not, and then all of it is exposed):

- ring: step k+1's K/V hop flies during step k's blocks; exposed per step ``max(0, hop − step)``; the
  backward's dK/dV hop rides with K/V and its last hop home is exposed. A step takes the slowest rank's time.
- Ulysses: the all-to-alls of q, k, v, out (backward: dout, dq, dk, dv) are exposed.
- all-gather KV: kv-head chunks; chunk i+1's gather hides behind chunk i's attention; the first is exposed;
  the backward's reduce-scatters hide behind the next chunk, the last is exposed.
- TP (SP): the all-gathers and reduce-scatters around the attention and the MLP are exposed; with async TP
  each hides behind the GEMM it feeds, ``max(0, comm − GEMM)``.
- EP: dispatch and combine all-to-alls are exposed.
- data parallel: ZeRO-3's per-layer all-gathers (forward and backward) and reduce-scatters are prefetched
  and hide behind the layer's compute, ``max(0, comm − compute)`` per layer; DDP / ZeRO-1/2's gradient
  reduction hides behind the backward except its last bucket (one layer's worth).
"""

from __future__ import annotations

import dataclasses

import torch

from distlab.plan.calibration import Calibration
from distlab.plan.links import Link


@dataclasses.dataclass
class Phase:
    """Seconds of one forward or backward: compute, communication in all, and the part of it not hidden."""

    compute: float = 0.0
    comm: float = 0.0
    exposed: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.exposed

    def __add__(self, o: "Phase") -> "Phase":
        return Phase(self.compute + o.compute, self.comm + o.comm, self.exposed + o.exposed)

    def scaled(self, k: float) -> "Phase":
        return Phase(self.compute * k, self.comm * k, self.exposed * k)


class Kernels:
    """Seconds of one call of each kernel on this calibration; ``extrapolated`` names what fell outside it."""

    def __init__(self, cal: Calibration, slowdown: float = 1.0, itemsize: int = 2, cores: int | None = None):
        self.cal, self.slowdown, self.itemsize, self.cores = cal, slowdown, itemsize, cores
        self.extrapolated: set[str] = set()

    def _time(self, kernel, size, work):
        if work <= 0:
            return 0.0
        rate, outside = self.cal.rate(kernel, size)
        if outside:
            self.extrapolated.add(kernel)
        return max(self.cal.launch_s, work / rate) * self.slowdown

    def gemm(self, m, k, n, backward=False):
        f = 2 * m * k * n
        return 2 * self._time("gemm", f, f) if backward else self._time("gemm", f, f)

    def grouped(self, rows, k, n, backward=False):
        f = 2 * rows * k * n
        return (2 if backward else 1) * self._time("grouped_gemm", f, f)

    def attention(self, pairs_per_head, heads, head_dim, causal_block, backward=False, batch=1, masked=False):
        """One attention call: ``masked`` (a KeyMask: documents, windows, positions) or a causal or full block."""
        tag = "masked" if masked else "causal" if causal_block else "full"
        kind = f"attention_{'bwd' if backward else 'fwd'}_{tag}"
        work = 4 * pairs_per_head * heads * head_dim * batch * (2.5 if backward else 1.0)
        return self._time(kind, pairs_per_head, work)

    def memory(self, nbytes, calls=1):
        if nbytes <= 0:
            return 0.0
        per = nbytes / calls
        rate, outside = self.cal.rate("copy", per)
        if outside:
            self.extrapolated.add("copy")
        return calls * max(self.cal.launch_s, per / rate) * self.slowdown


# ---- attention under each CP method: the busiest rank, forward and backward ---------------------------------

@dataclasses.dataclass(frozen=True)
class AttnShape:
    batch: int
    seq: int            # the whole sequence
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int = 2
    causal: bool = True
    docs: object = None   # distlab.cp.documents.Documents (packed documents / window) or None
    layout: str = "zigzag"


def _pairs(shape: AttnShape, q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    if shape.docs is not None and shape.docs.masked:
        return shape.docs.work(q_pos, k_pos)
    if not shape.causal:
        return q_pos.numel() * k_pos.numel()
    ks = torch.sort(k_pos).values
    return int(torch.searchsorted(ks, q_pos, right=True).sum())


def _masked(shape: AttnShape) -> bool:
    """Whether the calls go to the masked kernels (a KeyMask): documents, windows, the balanced layout."""
    return (shape.docs is not None and shape.docs.masked) or shape.layout == "balanced"


def _step_time(per_rank: list[float], k: Kernels, rings: int = 1) -> float:
    """A ring step ends when its slowest rank does. Ranks sharing ``k.cores`` CPU cores (each time already
    × ``k.slowdown``, the share of a core it gets with every rank busy) run at full speed when fewer are
    busy: the step is then max(slowest alone, all the work over the cores); ``rings`` rings of the same
    schedule run side by side (USP: one per Ulysses rank) and share the cores too."""
    if not k.cores:
        return max(per_rank)
    alone = [t / k.slowdown for t in per_rank]
    return max(max(alone), rings * sum(alone) / k.cores)


def ring_cost(shape: AttnShape, ring: int, heads: int, kv_heads: int, k: Kernels, link: Link,
              acc_itemsize: int = 4, rings: int = 1, steps_per_launch=None, dkv_route: str = "ring",
              share_itemsize: int | None = None) -> tuple[Phase, Phase]:
    """Ring (contiguous, zigzag or balanced) over ``ring`` ranks, ``heads``/``kv_heads`` per rank;
    ``rings``: how many such rings run at once (USP's Ulysses degree), for ranks that share CPU cores.
    ``steps_per_launch`` (None: one step a launch): the launch groups of ``distlab.cp.ring_fused``, priced by
    ``_grouped``; ``dkv_route`` ``ring`` or ``direct`` (``distlab.cp.ring_dkv_direct``, its shares
    ``share_itemsize`` bytes an element: 2 where FA4's blocks are folded, else ``acc_itemsize``)."""
    from distlab.cp.layout import shard_positions
    from distlab.cp.ring_dkv_direct import check_route

    if check_route(dkv_route) == "direct" and (_masked(shape) or shape.layout == "balanced"):
        raise ValueError("dkv_route='direct': a packed or balanced ring sends dK/dV by the ring only")
    cu = shape.docs.cu_seqlens if shape.docs is not None else None
    pos = [shard_positions(shape.seq, ring, r, shape.layout if ring > 1 else "contiguous", cu) for r in range(ring)]
    local = shape.seq // ring
    d, b = shape.head_dim, shape.batch
    merge_bytes = 3 * b * local * heads * (d + 1) * 4           # read two (out, lse), write one, float32
    fwd, bwd = Phase(), Phase()
    hop_kv = link.time("sendrecv", 2 * b * local * kv_heads * d * shape.itemsize, 2) if ring > 1 else 0.0
    hop_dkv = link.time("sendrecv", 2 * b * local * kv_heads * d * acc_itemsize, 2) if ring > 1 else 0.0
    masked = _masked(shape)
    f_steps, b_steps = [], []
    for step in range(ring):
        tf, tb = [], []
        for r in range(ring):
            pairs = _pairs(shape, pos[r], pos[(r - step) % ring])
            diag = step == 0 and shape.causal
            tf.append(k.attention(pairs, heads, d, diag, batch=b, masked=masked)
                      + (k.memory(merge_bytes, 2) if step and pairs else 0.0))
            tb.append(k.attention(pairs, heads, d, diag, backward=True, batch=b, masked=masked)
                      + (k.memory(merge_bytes / 3 * 2) if pairs else 0.0))
        f_step, b_step = _step_time(tf, k, rings), _step_time(tb, k, rings)
        f_steps.append(f_step)
        b_steps.append(b_step)
        if steps_per_launch is not None or dkv_route != "ring":
            continue
        fwd.compute += f_step
        bwd.compute += b_step
        if step < ring - 1:          # the hop for step+1 flies during this step
            fwd.comm += hop_kv
            bwd.comm += hop_kv + hop_dkv
            fwd.exposed += max(0.0, hop_kv - f_step) if link.overlaps_compute else hop_kv
            bwd.exposed += max(0.0, hop_kv + hop_dkv - b_step) if link.overlaps_compute else hop_kv + hop_dkv
    if steps_per_launch is not None or dkv_route != "ring":
        share = 2 * b * kv_heads * d * (share_itemsize or acc_itemsize)
        return _grouped(shape, ring, f_steps, b_steps, link, hop_kv, hop_dkv, steps_per_launch or 1, dkv_route,
                        share)
    if ring > 1:                      # dK/dV's last hop home
        bwd.comm += hop_dkv
        bwd.exposed += hop_dkv
    return fwd, bwd


def _grouped(shape, ring, f_steps, b_steps, link, hop_kv, hop_dkv, steps_per_launch, route, share_per_key):
    """The ring by launch groups: a group's blocks computed at once when its K/V have arrived, which fly during
    the group before it (forward and backward alike). The dK/dV of a group leave after its compute and fly
    during the next group's. By the ring's route a group of n steps leaves a *chain*: the share of its first
    step is added into the accumulator that came with the K/V and sent on to the next rank, which adds its
    own share of the same keys (computed in the same group) and sends it on — n hops one after another, of
    which the last group's cannot hide (its n-th is the hop home). By the direct route each rank sends its
    group's shares (its keys per step, ``group_plans``; step 0's stay home) to their owners at once: one send
    of the busiest rank's bytes. The last group's dK/dV are exposed either way: what an emulated rank
    (compute only, ``distlab.cp.emulate``) does not pay and a real ring does."""
    from distlab.cp.ring import group_plans, launch_groups

    groups = launch_groups(ring, steps_per_launch)
    seq_local = shape.seq // ring

    def dkv_time(g):
        if route == "ring":
            return len(groups[g]) * hop_dkv
        keys = max(sum(c.stop - c.start for _, _, pieces in group_plans(r, ring, seq_local, shape.causal,
                                                                          shape.layout, steps_per_launch)[g][1]
                       for st, c in pieces if st > 0) for r in range(ring))
        return link.time("sendrecv", keys * share_per_key, 2) if keys else 0.0

    fwd, bwd = Phase(), Phase()
    for g, steps in enumerate(groups):
        cf, cb = sum(f_steps[s] for s in steps), sum(b_steps[s] for s in steps)
        kv = len(groups[g + 1]) * hop_kv if g + 1 < len(groups) else 0.0
        before = dkv_time(g - 1) if g else 0.0
        fwd.compute += cf
        bwd.compute += cb
        fwd.comm += kv
        bwd.comm += kv + before
        fwd.exposed += max(0.0, kv - cf) if link.overlaps_compute else kv
        bwd.exposed += max(0.0, kv + before - cb) if link.overlaps_compute else kv + before
    if ring > 1:
        last = dkv_time(len(groups) - 1)
        bwd.comm += last
        bwd.exposed += last
    return fwd, bwd


def ulysses_cost(shape: AttnShape, ulysses: int, k: Kernels, link: Link) -> tuple[Phase, Phase]:
    """Ulysses over ``ulysses`` ranks (contiguous sequence): four all-to-alls each way, all exposed."""
    from distlab.cp.ulysses import kv_replication

    kv = shape.kv_heads * kv_replication(shape.heads, shape.kv_heads, ulysses)
    local = shape.batch * (shape.seq // ulysses) * shape.head_dim * shape.itemsize
    a2a = (2 * link.time("all_to_all", local * shape.heads, ulysses)
           + 2 * link.time("all_to_all", local * kv, ulysses))
    pos = torch.arange(shape.seq)
    pairs = _pairs(shape, pos, pos)
    h = shape.heads // ulysses
    m = _masked(shape)
    fwd = Phase(k.attention(pairs, h, shape.head_dim, shape.causal, batch=shape.batch, masked=m), a2a, a2a)
    bwd = Phase(k.attention(pairs, h, shape.head_dim, shape.causal, backward=True, batch=shape.batch, masked=m), a2a, a2a)
    return fwd, bwd


def usp_cost(shape: AttnShape, ulysses: int, ring: int, k: Kernels, link_u: Link, link_r: Link) -> tuple[Phase, Phase]:
    """Ulysses inside (on the ring shard), ring across."""
    from distlab.cp.ulysses import kv_replication

    if ulysses == 1:
        return ring_cost(shape, ring, shape.heads, shape.kv_heads, k, link_r)
    kv = shape.kv_heads * kv_replication(shape.heads, shape.kv_heads, ulysses)
    local = shape.batch * (shape.seq // (ring * ulysses)) * shape.head_dim * shape.itemsize
    a2a = 2 * link_u.time("all_to_all", local * shape.heads, ulysses) + 2 * link_u.time("all_to_all", local * kv, ulysses)
    f, b = ring_cost(shape, ring, shape.heads // ulysses, kv // ulysses, k, link_r, rings=ulysses)
    return f + Phase(0.0, a2a, a2a), b + Phase(0.0, a2a, a2a)


def allgather_cost(shape: AttnShape, world: int, k: Kernels, link: Link) -> tuple[Phase, Phase]:
    """All-gather KV (Llama 3): kv-head chunks gathered while the previous chunk computes."""
    from distlab.cp.layout import shard_positions

    chunks = 2 if shape.kv_heads % 2 == 0 else 1
    cu = shape.docs.cu_seqlens if shape.docs is not None else None
    layout = shape.layout if world > 1 else "contiguous"
    everything = torch.arange(shape.seq)
    pairs = max(_pairs(shape, shard_positions(shape.seq, world, r, layout, cu), everything) for r in range(world))
    d, b = shape.head_dim, shape.batch
    gather = link.time("all_gather", 2 * b * shape.seq * shape.kv_heads // chunks * d * shape.itemsize, world)
    m = shape.causal or _masked(shape)        # local queries against every key: causal needs the positions' mask
    cf = k.attention(pairs, shape.heads // chunks, d, False, batch=b, masked=m)
    cb = k.attention(pairs, shape.heads // chunks, d, False, backward=True, batch=b, masked=m)
    hide = link.overlaps_compute
    fwd = Phase(chunks * cf, chunks * gather, gather + (chunks - 1) * (max(0.0, gather - cf) if hide else gather))
    bwd = Phase(chunks * cb, chunks * gather, gather + (chunks - 1) * (max(0.0, gather - cb) if hide else gather))
    return fwd, bwd


def attention_cost(method: str, shape: AttnShape, k: Kernels, link_u: Link, link_r: Link, ulysses=1, ring=1):
    """(forward, backward) of ``method`` in {ring, ulysses, usp, allgather} (allgather: W = ``ring``)."""
    if method == "ring":
        return ring_cost(shape, ring, shape.heads, shape.kv_heads, k, link_r)
    if method == "ulysses":
        return ulysses_cost(dataclasses.replace(shape, layout="contiguous"), ulysses, k, link_u)
    if method == "usp":
        return usp_cost(shape, ulysses, ring, k, link_u, link_r)
    if method == "allgather":
        return allgather_cost(shape, ring, k, link_r)
    raise ValueError(f"unknown CP method {method!r}: ring, ulysses, usp or allgather")


# ---- one transformer block: GEMMs, attention, elementwise, TP/SP and EP collectives -------------------------

def elementwise_bytes(tokens, hidden, q_width, kv_width, ffn_local, itemsize, hidden_share=1.0):
    """Bytes the memory-bound kernels of one block's forward move (backward: twice): two RMSNorms and two
    residual adds over the hidden (``hidden_share`` of it under SP), RoPE on q and k, SwiGLU on gate/up.
    Each pass reads and writes its tensor; PyTorch's unfused ops take several passes (norm 4, RoPE 4,
    SwiGLU 3, add 1.5), as the fused Triton kernels take one."""
    h = hidden * hidden_share
    values = 2 * 4 * h + 2 * 1.5 * h + 4 * (q_width + kv_width) + 3 * 3 * ffn_local
    return 2 * tokens * values * itemsize


ELEMENTWISE_CALLS = 30     # launches of one block's forward besides GEMMs and attention (unfused PyTorch ops)


def block_cost(t, cfg_shape: dict, tp: int, sp: bool, attn: tuple[Phase, Phase], k: Kernels, tp_link: Link,
               async_tp=False, moe=None) -> tuple[Phase, Phase]:
    """(forward, backward) of one Llama block on a rank holding ``t`` tokens (after the CP cut), TP degree
    ``tp``; ``attn`` is the attention's (forward, backward) from ``attention_cost``; ``moe``: a dict with
    experts, topk, ep, ep_link in place of the SwiGLU MLP."""
    h, heads, kv, d, ffn = (cfg_shape[x] for x in ("hidden", "heads", "kv_heads", "head_dim", "ffn"))
    e = k.itemsize
    kv_local = max(1, kv // tp)
    q_w, kv_w = heads // tp * d, 2 * kv_local * d
    gemms = [(t, h, q_w + kv_w), (t, q_w, h)]
    if moe is None:
        gemms += [(t, h, 2 * ffn // tp), (t, ffn // tp, h)]
    fwd = Phase(sum(k.gemm(*g) for g in gemms)) + attn[0]
    bwd = Phase(sum(k.gemm(*g, backward=True) for g in gemms)) + attn[1]
    mem = elementwise_bytes(t, h, q_w, kv_w, 0 if moe else ffn // tp, e, 1 / tp if sp else 1.0)
    fwd.compute += k.memory(mem, ELEMENTWISE_CALLS)
    bwd.compute += k.memory(2 * mem, 2 * ELEMENTWISE_CALLS)
    if tp > 1:   # two collectives around the attention and two around the MLP, each way
        size = t * h * e
        ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce", "all_reduce")
        comm = 2 * (tp_link.time(ops[0], size, tp) + tp_link.time(ops[1], size, tp))
        if async_tp and sp and tp_link.overlaps_compute:
            hidden_f = sum(k.gemm(*g) for g in gemms)
            exposed_f, exposed_b = max(0.0, comm - hidden_f), max(0.0, comm - 2 * hidden_f)
        else:
            exposed_f = exposed_b = comm
        fwd += Phase(0.0, comm, exposed_f)
        bwd += Phase(0.0, comm, exposed_b)
    if moe is not None:
        f, b = moe_cost(t // tp if sp else t, h, ffn, moe["experts"], moe["topk"], moe["ep"], k, moe["ep_link"],
                        moe.get("imbalance", 1.0))
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def moe_cost(tokens, hidden, ffn, experts, topk, ep, k: Kernels, link: Link, imbalance=1.0) -> tuple[Phase, Phase]:
    """Router, dispatch, grouped expert GEMMs (gate, up, down) and combine for ``tokens`` on one EP rank;
    ``imbalance``: the busiest rank's rows over the mean (1.0: balanced routing)."""
    rows = int(tokens * topk * imbalance)
    e = k.itemsize
    router = k.gemm(tokens, hidden, experts)
    experts_f = k.grouped(rows, hidden, 2 * ffn) + k.grouped(rows, ffn, hidden)
    experts_b = k.grouped(rows, hidden, 2 * ffn, backward=True) + k.grouped(rows, ffn, hidden, backward=True)
    moves = k.memory(4 * rows * hidden * e + 3 * rows * ffn * e, 12)   # gather/scatter of rows, SwiGLU, weights
    a2a = 2 * link.time("all_to_all", rows * hidden * e, ep) if ep > 1 else 0.0
    fwd = Phase(router + experts_f + moves, a2a, a2a)
    bwd = Phase(2 * router + experts_b + 2 * moves, a2a, a2a)
    return fwd, bwd
