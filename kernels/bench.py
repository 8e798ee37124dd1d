"""Benchmark the attention backends against PyTorch's own SDPA on the same GPU, in one run.

    python -m kernels.bench --seq 8192 --heads 32 --head-dim 128 --causal --json bench.json

For each backend of ``kernels.attention`` present for the dtype: forward (``attention_forward``) and
backward (``attention_backward``, given the forward's out and lse) times, and TFLOP/s as FlashAttention
counts them (4·b·s²·h·d forward, halved when causal; backward 2.5× forward). The anchors are
``torch.nn.functional.scaled_dot_product_attention`` pinned to the cuDNN and the flash kernels, timed
the same way (backward = autograd's backward alone). Times are medians of CUDA-event-timed runs after
warm-up. On CPU it runs too (the ``torch`` backend, small default sizes), as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.attention import attention_backward, attention_forward, available_backends

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timeit(fn, iters, warmup, device):
    """Median seconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flops(b, s, h, d, causal):
    return 4 * b * s * s * h * d * (0.5 if causal else 1.0)


def bench_backend(name, q, k, v, dout, causal, iters, warmup):
    out, lse = attention_forward(q, k, v, causal, backend=name)
    t_f = timeit(lambda: attention_forward(q, k, v, causal, backend=name), iters, warmup, q.device)
    t_b = timeit(lambda: attention_backward(dout, q, k, v, out, lse, causal, backend=name), iters, warmup, q.device)
    return t_f, t_b


def bench_sdpa_anchor(kernel, q, k, v, dout, causal, iters, warmup):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    qh, kh, vh = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    with sdpa_kernel(getattr(SDPBackend, kernel)):
        t_f = timeit(lambda: sdpa(qh, kh, vh, is_causal=causal, enable_gqa=gqa), iters, warmup, q.device)
        out = sdpa(qh, kh, vh, is_causal=causal, enable_gqa=gqa)
        g = dout.transpose(1, 2)
        t_b = timeit(lambda: torch.autograd.grad(out, (qh, kh, vh), g, retain_graph=True), iters, warmup, q.device)
    return t_f, t_b


def main(argv=None):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192 if gpu else 1024)
    p.add_argument("--heads", type=int, default=32 if gpu else 4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128 if gpu else 32)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", choices=DTYPES, default="bf16" if gpu else "fp32")
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if gpu else "cpu")
    dtype = DTYPES[args.dtype]
    kvh = args.kv_heads or args.heads
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(args.batch, args.seq, args.heads, args.head_dim, generator=g).to(dev, dtype)
    k = torch.randn(args.batch, args.seq, kvh, args.head_dim, generator=g).to(dev, dtype)
    v = torch.randn(args.batch, args.seq, kvh, args.head_dim, generator=g).to(dev, dtype)
    dout = torch.randn_like(q)
    f = flops(args.batch, args.seq, args.heads, args.head_dim, args.causal)

    rows = []
    for name in available_backends(dev, dtype):
        if name == "torch" and gpu:
            continue  # the reference is for correctness, not speed
        rows.append((name, *bench_backend(name, q, k, v, dout, args.causal, args.iters, args.warmup)))
    if gpu and dtype != torch.float32:
        for kernel in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            try:
                rows.append((f"anchor: F.sdpa {kernel.split('_')[0].lower()}",
                             *bench_sdpa_anchor(kernel, q, k, v, dout, args.causal, args.iters, args.warmup)))
            except RuntimeError as e:  # kernel not available for this shape/GPU
                print(f"(anchor {kernel} skipped: {str(e).splitlines()[0]})")

    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"attention on {name}, torch {torch.__version__}: batch {args.batch} · seq {args.seq} · heads "
          f"{args.heads} (kv {kvh}) · head_dim {args.head_dim} · {args.dtype} · "
          f"{'causal' if args.causal else 'full'}")
    print(f"{'backend':<26} {'fwd ms':>9} {'fwd TFLOP/s':>12} {'bwd ms':>9} {'bwd TFLOP/s':>12}")
    results = []
    for label, t_f, t_b in rows:
        tf, tb = f / t_f / 1e12, 2.5 * f / t_b / 1e12
        print(f"{label:<26} {t_f * 1e3:>9.3f} {tf:>12.1f} {t_b * 1e3:>9.3f} {tb:>12.1f}")
        results.append({"backend": label, "fwd_s": t_f, "bwd_s": t_b, "fwd_tflops": tf, "bwd_tflops": tb})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "torch": torch.__version__, "args": vars(args), "results": results}, fh,
                      indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
