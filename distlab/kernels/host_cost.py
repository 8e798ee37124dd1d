"""Host time per attention call: what Python, dispatch and the launch cost, per backend, on a shape so small
that the GPU waits for the host (issue #24: a rank is host-bound below a few thousand tokens).

    python -m distlab.kernels.host_cost                       # GPU: S2048, 4 q heads, 1 kv head, D128, bf16
    python -m distlab.kernels.host_cost --seq 1024 --json host.json

For each backend present: the host's seconds per call (``perf_counter`` around N calls with no sync inside;
the GPU runs behind), the wall seconds per call once the GPU has caught up, and the GPU's own time per call
(``distlab.bench.timeit``, launches queued behind a spin kernel). host ≈ wall > GPU means host-bound.
"""

from __future__ import annotations

import time

import torch

from distlab.bench import StudyParser, add_common_args, device_of, positive_int, run_study, timeit, write_json
from distlab.kernels.attention import attention_backward, attention_forward, available_backends


def host_seconds(fn, calls: int, device) -> tuple[float, float]:
    """(host seconds per call, wall seconds per call) of ``calls`` back-to-back calls."""
    fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    return host / calls, (time.perf_counter() - t0) / calls


def main(argv=None):
    p = StudyParser(prog="python -m distlab.kernels.host_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=positive_int, default=2048)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=1)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--calls", type=positive_int, default=200)
    add_common_args(p, iters=20, warmup=5, dtype="bfloat16", gpu_tool=True)
    a = p.parse_args(argv)
    device = device_of(a, "distlab.kernels.host_cost", gpu_tool=True, cpu_hint="it measures a GPU queue")
    if device.type != "cuda":
        raise ValueError("host cost is measured against a GPU's queue; on CPU every call is synchronous")
    from distlab.bench import to_dtype

    dtype = to_dtype(a.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, a.seq, a.heads, a.head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(1, a.seq, a.kv_heads, a.head_dim, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn_like(q)
    rows = []
    print(f"host time per attention call, {torch.cuda.get_device_name(device)}: S{a.seq}, {a.heads} q / "
          f"{a.kv_heads} kv heads, D{a.head_dim}, causal, {a.dtype}")
    print(f"{'backend':<16} {'pass':<5} {'host µs':>9} {'wall µs':>9} {'GPU µs':>9}")
    for backend in available_backends(device, dtype):
        if backend == "torch":
            continue
        out, lse = attention_forward(q, k, v, True, backend=backend)
        for pass_, fn in (("fwd", lambda: attention_forward(q, k, v, True, backend=backend)),
                          ("bwd", lambda: attention_backward(dout, q, k, v, out, lse, True, backend=backend))):
            host, wall = host_seconds(fn, a.calls, device)
            gpu = timeit(fn, a.iters, a.warmup, device)
            rows.append({"backend": backend, "pass": pass_, "host_s": host, "wall_s": wall, "gpu_s": gpu})
            print(f"{backend:<16} {pass_:<5} {host * 1e6:>9.1f} {wall * 1e6:>9.1f} {gpu * 1e6:>9.1f}", flush=True)
    from distlab.kernels import fa4

    if fa4.runs_on(device, dtype):   # the same FA4 calls without distlab's wrapper (#24: within 10 µs of it)
        fi = fa4._interface()
        scale = a.head_dim ** -0.5
        out, lse = fa4.fa4_forward(q, k, v, True, scale)
        for pass_, fn in (("fwd", lambda: fi._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)),
                          ("bwd", lambda: fi._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=True))):
            host, wall = host_seconds(fn, a.calls, device)
            gpu = timeit(fn, a.iters, a.warmup, device)
            rows.append({"backend": "fa4 bare", "pass": pass_, "host_s": host, "wall_s": wall, "gpu_s": gpu})
            print(f"{'fa4 bare':<16} {pass_:<5} {host * 1e6:>9.1f} {wall * 1e6:>9.1f} {gpu * 1e6:>9.1f}", flush=True)
    if a.json:
        write_json(a.json, {"args": vars(a), "device": torch.cuda.get_device_name(device), "rows": rows})


if __name__ == "__main__":
    run_study(main)
