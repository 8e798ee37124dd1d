"""Every kernel of ``kernels/`` against its anchor on the same GPU, in one run and one table.

    python -m distlab.kernels.bench --seq 8192 --heads 32 --head-dim 128 --causal --json bench.json
    python -m distlab.kernels.bench --only memory          # RMSNorm+residual, RoPE, SwiGLU, softmax, LSE merge

Memory-bound kernels (Triton: RMSNorm with the residual add, RoPE on q and k, SwiGLU, the online softmax,
the LSE merge) are reported in GB/s of the bytes they must move, as a percentage of a device-to-device copy
measured in the same run, next to ``torch.compile`` of their PyTorch reference (fwd, and fwd+bwd through
autograd) and, when ``liger_kernel`` is importable, Liger-Kernel's own kernel on the same problem (its
layout: RoPE in (b, h, s, d)), timed in the same process.

For each backend of ``distlab.kernels.attention`` present for the dtype: forward (``attention_forward``) and
backward (``attention_backward``, given the forward's out and lse) times, and TFLOP/s as FlashAttention
counts them (4·b·s²·h·d forward, halved when causal; backward 2.5× forward). The anchors are
``torch.nn.functional.scaled_dot_product_attention`` pinned to the cuDNN and the flash kernels, timed
the same way (backward = autograd's backward alone). Times are medians of CUDA-event-timed runs after
warm-up. On CPU it runs too (the ``torch`` backend, small default sizes), as a smoke test.
"""

from __future__ import annotations

import argparse
import json

import torch

from distlab import knobs
from distlab.kernels.attention import attention_backward, attention_forward, available_backends
from distlab.bench import DTYPES, StudyParser, dtype_arg, run_study, timeit



def flops(b, s, h, d, causal):
    return 4 * b * s * s * h * d * (0.5 if causal else 1.0)


def bench_backend(name, q, k, v, dout, causal, iters, warmup):
    """(fwd, bwd) seconds of the backend's call in the two modes: GPU (queued) then wall (back to back)."""
    out, lse = attention_forward(q, k, v, causal, backend=name)
    fwd = lambda: attention_forward(q, k, v, causal, backend=name)  # noqa: E731
    bwd = lambda: attention_backward(dout, q, k, v, out, lse, causal, backend=name)  # noqa: E731
    return tuple(timeit(fn, iters, warmup, q.device, mode) for mode in ("gpu", "wall") for fn in (fwd, bwd))


def bench_sdpa_anchor(kernel, q, k, v, dout, causal, iters, warmup):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    qh, kh, vh = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    with sdpa_kernel(getattr(SDPBackend, kernel)):
        out = sdpa(qh, kh, vh, is_causal=causal, enable_gqa=gqa)
        g = dout.transpose(1, 2)
        fwd = lambda: sdpa(qh, kh, vh, is_causal=causal, enable_gqa=gqa)  # noqa: E731
        bwd = lambda: torch.autograd.grad(out, (qh, kh, vh), g, retain_graph=True)  # noqa: E731
        return tuple(timeit(fn, iters, warmup, q.device, mode) for mode in ("gpu", "wall") for fn in (fwd, bwd))


def copy_bandwidth(device, iters, warmup, nbytes=2**30):
    """Device-to-device copy: bytes read + written per second (the memory-bound kernels' anchor)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / timeit(lambda: y.copy_(x), iters, warmup, device)


def bandwidth_row(fn, moved: int, copy: float, iters: int, warmup: int, device) -> dict:
    """``fn`` timed on the GPU clock and the wall clock, and the rate at which it moves ``moved`` bytes, in GB/s and
    as a share of ``copy`` (``copy_bandwidth``): a memory-bound pass's row."""
    gpu, wall = (timeit(fn, iters, warmup, device, mode=m) for m in ("gpu", "wall"))
    return {"gpu_us": gpu * 1e6, "wall_us": wall * 1e6, "GB_s": moved / gpu / 1e9, "pct_copy": 100 * moved / gpu / copy}


def bandwidth_cells(row: dict) -> str:
    """``bandwidth_row``'s numbers as table cells: GPU µs, wall µs, GB/s, % of copy."""
    return f"{row['gpu_us']:>8.1f} {row['wall_us']:>8.1f} {row['GB_s']:>7.0f} {row['pct_copy']:>6.0f}%"


