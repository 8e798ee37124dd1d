"""How fast does a folded ring block's dK/dV share add into the travelling float32 accumulator? (#24)

    python3 launch/dkv_add_probe.py --json OUT.json      # any CUDA GPU

A folded block (``distlab.kernels.fa4_ring_backward``) returns dK and dV as one ``(2, 1, keys, kv_heads, dim)``
tensor in bf16; a ring step's share is a key range of it, which for dK and dV together is two separate
chunks: PyTorch adds such a view with its generic strided kernel (45 µs a share at S32768 in the H100
timeline, against ~30 for the bytes). This times the one add against one add each for dK and dV
(contiguous), and the one sum of 8 bf16 partials an owner would run if each
share went straight to its owner instead of into a travelling accumulator, at S32768's and S8192's shapes (W=8, 8 kv heads, head_dim 128), by CUDA events over many calls.
"""

from __future__ import annotations

import argparse
import json

import torch


def time_us(fn, iters=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / iters


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shard", type=int, nargs="+", default=[4096, 1024])
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = []
    for keys in a.shard:
        acc = torch.zeros(2, 1, keys, 8, 128, device="cuda")
        block = torch.randn(2, 1, 4 * keys, 8, 128, device="cuda").bfloat16()
        part = block[:, :, keys:2 * keys]
        one = lambda: acc.add_(part)                                          # noqa: E731
        two = lambda: [acc[i].add_(part[i]) for i in (0, 1)]                  # noqa: E731
        fp32 = block.float()[:, :, keys:2 * keys]
        old = lambda: acc.add_(fp32)                                          # noqa: E731  the GQA scratch's share
        acc.zero_()
        two()
        assert torch.equal(acc, part.float())   # the two adds land where the one does
        # direct delivery (no travelling accumulator): the owner sums W=8 bf16 partials of its keys at the end
        parts = torch.randn(8, 2, 1, keys, 8, 128, device="cuda").bfloat16()
        final = lambda: parts.sum(0, dtype=torch.float32).to(torch.bfloat16)   # noqa: E731
        row = {"keys": keys, "one_add_us": time_us(one), "two_adds_us": time_us(two),
               "float32_share_us": time_us(old), "sum_of_8_bf16_partials_us": time_us(final)}
        print(row, flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
