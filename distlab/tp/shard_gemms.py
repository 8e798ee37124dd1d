"""One TP rank's GEMMs of the Llama block at each TP degree, timed on one GPU against cuBLAS at full size.

    python -m distlab.tp.shard_gemms --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --tokens 8192 --tp 1 2 4 8

TP's "shard math": at degree tp each rank runs the block's four projections with one dimension cut by tp
(QKV and gate/up: output features; O and down: input features), forward (Y = X Wᵀ), input gradient
(dX = dY W) and weight gradient (dW = dYᵀ X). Smaller GEMMs run at lower TFLOP/s; this measures how much,
so a TP block's time can be compared with what its shards can do (the bar: not 2× slower than that).
The anchor is one square bf16 GEMM of ``--anchor`` (8192³) in the same run.
"""

from __future__ import annotations

import json

import torch

from distlab.bench import StudyParser, add_common_args, device_of, positive_int, run_study, timeit


def layer_shapes(hidden, ffn, heads, kv_heads, tp):
    """(name, in, out) of each projection on one rank at degree tp (kv heads replicated when kv < tp)."""
    d = hidden // heads
    kv = max(kv_heads, tp)
    return [("qkv", hidden, (heads + 2 * kv) * d // tp), ("o", hidden // tp, hidden),
            ("gate_up", hidden, 2 * ffn // tp), ("down", ffn // tp, hidden)]


def main(argv=None):
    p = StudyParser(prog="python -m distlab.tp.shard_gemms", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=positive_int, default=4096)
    p.add_argument("--ffn", type=positive_int, default=14336)
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--tokens", type=positive_int, default=8192, help="batch × sequence")
    p.add_argument("--tp", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--anchor", type=positive_int, default=8192)
    add_common_args(p, iters=20, warmup=3, dtype=False, gpu_tool=True)
    a = p.parse_args(argv)
    dev = device_of(a, "distlab.tp.shard_gemms", gpu_tool=True)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    if not gpu:
        a.tokens, a.hidden, a.ffn, a.anchor, a.iters = min(a.tokens, 256), min(a.hidden, 256), min(a.ffn, 512), 256, 2
    n = a.anchor
    A, B = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    anchor = 2 * n**3 / timeit(lambda: A @ B, a.iters, a.warmup, dev) / 1e12
    print(f"one TP rank's GEMMs, {a.tokens} tokens, hidden {a.hidden}, ffn {a.ffn}, heads {a.heads} (kv {a.kv_heads}), "
          f"{str(dtype)[6:]}, {torch.cuda.get_device_name() if gpu else 'cpu'}; anchor {n}^3 GEMM: {anchor:.1f} TFLOP/s")
    print(f"{'tp':>3} {'layer':<8} {'in':>6} {'out':>6} {'fwd TF/s':>9} {'dgrad TF/s':>11} {'wgrad TF/s':>11}")
    rows = []
    for tp in a.tp:
        total_flops, total_time = 0.0, 0.0
        for name, fin, fout in layer_shapes(a.hidden, a.ffn, a.heads, a.kv_heads, tp):
            x = torch.randn(a.tokens, fin, device=dev, dtype=dtype)
            w = torch.randn(fout, fin, device=dev, dtype=dtype)
            dy = torch.randn(a.tokens, fout, device=dev, dtype=dtype)
            f = 2 * a.tokens * fin * fout
            times = [timeit(fn, a.iters, a.warmup, dev) for fn in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x)]
            total_flops += 3 * f
            total_time += sum(times)
            print(f"{tp:>3} {name:<8} {fin:>6} {fout:>6} " + " ".join(f"{f / t / 1e12:>{wd}.1f}" for t, wd in zip(times, (9, 11, 11))))
            rows.append({"tp": tp, "layer": name, "in": fin, "out": fout, "fwd_s": times[0], "dgrad_s": times[1],
                         "wgrad_s": times[2], "flops": f})
        print(f"{tp:>3} {'all':<8} {'':>6} {'':>6} {total_flops / total_time / 1e12:>9.1f}  "
              f"(fwd+bwd GEMMs {total_time * 1e3:.3f} ms = {total_flops / total_time / 1e12 / anchor * 100:.0f}% of the anchor)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "anchor_tflops": anchor, "rows": rows}, fh, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    run_study(main)
