"""Host time of a FA4 ring rank's backward bookkeeping, on the CPU: ``FA4RingBackward``'s ``prepare`` and its
``block`` calls with FA4's kernels replaced by no-ops (the CPU stand-ins' recordings, ``tests/
test_fa4_ring_backward.py``), W=8 zigzag, groups 1|3|4 — what a host-bound rank (S8192) pays in Python and
torch calls besides its launches. Prints a table and writes JSON. The last column is the whole ring
backward (``distlab.cp.ring._ring_backward`` on the emulator's resident ring, FA4 pretended present: the
launch groups, the K/V exchanges posted and taken, the dK/dV shares cut out and added, dQ and dK/dV finished)
with the same no-op kernels — on the CPU its adds and fills run as CPU ops — and beside it the same with
``DISTLAB_FA4_RING_KEEP_SCRATCH=0`` (each later block's dK/dV scratch a fresh ``torch.zeros``), and with the
half-shard row sets folded (``FA4_RING_FOLD=half``) and their glue in Triton as on a GPU — Triton pretended
present (``TRITON_INTERPRET=1``), its launches skipped (``DISTLAB_TRITON_LAUNCH=skip``), the tile orders stand-ins.

    python launch/fa4_ring_host_probe.py --json docs/perf/cpu/fa4_ring_host_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

ROUNDS = 5
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main():
    import test_fa4_ring_backward as stand_ins

    from distlab import knobs
    from distlab.cp.emulate import ResidentRing, rank_rows
    from distlab.cp.ring import _ring_backward
    from distlab.cp.ring_fused import _fused_blocks
    from distlab.kernels import fa4_ring_backward as frb
    from distlab.testing import fa4_pretended

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 1, 7])
    p.add_argument("--calls", type=int, default=3000, help="calls per timing, in 5 rounds: the fastest round's")
    p.add_argument("--json")
    a = p.parse_args()

    def noop(*args):
        return None

    def record(*args):   # the stand-ins' recordings, every kernel a no-op
        (_, pre_args), (_, main_args), posts, shapes = stand_ins._fake_record(*args)
        return ((noop, pre_args), (noop, main_args), [(noop, post[1]) for post in posts], shapes)

    frb._record, frb.TILE = record, 4
    world, shard = 8, 16
    q, k, lse = torch.randn(1, shard, 4, 8), torch.randn(1, shard, 2, 8), torch.randn(1, 4, shard)
    rows = []
    print(f"{'rank':>4} {'blocks':>6} {'shared preprocess':>18} {'one a row set':>14} {'whole backward':>15} "
          f"{'scratch a block':>17} {'half folded, glue':>18}   (µs a backward, CPU)")
    for rank in a.ranks:
        blocks = _fused_blocks(rank, world, shard * world, True, "zigzag", (1, 3, 4), 0, frb.TILE)
        kv = torch.randn(1, max(c.stop for _, c, _ in blocks), 2, 8)

        def backward():
            kept = frb.FA4RingBackward(q, q, q, lse, k, 0.3, True, "zigzag")
            kept.prepare(blocks)
            for r, c, causal in blocks:
                kept.block(kv, kv, r, c, causal)

        us = {}
        for share in ("1", "0"):
            with knobs.override(FA4_RING_SHARE_PRE=share):
                us[share] = _fastest_round(backward, a.calls)
        for keep in ("1", "0"):   # the later blocks' dK/dV scratch kept per ring shape, or torch.zeros a block
            with knobs.override(FA4_RING_KEEP_SCRATCH=keep):
                us["whole" + keep] = _whole_backward(rank, world, shard, a.calls, ResidentRing, rank_rows,
                                                     _ring_backward, fa4_pretended)
        with _triton_glue_skipped(), knobs.override(FA4_RING_FOLD="half"):
            us["half"] = _whole_backward(rank, world, shard, a.calls, ResidentRing, rank_rows, _ring_backward,
                                         fa4_pretended)
        rows.append({"rank": rank, "blocks": len(blocks), "shared_us": us["1"], "per_set_us": us["0"],
                     "whole_backward_us": us["whole1"], "whole_backward_scratch_a_block_us": us["whole0"],
                     "whole_backward_half_folded_glue_us": us["half"]})
        print(f"{rank:>4} {len(blocks):>6} {us['1']:>18.1f} {us['0']:>14.1f} {us['whole1']:>15.1f} "
              f"{us['whole0']:>17.1f} {us['half']:>18.1f}")
    frb.release_prepared()
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "calls": a.calls, "rows": rows}, f, indent=1)
        print(f"wrote {a.json}")


@contextlib.contextmanager
def _triton_glue_skipped():
    """Triton's glue and dQ finish on the CPU with their launches skipped: their host work, not their results."""
    from distlab import knobs
    from distlab.kernels import triton_dq_finish as fin

    saved, env = fin.window_order, os.environ.get("TRITON_INTERPRET")
    order = torch.zeros(fin.WINDOW * 128, dtype=torch.int32)
    fin.window_order = lambda post, dim, dtype, device: order[:fin.WINDOW * dim]
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with knobs.override(TRITON_LAUNCH="skip"):
            yield
    finally:
        fin.window_order = saved
        if env is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = env


def _whole_backward(rank, world, shard, calls, ResidentRing, rank_rows, ring_backward, fa4_pretended):
    """µs of one rank's whole fused ring backward (groups 1|3|4, the ring dK/dV route), K/V resident."""
    seq = world * shard
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, seq, 4, 8, generator=g), torch.randn(1, seq, 2, 8, generator=g)
    rows = {r: rank_rows(r, world, seq, "zigzag") for r in range(world)}
    kv = [(k[:, rows[(rank - i) % world]].contiguous(),) * 2 for i in range(world)]
    ring, q_r, lse = ResidentRing(world, rank, kv), q[:, rows[rank]].contiguous(), torch.randn(1, 4, shard)
    with fa4_pretended():
        return _fastest_round(lambda: ring_backward(q_r, q_r, *kv[0], q_r, lse, ring, True, "zigzag", 0.3, "fa4",
                                                    (1, 3, 4), "ring"), calls)


def _fastest_round(fn, calls: int, rounds: int = ROUNDS) -> float:
    """µs a call of ``fn()``: the fastest of ``rounds`` rounds of ``calls // rounds`` calls, after 5 warm-up calls
    (a shared CPU's noise moved a single round's figure by up to 2× between runs)."""
    for _ in range(5):
        fn()
    n, best = max(calls // rounds, 1), float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


if __name__ == "__main__":
    main()