def memory_bound_cases(dev, dtype):
    """(name, make inputs, triton fn, reference fn, bytes fwd, bytes fwd+bwd) at Llama-8B-like sizes."""
    from distlab.kernels.lse_merge import lse_merge_
    from distlab.kernels.rmsnorm import rmsnorm_residual, rmsnorm_residual_reference
    from distlab.kernels.rope import rope_qk, rope_reference, rope_tables
    from distlab.kernels.swiglu import swiglu, swiglu_reference
    from distlab.kernels.lse_merge import merge_into
    from distlab.kernels.softmax import softmax_triton

    gpu = dev.type == "cuda"
    rows, hidden, ffn = (16384, 4096, 14336) if gpu else (256, 256, 512)
    b, s, hq, hk, d = (4, 4096, 32, 8, 128) if gpu else (1, 128, 4, 2, 32)
    e = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dt=dtype, grad=True):
        return torch.randn(*shape, generator=g).to(dev, dt).requires_grad_(grad)

    def norm_inputs():
        return (rnd(rows, hidden), rnd(rows, hidden), rnd(hidden, dt=torch.float32)), \
            (rnd(rows, hidden, grad=False), rnd(rows, hidden, grad=False))

    def rope_inputs():
        cos, sin = rope_tables(torch.arange(s), d, 10000.0, dev)
        return (rnd(b, s, hq, d), rnd(b, s, hk, d), cos, sin), (rnd(b, s, hq, d, grad=False), rnd(b, s, hk, d, grad=False))

    def rope_ref(q, k, cos, sin):
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin)

    def swiglu_inputs():
        return (rnd(rows // 2, 2 * ffn),), (rnd(rows // 2, ffn, grad=False),)

    def merge_inputs():
        return (rnd(b // 4 or 1, 2 * s, hq, d, dt=torch.float32, grad=False), rnd(b // 4 or 1, hq, 2 * s, dt=torch.float32, grad=False),
                rnd(b // 4 or 1, 2 * s, hq, d, grad=False), rnd(b // 4 or 1, hq, 2 * s, dt=torch.float32, grad=False)), None

    n_norm, n_q, n_k, n_sw = rows * hidden, b * s * hq * d, b * s * hk * d, rows // 2 * ffn
    n_m = (b // 4 or 1) * 2 * s * hq
    return [
        ("rmsnorm+residual", norm_inputs, rmsnorm_residual, rmsnorm_residual_reference,
         4 * n_norm * e, 4 * n_norm * e + 4 * n_norm * e),        # fwd: x, r -> y, h; bwd: dy, dh, h -> dx
        ("rope q+k", rope_inputs, rope_qk, rope_ref, 2 * (n_q + n_k) * e, 4 * (n_q + n_k) * e),
        ("swiglu", swiglu_inputs, swiglu, swiglu_reference, 3 * n_sw * e, 3 * n_sw * e + 5 * n_sw * e),
        ("softmax", lambda: ((rnd(rows, hidden, grad=False),), None), softmax_triton,
         lambda x: torch.softmax(x.float(), -1).to(x.dtype), 2 * n_norm * e, None),
        ("lse merge", merge_inputs, lambda o, l, bo, bl: lse_merge_(o, l, bo, bl),
         lambda o, l, bo, bl: merge_into(o, l, bo, bl), n_m * d * (8 + e) + 3 * n_m * 4, None),
    ]


def liger_cases(dev, dtype):
    """Liger-Kernel's versions of the memory-bound kernels (the curriculum's anchor), by case name: (make
    inputs in Liger's layout, fn), at the sizes of ``memory_bound_cases``; {} when liger_kernel is not
    installed. Its RoPE takes (batch, heads, seq, d) and a (seq, d) cos/sin: given so, no transposes timed."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except ImportError:
        return {}
    same = {name: make for name, make, *_ in memory_bound_cases(dev, dtype)}   # the same inputs where layouts agree
    b, s, hq, hk, d = 4, 4096, 32, 8, 128
    g = torch.Generator().manual_seed(0)

    def rope():
        def rnd(*shape, grad=True):
            return torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_(grad)

        ang = torch.arange(s, device=dev)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, device=dev) / d)
        ang = torch.cat([ang, ang], -1)
        return (rnd(b, hq, s, d), rnd(b, hk, s, d), ang.cos().to(dtype), ang.sin().to(dtype)), \
            (rnd(b, hq, s, d, grad=False), rnd(b, hk, s, d, grad=False))

    return {"rmsnorm+residual": (same["rmsnorm+residual"], lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6)),
            "rope q+k": (rope, lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)),
            "swiglu": (same["swiglu"], lambda y: LigerFusedGateUpSiLUMulFunction.apply(y)),
            "softmax": (same["softmax"], lambda x: LigerSoftmaxFunction.apply(x))}


def _maybe(timed):
    """torch.compile's time, or None (printed) when it cannot compile the reference."""
    try:
        return timed()
    except Exception as e:  # noqa: BLE001 - inductor raises many kinds
        print(f"(torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:100]})")
        return None


def _fwd_bwd(fn, inputs, grads):
    """Forward and backward to the inputs' gradients, returned (autograd.grad), not accumulated into the
    leaves' ``.grad`` (which would add a read-add-write of every gradient to each timed pass)."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.grad(outs, leaves, grads)
    return run


def bench_memory_bound(dev, dtype, iters, warmup, compile_ref=True, only=None):
    """Rows for the table: each kernel's GB/s fwd and fwd+bwd, % of copy bandwidth, vs torch.compile."""
    bw = copy_bandwidth(dev, iters, warmup) if dev.type == "cuda" else None
    rows = []
    liger = liger_cases(dev, dtype) if dev.type == "cuda" else {}
    for name, make, fn, ref, bytes_f, bytes_fb in memory_bound_cases(dev, dtype):
        if only and only not in name:
            continue
        inputs, grads = make()
        compiled = torch.compile(ref) if compile_ref and dev.type == "cuda" else None
        l_make, l_fn = liger.get(name, (None, None))
        l_inputs, l_grads = l_make() if l_make else (None, None)
        for pass_, nbytes in (("fwd", bytes_f), ("fwd+bwd", bytes_fb)):
            if nbytes is None:
                continue
            t_l = None
            if pass_ == "fwd":
                with torch.no_grad():
                    t = timeit(lambda: fn(*inputs), iters, warmup, dev)
                    t_w = timeit(lambda: fn(*inputs), iters, warmup, dev, "wall")
                    t_c = _maybe(lambda: timeit(lambda: compiled(*inputs), iters, warmup, dev)) if compiled else None
                    if l_fn:
                        t_l = timeit(lambda: l_fn(*l_inputs), iters, warmup, dev)
            else:
                t = timeit(_fwd_bwd(fn, inputs, grads), iters, warmup, dev)
                t_w = timeit(_fwd_bwd(fn, inputs, grads), iters, warmup, dev, "wall")
                t_c = _maybe(lambda: timeit(_fwd_bwd(compiled, inputs, grads), iters, warmup, dev)) if compiled else None
                if l_fn:
                    t_l = timeit(_fwd_bwd(l_fn, l_inputs, l_grads), iters, warmup, dev)
            rows.append({"kernel": name, "pass": pass_, "ms": t * 1e3, "rate": nbytes / t / 1e9, "unit": "GB/s",
                         "anchor": "device copy", "anchor_rate": bw / 1e9 if bw else None,
                         "ratio": nbytes / t / bw if bw else None, "compile_ms": t_c * 1e3 if t_c else None,
                         "liger_ms": t_l * 1e3 if t_l else None, "wall_ms": t_w * 1e3})
    return rows


def main(argv=None):
    gpu = torch.cuda.is_available()
    p = StudyParser(prog="python -m distlab.kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192 if gpu else 1024)
    p.add_argument("--heads", type=int, default=32 if gpu else 4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128 if gpu else 32)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", type=dtype_arg("bfloat16", "float16", "float32"), default="bfloat16" if gpu else "float32",
                   help="bf16, fp16 or fp32")
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--only", choices=("attention", "memory"), default=None,
                   help="attention backends only, or the memory-bound kernels only (default: both)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile anchors (tuning sweeps)")
    p.add_argument("--kernel", default=None, help="memory-bound kernels whose name contains this (e.g. swiglu)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if gpu else "cpu")
    dtype = DTYPES[args.dtype]
    kvh = args.kv_heads or args.heads
    name = torch.cuda.get_device_name() if gpu else "cpu"
    table = []
    if args.only in (None, "attention"):
        table += bench_attention(args, dev, dtype, kvh)
    if args.only in (None, "memory") and (gpu or _interpreting()):
        table += bench_memory_bound(dev, dtype, args.iters, args.warmup, compile_ref=not args.no_compile,
                                    only=args.kernel)
    print(f"kernels on {name}, torch {torch.__version__}, {args.dtype}; attention: batch {args.batch} · seq "
          f"{args.seq} · heads {args.heads} (kv {kvh}) · head_dim {args.head_dim} · "
          f"{'causal' if args.causal else 'full'}")
    print(f"{'kernel':<30} {'pass':<8} {'ms':>8} {'rate':>9} {'unit':<8} {'anchor':<22} {'anchor rate':>11} "
          f"{'ratio':>6} {'compile ms':>10} {'Liger ms':>9} {'wall ms':>8}")
    for r in table:
        anchor_rate = f"{r['anchor_rate']:>11.1f}" if r.get("anchor_rate") else f"{'-':>11}"
        ratio = f"{100 * r['ratio']:>5.0f}%" if r.get("ratio") else f"{'-':>6}"
        comp = f"{r['compile_ms']:>10.3f}" if r.get("compile_ms") else f"{'-':>10}"
        liger = f"{r['liger_ms']:>9.3f}" if r.get("liger_ms") else f"{'-':>9}"
        liger += f" {r['wall_ms']:>8.3f}" if r.get("wall_ms") else f" {'-':>8}"
        print(f"{r['kernel']:<30} {r['pass']:<8} {r['ms']:>8.3f} {r['rate']:>9.1f} {r['unit']:<8} "
              f"{r.get('anchor') or '-':<22} {anchor_rate} {ratio} {comp} {liger}")
    if args.json:
        with open(args.json, "w") as fh:
            in_force = {k: v for k, v in knobs.in_force().items() if k.startswith(("DISTLAB_KERNEL", "DISTLAB_TRITON"))}
            json.dump({"device": name, "torch": torch.__version__, "args": vars(args), "env": in_force, "results": table},
                      fh, indent=2)
        print(f"wrote {args.json}")
    return table


def _interpreting():
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def bench_attention(args, dev, dtype, kvh):
    """Rows: every attention backend present (FA4 first when importable; fwd, bwd TFLOP/s, GPU and wall)
    against F.sdpa pinned to cuDNN (the anchor of the ratio column, timed the same way) and to flash."""
    gpu = dev.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(args.batch, args.seq, args.heads, args.head_dim, generator=g).to(dev, dtype)
    k = torch.randn(args.batch, args.seq, kvh, args.head_dim, generator=g).to(dev, dtype)
    v = torch.randn(args.batch, args.seq, kvh, args.head_dim, generator=g).to(dev, dtype)
    dout = torch.randn_like(q)
    f = flops(args.batch, args.seq, args.heads, args.head_dim, args.causal)
    timed = []
    for name in available_backends(dev, dtype):
        if name == "torch" and gpu:
            continue  # the reference is for correctness, not speed
        if name == "triton" and not gpu:
            continue  # the interpreter: correct, not a speed
        timed.append((name, *bench_backend(name, q, k, v, dout, args.causal, args.iters, args.warmup)))
    anchors = {}
    if gpu and dtype != torch.float32:
        for kernel in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            try:
                label = f"F.sdpa {kernel.split('_')[0].lower()}"
                anchors[label] = bench_sdpa_anchor(kernel, q, k, v, dout, args.causal, args.iters, args.warmup)
                timed.append((f"anchor: {label}", *anchors[label]))
            except RuntimeError as e:  # kernel not available for this shape/GPU
                print(f"(anchor {kernel} skipped: {str(e).splitlines()[0]})")
    # the anchor of the ratio column: the fastest single-device call present, FA4 when importable, else cuDNN
    fa4 = next((t[1:] for t in timed if t[0] == "fa4"), None)
    ref, ref_name = (fa4, "fa4") if fa4 else (anchors.get("F.sdpa cudnn"), "F.sdpa cudnn")
    rows = []
    for label, t_f, t_b, w_f, w_b in timed:   # "wall" rows: back-to-back calls, launch latency included
        for pass_, t, fl, t_ref in (("fwd", t_f, f, ref and ref[0]), ("bwd", t_b, 2.5 * f, ref and ref[1]),
                                    ("fwd wall", w_f, f, ref and ref[2]), ("bwd wall", w_b, 2.5 * f, ref and ref[3])):
            rows.append({"kernel": f"attention {label}", "pass": pass_, "ms": t * 1e3, "rate": fl / t / 1e12,
                         "unit": "TFLOP/s", "anchor": ref_name if t_ref else None,
                         "anchor_rate": fl / t_ref / 1e12 if t_ref else None, "ratio": t_ref / t if t_ref else None,
                         "compile_ms": None})
    return rows


if __name__ == "__main__":
    run_study(main)
