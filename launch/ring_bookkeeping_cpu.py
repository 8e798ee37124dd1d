"""Host time of one ring rank's forward with its kernels stubbed out: what the ring's own Python costs a pass
(schedule, exchanges posted on the emulator's ring, K/V landing, merge entries), on any CPU, no GPU needed.
FA4's forward and the Triton merge are replaced by stand-ins that return kept tensors (TRITON_INTERPRET=1 only
lets the merge path be taken on CPU; nothing runs under the interpreter). W=8 zigzag, 32 q / 8 kv heads,
D128, launch groups 1 | 3 | 4 — S8192's shapes (docs/PERF.md, #24).

    TRITON_INTERPRET=1 python3 launch/ring_bookkeeping_cpu.py --rank 0 --seq 8192
    TRITON_INTERPRET=1 python3 launch/ring_bookkeeping_cpu.py --stub kernels   # FA4's compiled kernel and the
        # merge's Triton launcher stubbed instead: distlab's replay and merge host work timed too, the kept
        # outputs (distlab.cp.ring_kept) against DISTLAB_RING_KEEP_OUTPUTS=0 in the same process, interleaved
    TRITON_INTERPRET=1 python3 launch/ring_bookkeeping_cpu.py --heap 3000000 [--freeze]   # a big live heap (as
        # FA4's CuTe DSL and cuDNN leave one): does Python's garbage collector move the pass time? (it prints the
        # collections of each generation during the run)
"""
import argparse
import gc
import math
import os
import time

import torch

import distlab.kernels.fa4 as fa4
from distlab import knobs
from distlab.testing import install_fa4_stand_in
import distlab.kernels.lse_merge as lse_merge
from distlab.cp.emulate import ResidentRing
from distlab.cp.ring import _ring_forward


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--passes", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--heap", type=int, default=0, help="small live Python objects to hold during the run")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() the heap first (out of the collector's view)")
    p.add_argument("--stub", choices=("forward", "kernels"), default="forward",
                   help="forward: FA4's forward and the merge replaced whole; kernels: only FA4's compiled kernel "
                        "(a stand-in interface, distlab.testing) and the merge's launcher, and the kept outputs "
                        "timed against the knob off")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (the merge path is taken only where Triton could run)")
    heap = [{"i": [i]} for i in range(a.heap)]
    if a.freeze:
        gc.freeze()
    collections = [g["collections"] for g in gc.get_stats()]
    kept = {}

    def forward_stub(q, k, v, causal, scale):   # FA4's forward: kept (out, lse) per shape, no work
        if q.shape not in kept:
            kept[q.shape] = (torch.empty(q.shape), torch.empty(q.shape[0], q.shape[2], q.shape[1]))
        return kept[q.shape]

    if a.stub == "forward":
        fa4.fa4_forward = forward_stub
        lse_merge.lse_merge_blocks_ = lambda out, lse, pending, has_acc, final: (
            final if final is not None else out, lse)
        variants = {"": {}}
    else:
        install_fa4_stand_in(compute=False)
        lse_merge._kernel = lambda: (None, lambda key, grid, args, kwargs: None)
        variants = {"kept outputs (default)": {"RING_KEEP_OUTPUTS": "1"},
                    "DISTLAB_RING_KEEP_OUTPUTS=0": {"RING_KEEP_OUTPUTS": "0"}}
    s, d = a.seq // a.world, 128
    q = torch.randn(1, s, 32, d)
    kv = [(torch.randn(1, s, 8, d), torch.randn(1, s, 8, d)) for _ in range(a.world)]
    ring = ResidentRing(a.world, a.rank, kv)

    def one():
        _ring_forward(q, *kv[0], ring, True, "zigzag", 1 / math.sqrt(d), "fa4", (1, 3, a.world - 4))

    times = {name: [] for name in variants}
    for r in range(a.rounds + 1):   # round 0: warm-up (records the replays and binds the merges)
        for name, values in variants.items():
            with knobs.override(**values):
                t = time.perf_counter()
                for _ in range(a.passes if r else min(50, a.passes)):
                    one()
                if r:
                    times[name].append(1e6 * (time.perf_counter() - t) / a.passes)
    for name, ts in times.items():
        ts.sort()
        print(f"W={a.world} rank {a.rank} S{a.seq}: ring forward bookkeeping, {a.stub} stubbed{', ' if name else ''}"
              f"{name}: best {ts[0]:.1f} µs a pass, median {ts[len(ts) // 2]:.1f} ({a.rounds} rounds of {a.passes})")
    done = [g["collections"] - c for g, c in zip(gc.get_stats(), collections)]
    print(f"garbage collections during the run, by generation: {done} ({len(heap)} objects held"
          f"{', frozen' if a.freeze else ''})")
    return {name: ts[0] for name, ts in times.items()}


if __name__ == "__main__":
    main()
