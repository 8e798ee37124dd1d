"""FP8 GEMMs with per-tensor, row-wise and 128-block scales; the quantisers in PyTorch and in Triton.

    python -m distlab.kernels.fp8                        # GPU: error vs bf16 and speed, each granularity
    python -m distlab.kernels.fp8 --device cpu --m 256 --n 256 --k 512 --iters 1   # the code path on CPU

E4M3 (``torch.float8_e4m3fn``, largest finite 448) holds ~2 significant digits, so a tensor is stored as
``q = x / s`` in FP8 with a *scale* ``s = amax / 448`` per group, and ``x ≈ q · s``. The group is what
this module compares:

- ``tensor``: one scale for the tensor: one outlier channel shrinks every other value towards FP8's
  subnormals;
- ``row``: one scale per row of the activations and per output row of the weights (``RowWise``);
- ``block``: DeepSeek-V3's recipe: activations per 1 × 128 group along K, weights per 128 × 128 tile
  (``BlockWise1x128`` × ``BlockWise128x128``): an outlier only costs its own 128 values.

``quantize(x, granularity)`` is the PyTorch reference, ``quantize_triton(x, granularity)`` distlab's kernel
(one program per row: the row's amax per 128-group, then the scaled, saturated values; "row" and "block";
the 128 × 128 weight tiles use the reference, a once-per-step cost). ``fp8_matmul(a, b, granularity)``
computes ``a @ bᵀ`` (a: (M, K) activations, b: (N, K) weights) through ``torch.nn.functional.scaled_mm``
(or ``torch._scaled_mm``), bf16 out; ``dequantized_matmul`` is the same arithmetic in float32, its
numerical reference. The study prints, for Gaussian and outlier-heavy activations (a few channels ×100,
as LLM activations have), each granularity's error against the float32 product next to bf16's, and the
time of the GEMM (and of quantising the activations) against the bf16 GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GRANULARITIES = ("tensor", "row", "block")
GROUP = 128


def _check(x, granularity, weight=False):
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity {granularity!r}: one of {', '.join(GRANULARITIES)}")
    if x.dim() != 2 or not x.is_floating_point() or x.dtype == FP8:
        raise ValueError(f"quantize: a 2-D float tensor (not already FP8); got {tuple(x.shape)} {x.dtype}")
    if granularity == "block" and (x.shape[1] % GROUP or (weight and x.shape[0] % GROUP)):
        raise ValueError(f"block scales need K{' and N' if weight else ''} multiples of {GROUP}; got {tuple(x.shape)}")


def _scale(amax):
    return (amax.float() / FP8_MAX).clamp_min(1e-12)


def quantize(x, granularity: str, weight: bool = False):
    """(q in FP8, scale float32) with ``x ≈ q · scale`` broadcast per group: tensor (), row (M, 1), block
    (M, K/128) for activations or (N/128, K/128) for ``weight`` (128 × 128 tiles)."""
    _check(x, granularity, weight)
    m, k = x.shape
    xf = x.float()
    if granularity == "tensor":
        s = _scale(xf.abs().amax())
        expanded = s
    elif granularity == "row":
        s = _scale(xf.abs().amax(1, keepdim=True))
        expanded = s
    elif weight:
        s = _scale(xf.abs().view(m // GROUP, GROUP, k // GROUP, GROUP).amax((1, 3)))
        expanded = s.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
    else:
        s = _scale(xf.abs().view(m, k // GROUP, GROUP).amax(2))
        expanded = s.repeat_interleave(GROUP, 1)
    return (xf / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def dequantize(q, s, granularity: str, weight: bool = False):
    if granularity in ("tensor", "row"):
        return q.float() * s
    if weight:
        return q.float() * s.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
    return q.float() * s.repeat_interleave(GROUP, 1)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_rows(X, Q, S, k, groups, fp8_max, BLOCK: tl.constexpr):
        """One row, ``groups`` groups of BLOCK columns: 128, or the whole row (padded) for one scale a row."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        for g in range(groups):
            offs = g * BLOCK + cols
            x = tl.load(X + row * k + offs, mask=offs < k, other=0.0).to(tl.float32)
            s = tl.maximum(tl.max(tl.abs(x), 0) / fp8_max, 1e-12)
            q = tl.minimum(tl.maximum(x / s, -fp8_max), fp8_max)
            tl.store(Q + row * k + offs, q.to(Q.dtype.element_ty), mask=offs < k)
            tl.store(S + row * groups + g, s)

    return quant_rows


