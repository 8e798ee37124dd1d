"""Tile sweep of the Triton attention kernels on this GPU: TFLOP/s per (BLOCK_M, BLOCK_N, warps, stages).

    python -m distlab.kernels.tune_attention --json tune.json          # B1·H32·S8192·D128 causal bf16
    python -m distlab.kernels.tune_attention --seq 2048 --seq-k 4096 --no-causal --kv-heads 8 --accumulate --only FWD \
        --config FWD=64,64,4,3 --config FWD=64,64,4,2        # a W=8 S=32k ring step's block, accumulating
    python -m distlab.kernels.tune_attention --seq 1024 --seq-k 512 --no-causal --kv-heads 8 --ring-step --only DQ
                                                             # a W=8 S=8k ring step's dQ kernel (DQ_RING tiles)

For the forward, then the dK/dV kernel (backward timed whole, dQ at its default), then the dQ kernel
(dK/dV at the best found): one line per config, the best of each marked. ``--ring-step`` times the backward
as a ring step runs it (delta and LSE rows given, dQ added into float32, dK/dV written in float32) and
sweeps the ``DKV_RING`` / ``DQ_RING`` tiles. The chosen tiles go into
``distlab/kernels/triton_attention.py``'s ``_GPU_DEFAULTS`` by hand (or ``DISTLAB_TRITON_ATTN_{FWD,DKV,DQ}``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from distlab.bench import timeit
from distlab.kernels.triton_attention import flash_forward
from distlab.kernels.triton_attention_backward import backward_rows, flash_backward
from distlab.bench import StudyParser, run_study

SWEEP = {
    "FWD": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2)],
    "DKV": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
    "DQ": [(128, 64, 8, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 4)],
}


def main(argv=None):
    p = StudyParser(prog="python -m distlab.kernels.tune_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192, help="query rows")
    p.add_argument("--seq-k", type=int, default=None, help="keys (default: --seq; causal needs them equal)")
    p.add_argument("--accumulate", action="store_true", help="forward merges into float32 running (out, lse)")
    p.add_argument("--ring-step", action="store_true",
                   help="backward as a ring step calls it; sweeps the DKV_RING / DQ_RING tiles")
    p.add_argument("--only", nargs="+", choices=tuple(SWEEP), default=tuple(SWEEP))
    p.add_argument("--config", action="append", default=[], metavar="KIND=BM,BN,WARPS,STAGES",
                   help="sweep these instead of the built-in list for KIND (repeatable)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda (bf16); cpu runs float32 under TRITON_INTERPRET=1")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    custom = {}
    for item in a.config:
        kind, _, cfg = item.partition("=")
        if kind not in SWEEP or len(cfg.split(",")) != 4:
            p.error(f"--config {item!r}: use KIND=BM,BN,WARPS,STAGES with KIND one of {', '.join(SWEEP)}")
        custom.setdefault(kind, []).append(tuple(int(x) for x in cfg.split(",")))
    sweep = {kind: custom.get(kind, cfgs) for kind, cfgs in SWEEP.items()}
    sk = a.seq_k or a.seq
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32   # the interpreter's bf16 dot is wrong
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, a.seq, a.heads, a.head_dim, generator=g).to(dev, dtype)
    k = torch.randn(1, sk, a.kv_heads, a.head_dim, generator=g).to(dev, dtype)
    v = torch.randn(1, sk, a.kv_heads, a.head_dim, generator=g).to(dev, dtype)
    dout = torch.randn_like(q)
    flops = 4 * a.seq * sk * a.heads * a.head_dim * (0.5 if a.causal else 1.0)
    out, lse = flash_forward(q, k, v, a.causal)
    acc_out, acc_lse = out.float(), lse.clone()   # running results a ring step merges into

    def forward():
        if a.accumulate:
            return flash_forward(q, k, v, a.causal, None, acc_out, acc_lse, accumulate=True)
        return flash_forward(q, k, v, a.causal)

    rows = backward_rows(dout, out, lse)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    dk_out, dv_out = (torch.empty(t.shape, dtype=torch.float32, device=dev) for t in (k, v))

    def backward():
        if a.ring_step:   # dQ added into dq_acc at every call: only the time matters here
            return flash_backward(dout, q, k, v, out, lse, a.causal, rows=rows, dq_acc=dq_acc, dk_out=dk_out,
                                  dv_out=dv_out)
        return flash_backward(dout, q, k, v, out, lse, a.causal)

    results, best = [], {}
    for kind in (x for x in SWEEP if x in a.only):
        for cfg in sweep[kind]:
            env = f"DISTLAB_TRITON_ATTN_{kind}{'_RING' if a.ring_step and kind != 'FWD' else ''}"
            os.environ[env] = ",".join(map(str, cfg))
            try:
                if kind == "FWD":
                    t = timeit(forward, a.iters, 2, dev)
                    tf = flops / t / 1e12
                else:
                    t = timeit(backward, a.iters, 2, dev)
                    tf = 2.5 * flops / t / 1e12
            except Exception as e:   # out of shared memory / registers for this tile
                print(f"{kind:<4} {cfg}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})", flush=True)
                continue
            results.append({"kernel": kind, "config": cfg, "ms": t * 1e3, "tflops": tf})
            print(f"{kind:<4} {str(cfg):<20} {t * 1e3:8.3f} ms {tf:8.1f} TFLOP/s", flush=True)
            if tf > best.get(kind, (None, 0))[1]:
                best[kind] = (cfg, tf)
        if kind in best:
            os.environ[env] = ",".join(map(str, best[kind][0]))
            print(f"best {kind}: {best[kind][0]} at {best[kind][1]:.1f} TFLOP/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "args": vars(a), "results": results,
                       "best": {k: {"config": c, "tflops": t} for k, (c, t) in best.items()}}, f, indent=1)


if __name__ == "__main__":
    run_study(main)
