"""Calibrate the planner on this machine: kernel rates by call size, launch cost, and (under torchrun) links.

    python -m distlab.plan.calibration --out h200.json                      # on a GPU: bf16, FA4/cuDNN attention
    python -m distlab.plan.calibration --device cpu --threads 1 --out cpu.json
    distlab run --nproc 4 -m distlab.plan.calibration --links-only --out cpu.json   # add gloo/NCCL links at W=4

A calibration file holds, per kernel, rates measured at several call sizes: ``gemm`` (FLOP/s against
FLOPs per call, (t, h)·(h, n) in the run's dtype), ``attention_fwd`` / ``attention_bwd`` with ``_causal``,
``_full`` or ``_masked`` (causal given as a ``KeyMask``, the masked kernels' rate) (FLOP/s as FlashAttention
counts them, 4·pairs·heads·head_dim forward, 2.5× that backward, against visible pairs per head), ``grouped_gemm`` (FLOP/s against FLOPs per call, 8 balanced groups)
and ``copy`` (bytes/s read + written against bytes per call); ``launch_us`` is the wall time of one tiny
op called back to back (Python + launch: what a call costs at least). ``Calibration.rate`` interpolates in
log-size between measured points and says when it extrapolates past the ends: it then holds the end rate,
and above the largest size it does not flag a kernel whose last two rates agree within 10% (saturated).

Under torchrun with W > 1 ranks it sweeps the playground's collectives (``distlab.collectives``) and fits
``time = α + size·factor/busbw`` per op; the link lands in the file as ``links["<backend>-W<W>"]``. With
``--kernels`` it also times the kernels on every rank at once (1 thread each on a CPU: the rates of a
loaded machine, memory-bandwidth contention included, which is what a study's ranks see); launched with
W = the number of cores, that is the CPU calibration the gloo validation uses.
The file names the device it was measured on; the planner refuses to use it for another one.
"""

from __future__ import annotations

import bisect
import datetime
import json
import math
import os

import torch

from distlab.bench import StudyParser, dtype_arg, positive_int, resolve_device, run_study, timeit, time_wall, to_dtype
from distlab.plan.links import Link

KERNELS = ("gemm", "attention_fwd_causal", "attention_bwd_causal", "attention_fwd_full", "attention_bwd_full",
           "attention_fwd_masked", "attention_bwd_masked", "grouped_gemm", "copy")
PEAK_TFLOPS = {"NVIDIA H200": 989.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H800": 989.0,
               "NVIDIA A100-SXM4-80GB": 312.0}   # dense bf16 tensor-core peak (NVIDIA data sheets)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


class Calibration:
    """A calibration file: ``rate(kernel, size)`` and ``links``."""

    def __init__(self, data: dict, path: str = "<memory>"):
        self.data, self.path = data, path
        missing = [k for k in KERNELS if k not in data.get("rates", {})]
        if missing:
            raise ValueError(f"calibration {path} has no rates for {', '.join(missing)}: run "
                             "python -m distlab.plan.calibration on the device again")

    @classmethod
    def load(cls, path: str) -> "Calibration":
        with open(path) as f:
            return cls(json.load(f), path)

    @property
    def device(self) -> str:
        return self.data["device"]

    @property
    def launch_s(self) -> float:
        return self.data["launch_us"] * 1e-6

    def check_device(self, name: str) -> None:
        """ValueError unless this file was measured on ``name`` (or a device derived from it says so)."""
        if name != self.device:
            raise ValueError(f"calibration {self.path} was measured on {self.device!r}, not {name!r}: run "
                             f"python -m distlab.plan.calibration --out FILE on that device and pass --calibration FILE")

    def rate(self, kernel: str, size: float) -> tuple[float, bool]:
        """(rate, extrapolated) for one call of ``size`` (the kernel's size unit, module doc)."""
        points = self.data["rates"][kernel]
        sizes = [p[0] for p in points]
        if size <= sizes[0]:
            return points[0][1], not math.isclose(size, sizes[0], rel_tol=1e-6)
        if size >= sizes[-1]:     # past the top: held, and not flagged when the last two points agree (saturated)
            saturated = len(points) > 1 and abs(points[-1][1] / points[-2][1] - 1) <= 0.1
            return points[-1][1], not (saturated or math.isclose(size, sizes[-1], rel_tol=1e-6))
        i = bisect.bisect_left(sizes, size)
        (s0, r0), (s1, r1) = points[i - 1], points[i]
        w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp((1 - w) * math.log(r0) + w * math.log(r1)), False

    def links(self) -> dict[str, Link]:
        out = {}
        for name, row in self.data.get("links", {}).items():
            out[name] = Link(name, row["alpha_us"], row["busbw_gbs"], row["source"], row.get("overlaps_compute", True),
                             per_op={op: (v["alpha_us"], v["busbw_gbs"]) for op, v in row.get("per_op", {}).items()})
        return out