_QUANT = None


def quantize_triton(x, granularity: str, out_dtype=FP8):
    """The activations' quantiser as one Triton kernel: ``row`` or ``block`` (1 × 128); same contract as
    ``quantize``. ``out_dtype=torch.float32``: the scaled, saturated values before the cast to FP8 (the CPU
    tests use it: Triton's interpreter converts to FP8 wrongly, e.g. 7.8 to 4.0)."""
    global _QUANT
    import triton

    if granularity not in ("row", "block"):
        raise ValueError(f"quantize_triton: row or block scales (a tensor-wise scale needs the whole tensor's "
                         f"amax first); got {granularity!r}")
    _check(x, granularity)
    _QUANT = _QUANT or _kernel()
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=out_dtype, device=x.device)
    if granularity == "row":
        s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        _QUANT[(m,)](x, q, s, k, 1, FP8_MAX, BLOCK=triton.next_power_of_2(k), num_warps=8)
    else:
        s = torch.empty(m, k // GROUP, dtype=torch.float32, device=x.device)
        _QUANT[(m,)](x, q, s, k, k // GROUP, FP8_MAX, BLOCK=GROUP, num_warps=4)
    return q, s


def dequantized_matmul(a, b, granularity: str):
    """``a @ bᵀ`` from the FP8 values and scales, in float32: what an FP8 GEMM computes, up to its
    accumulation order."""
    qa, sa = quantize(a, granularity)
    qb, sb = quantize(b, granularity, weight=True)
    return dequantize(qa, sa, granularity) @ dequantize(qb, sb, granularity, weight=True).t()


def fp8_matmul(a, b, granularity: str, quantized=None, out_dtype=torch.bfloat16):
    """``a @ bᵀ`` (a: (M, K), b: (N, K)) as an FP8 GEMM with ``granularity`` scales; ``quantized``: the
    ((qa, sa), (qb, sb)) already made (the weights are quantised once a step, not per GEMM)."""
    (qa, sa), (qb, sb) = quantized or (quantize(a, granularity), quantize(b, granularity, weight=True))
    scaled_mm = getattr(F, "scaled_mm", None)
    if scaled_mm is not None:
        kind = F.ScalingType
        if granularity == "block":   # cuBLAS wants the scales K-group major: (M, K/128) and (K/128, N/128) column-major
            return scaled_mm(qa, qb.t(), sa.t().contiguous().t(), kind.BlockWise1x128, sb.t(),
                             kind.BlockWise128x128, output_dtype=out_dtype)
        recipe = kind.TensorWise if granularity == "tensor" else kind.RowWise
        return scaled_mm(qa, qb.t(), sa, recipe, sb if granularity == "tensor" else sb.t().contiguous(), recipe,
                         output_dtype=out_dtype)
    if granularity == "block":
        raise ValueError("block-scaled FP8 GEMMs need torch.nn.functional.scaled_mm (torch >= 2.10)")
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb if granularity == "tensor" else sb.t().contiguous(),
                            out_dtype=out_dtype)


def activations(m, k, outliers: bool, device, seed=0):
    """Gaussian activations, or with ``outliers`` 0.5% of the channels ×100 (LLM.int8's emergent features)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g)
    if outliers:
        x[:, torch.randperm(k, generator=g, device=device)[:max(1, k // 200)]] *= 100
    return x


def error_rows(m, n, k, device) -> list[dict]:
    """Relative Frobenius error of each way against the float32 product: bf16 GEMM, FP8 per granularity."""
    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(n, k, device=device, generator=g) / k ** 0.5
    for outliers in (False, True):
        a = activations(m, k, outliers, device)
        exact = a @ w.t()
        norm = exact.norm().item()
        ways = {"bf16": lambda: (a.bfloat16() @ w.bfloat16().t()).float()}
        for gran in GRANULARITIES:
            ways[f"fp8 {gran}"] = lambda gran=gran: fp8_matmul(a, w, gran).float()
            ways[f"fp8 {gran}, float32 ref"] = lambda gran=gran: dequantized_matmul(a, w, gran)
        for name, fn in ways.items():
            try:
                err = ((fn() - exact).norm() / norm).item()
            except (RuntimeError, ValueError) as e:   # a granularity this torch/GPU has no GEMM for
                err, name = None, f"{name} ({str(e).splitlines()[0][:60]})"
            rows.append({"activations": "outliers" if outliers else "gaussian", "way": name, "rel_error": err})
    return rows


def main(argv=None):
    from distlab.bench import StudyParser, add_common_args, device_of, positive_int, timeit, write_json

    p = StudyParser(prog="python -m distlab.kernels.fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=positive_int, default=16384)
    p.add_argument("--n", type=positive_int, default=4096)
    p.add_argument("--k", type=positive_int, default=14336)
    add_common_args(p, iters=20, warmup=5, dtype=False, gpu_tool=True)
    a = p.parse_args(argv)
    dev = device_of(a, "the FP8 study", gpu_tool=True, cpu_hint="--device cpu --m 256 --n 256 --k 512 --iters 1")
    errors = error_rows(a.m, a.n, a.k, dev)
    print(f"error against the float32 product, {a.m} x {a.n} x {a.k}:")
    for r in errors:
        err = "-" if r["rel_error"] is None else f"{r['rel_error']:.2e}"
        print(f"  {r['activations']:<9} {r['way']:<24} {err}")
    x = activations(a.m, a.k, False, dev).bfloat16()
    w = (torch.randn(a.n, a.k, device=dev) / a.k ** 0.5).bfloat16()
    flops = 2 * a.m * a.n * a.k
    speed = [{"way": "bf16", "gemm_ms": 1e3 * timeit(lambda: x @ w.t(), a.iters, a.warmup, dev),
              "wall_ms": 1e3 * timeit(lambda: x @ w.t(), a.iters, a.warmup, dev, mode="wall")}]
    for gran in GRANULARITIES:
        try:
            made = (quantize(x, gran), quantize(w, gran, weight=True))
            t = timeit(lambda: fp8_matmul(x, w, gran, made), a.iters, a.warmup, dev)
            qt = timeit(lambda: quantize(x, gran), a.iters, a.warmup, dev)
            qtt = timeit(lambda: quantize_triton(x, gran), a.iters, a.warmup, dev) if gran != "tensor" and \
                dev.type == "cuda" else None
            wall = timeit(lambda: fp8_matmul(x, w, gran, made), a.iters, a.warmup, dev, mode="wall")
            speed.append({"way": f"fp8 {gran}", "gemm_ms": 1e3 * t, "quant_ref_ms": 1e3 * qt,
                          "quant_triton_ms": qtt and 1e3 * qtt, "wall_ms": 1e3 * wall})
        except (RuntimeError, ValueError) as e:
            speed.append({"way": f"fp8 {gran}", "error": str(e).splitlines()[0][:100]})
    print(f"{'way':<12} {'GEMM ms':>9} {'TFLOP/s':>8} {'quantise x: torch ms':>21} {'Triton ms':>10} "
          f"{'wall ms':>8}")
    for r in speed:
        if "error" in r:
            print(f"{r['way']:<12} not run: {r['error']}")
            continue
        r["tflops"] = flops / r["gemm_ms"] / 1e9
        qr, qtr = r.get("quant_ref_ms"), r.get("quant_triton_ms")
        print(f"{r['way']:<12} {r['gemm_ms']:>9.3f} {r['tflops']:>8.1f} {'-' if qr is None else f'{qr:.3f}':>21} "
              f"{'-' if qtr is None else f'{qtr:.3f}':>10} {r['wall_ms']:>8.3f}")
    if a.json:
        write_json(a.json, {"shape": [a.m, a.n, a.k], "errors": errors, "speed": speed})


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
