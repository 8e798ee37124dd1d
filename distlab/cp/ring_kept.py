"""The ring forward's FA4 blocks with their outputs kept: per ring shape, each fused block's compiled FA4 kernel
writes into the same out/LSE pass after pass, and the merges of those outputs are launches bound once.

    python -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 --steps-per-launch 4 --wall   # H100/H200
    DISTLAB_RING_KEEP_OUTPUTS=0 python -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 --wall   # before

Why (#24, host time): at S8192 a W=8 rank's FA4 forward is host-bound on the slower GPU hosts (~30 µs of host
above its ~126 µs of GPU time, H100 2026-12-06), and a profile of it put a third of that in work that is the
same every pass: each FA4 call builds its replay key and allocates its out and LSE (``distlab.kernels.fa4``),
and each merge of up to four block results builds a layout key over all of them
(``distlab.kernels.lse_merge.lse_merge_blocks_``). Here the ring keeps, per ring shape (and CUDA stream), a
``KeptForward``: block n of the pass calls ``fa4_forward_kept``'s ``again`` (FA4's kernel straight into block
n's kept out/LSE), and merge m calls ``bind_merge_blocks``'s launch (its key made once over the kept blocks).
The pass's first call of a shape goes through the plain path and records both. Measured (docs/PERF.md, H100,
2026-12-06, W=8 zigzag rank 0, 32 q / 8 kv heads): the S8192 forward's wall 0.141–0.158 → 0.124–0.129 ms, its
GPU clock (0.124); the f+b wall 72–75 → 75–77% of one FA4 call (median 76%); the stubbed forward on the CPU
machine (``launch/ring_bookkeeping_cpu.py --stub kernels``) 130–134 → 100–103 µs a pass. S32768: no change.

What stays fresh each pass: the LSE the merges write (the forward returns it, the backward keeps it) and the
output in q's dtype. What is kept: the block outputs (at S8192, W=8 zigzag rank 0: 2048 rows of 32 heads × 128,
bf16 — 16 MiB, 64 MiB at S32768) and the float32 running result when a pass has more than one merge. Safe to
reuse because a pass's FA4 writes and merges are queued on one stream in order — a pass on another stream gets
its own plan — and passes never overlap on the host. ``release_kept_forward()`` frees them; knob
``DISTLAB_RING_KEEP_OUTPUTS=0`` turns this off (plain FA4 calls and merges, as before).
"""

from __future__ import annotations

import collections

import torch

from distlab import knobs
from distlab.kernels import fa4, lse_merge
from distlab.lru import kept

KEPT_PLANS = 4   # ring shapes (with tensor layouts and stream) whose outputs are kept, the most recent ones
_KEPT: collections.OrderedDict = collections.OrderedDict()


class KeptForward:
    """One ring shape's FA4 block calls (``again`` per block index of the pass) and bound merges (per merge
    index), filled in by the first pass that runs them."""

    def __init__(self):
        self.again: dict = {}     # block index -> fa4_forward_kept's again (None: not replayable)
        self.kept: set = set()    # ids of the kept block outputs (out and LSE of every replayable block)
        self.merges: dict = {}    # merge index -> (the block tensors it is bound to, its launch)
        self.acc = None           # the float32 running result, when a pass merges more than once
        self.nbytes = 0
        self.bound = 0            # merges made through a bound launch (the tests read it)

    def block(self, n, q, k, v, causal, scale):
        """Block n of the pass: (out, LSE) of q against k, v (kept tensors once block n is recorded)."""
        again = self.again.get(n)
        if again is not None:
            return again(q, k, v)
        if n in self.again:   # recorded as not replayable: plain calls
            return fa4.fa4_forward(q, k, v, causal, scale)
        out, lse, again = fa4.fa4_forward_kept(q, k, v, causal, scale)
        self.again[n] = again
        if again is not None:
            self.kept.update((id(out), id(lse)))
            self.nbytes += out.numel() * out.element_size() + lse.numel() * lse.element_size()
        return out, lse

    def merge(self, m, out, lse, pending, q, last):
        """Merge m of the pass: ``distlab.cp.ring._merge_pending``'s contract (the held block results merged
        into the running (out, lse), created at the first merge; the last writes q's dtype; empties
        ``pending``), through the launch bound to these blocks when they are the kept ones."""
        has_acc = out is not None
        final = torch.empty_like(q) if last else None
        if not has_acc:
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
            if last:
                out = final
            else:
                if self.acc is None:
                    self.acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
                    self.nbytes += self.acc.numel() * 4
                out = self.acc
        bound = self.merges.get(m)
        if bound is not None and len(bound[0]) == len(pending) and all(
                o is bo and l is bl for (o, l, *_), (bo, bl) in zip(pending, bound[0])):
            result = bound[1](out, lse, final)
            self.bound += 1
        else:   # the first pass (or a block that fell back to fresh outputs): the plain merge
            if m not in self.merges and all(id(o) in self.kept and id(l) in self.kept for o, l, *_ in pending):
                self.merges[m] = ([(o, l) for o, l, *_ in pending],
                                  lse_merge.bind_merge_blocks(out, lse, pending, has_acc=has_acc, final=final))
            result = lse_merge.lse_merge_blocks_(out, lse, pending, has_acc=has_acc, final=final)
        pending.clear()
        return result


def kept_forward(shape, q, k, scale):
    """The ``KeptForward`` of ring shape ``shape`` (``group_plans``' arguments) for these q/k layouts, dtype,
    device, scale and the current CUDA stream: among the last ``KEPT_PLANS`` of this process; None when the
    knob ``DISTLAB_RING_KEEP_OUTPUTS`` is 0 or a CUDA graph is being captured (its memory is the graph's)."""
    if knobs.get("RING_KEEP_OUTPUTS") == "0":
        return None
    stream = None
    if q.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return None
        stream = torch._C._cuda_getCurrentRawStream(q.get_device())   # what Triton's launcher reads (~1 µs)
    key = (shape, q.shape, q.stride(), k.shape, k.stride(), q.dtype, q.device, scale, stream)
    return kept(_KEPT, key, KeptForward, KEPT_PLANS)


def release_kept_forward() -> int:
    """Drop every kept plan (``kept_forward``); returns the bytes of outputs they held."""
    freed = sum(plan.nbytes for plan in _KEPT.values())
    _KEPT.clear()
    return freed