def _median_rate(fn, work, iters, warmup, device):
    """FLOP/s (or B/s) of ``fn``; under torchrun every rank times it at once (a barrier before each call) and
    the mean over ranks is kept: on a CPU that is the rate with every core busy, as in a study."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return work / timeit(fn, iters, warmup, device)
    from distlab.bench import time_ranks

    t = torch.tensor([time_ranks(fn, iters, warmup, device)], dtype=torch.float64)
    dist.all_reduce(t)
    return work / (t.item() / dist.get_world_size())


def measure_gemm(device, dtype, hidden, sizes, iters, warmup):
    points = []
    for t in sizes:
        a = torch.randn(t, hidden, device=device, dtype=dtype)
        b = torch.randn(hidden, hidden, device=device, dtype=dtype)
        flops = 2 * t * hidden * hidden
        points.append([flops, _median_rate(lambda: a @ b, flops, iters, warmup, device)])
    return points


def measure_attention(device, dtype, heads, kv_heads, head_dim, sizes, backend, causal, iters, warmup,
                      masked=False):
    """``masked``: causal expressed as a ``KeyMask`` over positions, run by the masked kernels (what packed
    documents, windows, all-gather KV and the balanced layout call)."""
    from distlab.kernels.attention import attention_backward, attention_forward, resolve_backend
    from distlab.kernels.masks import document_mask

    fwd, bwd = [], []
    for n in sizes:
        q = torch.randn(1, n, heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(1, n, kv_heads, head_dim, device=device, dtype=dtype)
        v, do = torch.randn_like(k), torch.randn_like(q)
        pos = torch.arange(n)
        mask = document_mask(pos, pos, None, True, None, n).to(device) if masked else None
        be = resolve_backend("auto" if masked and device.type == "cuda" else backend, device, dtype, masked=masked)
        flag = causal and not masked
        o, lse = attention_forward(q, k, v, flag, backend=be, mask=mask)
        pairs = n * (n + 1) / 2 if causal or masked else n * n
        flops = 4 * pairs * heads * head_dim
        fwd.append([pairs, _median_rate(lambda: attention_forward(q, k, v, flag, backend=be, mask=mask), flops,
                                        iters, warmup, device)])
        bwd.append([pairs, _median_rate(lambda: attention_backward(do, q, k, v, o, lse, flag, backend=be, mask=mask),
                                        2.5 * flops, iters, warmup, device)])
    return fwd, bwd


def measure_grouped(device, dtype, hidden, ffn, rows_per_group, iters, warmup, experts=8):
    from distlab.kernels.grouped_gemm import grouped_mm

    points = []
    w = torch.randn(experts, hidden, ffn, device=device, dtype=dtype)
    for r in rows_per_group:
        x = torch.randn(r * experts, hidden, device=device, dtype=dtype)
        flops = 2 * r * experts * hidden * ffn
        points.append([flops, _median_rate(lambda: grouped_mm(x, w, [r] * experts), flops, iters, warmup, device)])
    return points


def measure_copy(device, dtype, sizes, iters, warmup):
    points = []
    for n in sizes:
        src = torch.randn(n // 4, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        points.append([2 * n, _median_rate(lambda: dst.copy_(src), 2 * n, iters, warmup, device)])
    return points


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def measure_launch(device, iters=200):
    x = torch.zeros(1, device=device)
    return time_wall(lambda: x.add_(1), iters, 20, device) * 1e6


def measure_kernels(device, dtype, backend, quick=False) -> dict:
    gpu = device.type == "cuda"
    it, wu = (20, 5) if gpu else (3, 1)
    if gpu:
        heads, kv, d, hidden, ffn = 32, 8, 128, 4096, 14336
        attn_sizes = [512, 1024, 2048, 4096, 8192, 16384, 32768]
        gemm_tokens, grouped_rows = [128, 512, 2048, 8192, 32768], [64, 256, 1024, 4096]
        copy_sizes = [2**s for s in (16, 20, 24, 28, 30)]
    else:
        heads, kv, d, hidden, ffn = 4, 2, 32, 256, 512
        attn_sizes = [128, 256, 512, 1024, 2048, 4096, 8192]
        gemm_tokens, grouped_rows = [16, 64, 256, 1024, 4096], [32, 128, 512]
        copy_sizes = [2**s for s in (12, 16, 20, 24)]
    if quick:
        attn_sizes, gemm_tokens, grouped_rows = attn_sizes[:3], gemm_tokens[:2], grouped_rows[:2]
        copy_sizes = copy_sizes[:2]
    from distlab.kernels.attention import resolve_backend

    backend = resolve_backend(backend, device, dtype)
    rates = {"gemm": measure_gemm(device, dtype, hidden, gemm_tokens, it, wu),
             "grouped_gemm": measure_grouped(device, dtype, hidden, ffn, grouped_rows, it, wu),
             "copy": measure_copy(device, dtype, copy_sizes, it, wu)}
    for tag in ("causal", "full", "masked"):
        f, b = measure_attention(device, dtype, heads, kv, d, attn_sizes, backend, tag == "causal", it, wu,
                                 masked=tag == "masked")
        rates[f"attention_fwd_{tag}"], rates[f"attention_bwd_{tag}"] = f, b
    return {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."), "attention_backend": backend,
            "attention_shape": {"heads": heads, "kv_heads": kv, "head_dim": d}, "gemm_hidden": hidden,
            "threads": torch.get_num_threads() if not gpu else None, "launch_us": measure_launch(device),
            "concurrent_processes": _world(),
            "peak_tflops": PEAK_TFLOPS.get(device_name(device)), "torch": torch.__version__,
            "memory_bytes": torch.cuda.get_device_properties(device).total_memory if gpu else None,
            "date": datetime.date.today().isoformat(), "rates": rates}


def fit_link(rows, op) -> tuple[float, float]:
    """Least-squares (α µs, busbw GB/s) of ``time = α + size·factor/busbw`` over the sweep rows of ``op``."""
    from distlab.comm import bus_factor

    n = rows[0]["n"]
    xs = [r["size"] * bus_factor(op, n) for r in rows]
    ys = [r["time_us"] * 1e-6 for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(0.0, my - slope * mx)
    return alpha * 1e6, 1 / max(slope, 1e-15) / 1e9


def measure_links(device, iters, warmup, max_bytes) -> tuple[str, dict]:
    import torch.distributed as dist

    from distlab.collectives.playground import sweep, sweep_sizes

    n = dist.get_world_size()
    sizes = sweep_sizes(4096, max_bytes, 4)
    per_op = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv"):
        rows = [{"size": r["size"], "time_us": r["out"]["time_us"], "n": n}
                for r in sweep(op, sizes, torch.float32, device, iters, warmup, check=False)]
        alpha, busbw = fit_link(rows, op)
        per_op[op] = {"alpha_us": alpha, "busbw_gbs": busbw, "points": [[r["size"], r["time_us"]] for r in rows]}
    backend = dist.get_backend()
    name = f"{backend}-W{n}"
    big = per_op["all_gather"]
    return name, {"alpha_us": big["alpha_us"], "busbw_gbs": big["busbw_gbs"], "per_op": per_op,
                  "overlaps_compute": device.type == "cuda",
                  "source": f"distlab.plan.calibration on {device_name(device)}, {backend}, W={n}, "
                            f"{datetime.date.today().isoformat()} (fit of the playground's sweep, 4 KiB to "
                            f"{max_bytes // 2**20} MiB)"}


def merge_into(path: str, update: dict) -> None:
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    links = {**data.get("links", {}), **update.pop("links", {})}
    data.update(update)
    data["links"] = links
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")


def main(argv=None):
    p = StudyParser(prog="python -m distlab.plan.calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="calibration JSON (updated in place: links merge with kernels)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", type=dtype_arg(), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--backend", default="auto", help="attention backend (default auto: FA4, else cuDNN; torch on CPU)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads while timing kernels")
    p.add_argument("--links-only", action="store_true", help="under torchrun: only the collectives (the default)")
    p.add_argument("--kernels", action="store_true", help="under torchrun: the kernels too, on every rank at once")
    p.add_argument("--max-bytes", type=positive_int, default=None, help="largest collective (default 256 MiB GPU, 16 MiB CPU)")
    p.add_argument("--quick", action="store_true", help="fewer sizes (tests)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from distlab.runtime import init_runtime, shutdown

        rt = init_runtime(device=a.device)
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.kernels and not a.links_only:
            dtype = to_dtype(a.dtype) if a.dtype else (torch.bfloat16 if rt.device.type == "cuda" else torch.float32)
            data = measure_kernels(rt.device, dtype, a.backend if rt.device.type == "cuda" else "torch", a.quick)
            if rt.is_main:
                merge_into(a.out, data)
        name, link = measure_links(rt.device, 5 if a.quick else 10, 2, a.max_bytes or
                                   (2**28 if rt.device.type == "cuda" else 2**24 >> (4 if a.quick else 0)))
        if rt.is_main:
            print(f"{name}: " + ", ".join(f"{op} α {v['alpha_us']:.1f} us busbw {v['busbw_gbs']:.2f} GB/s"
                                          for op, v in link["per_op"].items()))
            merge_into(a.out, {"links": {name: link}})
        shutdown()
        return
    if a.links_only:
        raise ValueError("--links-only measures collectives: launch it with distlab run --nproc W (W > 1)")
    device = resolve_device(a.device)
    dtype = to_dtype(a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    data = measure_kernels(device, dtype, a.backend if device.type == "cuda" else "torch", a.quick)
    for k, pts in data["rates"].items():
        unit = "B/s" if k == "copy" else "FLOP/s"
        print(f"{k:<22} " + "  ".join(f"{s:.3g}:{r:.3g}" for s, r in pts) + f"  ({unit})")
    print(f"launch {data['launch_us']:.1f} us")
    merge_into(a.out, data)


if __name__ == "__main__":
    run_study(main)
