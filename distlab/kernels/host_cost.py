"""Host time per attention call: what Python, dispatch and the launch cost, per backend, on a shape so small
that the GPU waits for the host (issue #24: a rank is host-bound below a few thousand tokens).

    python -m distlab.kernels.host_cost                       # GPU: S2048, 4 q heads, 1 kv head, D128, bf16
    python -m distlab.kernels.host_cost --seq 1024 --rounds 7 --json host.json

For each row: the host's seconds per call (``perf_counter`` around N calls with no sync inside; the GPU runs
behind), the wall seconds per call once the GPU has caught up, and the GPU's own time per call
(``distlab.bench.timeit``, launches queued behind a spin kernel). host ≈ wall > GPU means host-bound.
Host timing on a shared machine moves by 2× between runs, so the rows are measured in ``--rounds``
interleaved rounds and the table shows each row's fastest round (and the median beside it in the JSON).

Rows: every attention backend present (forward and backward through ``attention_forward``/``_backward``);
the Triton kernel's own launch (``flash_forward``) with distlab's cached launch (``CachedLaunch``, the
default) and with Triton's plain one (``DISTLAB_TRITON_LAUNCH=plain``); the one-block LSE merge
(``lse_merge_``; a non-Triton ring merges four blocks a launch, ``lse_merge_blocks_``); bare FA4 calls
(the wrapper's overhead, #24: within 10 µs); and one W-rank ring step (``--ring-world``; the rank's real
``_ring_forward``/``_ring_backward`` over resident K/V, no exchange: block kernels and bookkeeping, per
step) for the ``triton`` and ``fa4`` backends — the forward with the steps per launch ``ring_attention``
takes by default (``triton``: 4, so 3 launches for 8 steps) and with one.
"""

from __future__ import annotations

import statistics
import time

import torch

from distlab import knobs
from distlab.bench import StudyParser, add_common_args, device_of, positive_int, run_study, timeit, write_json
from distlab.kernels.attention import attention_backward, attention_forward, available_backends


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_seconds(fn, calls: int, device) -> tuple[float, float]:
    """(host seconds per call, wall seconds per call) of ``calls`` back-to-back calls."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    _sync(device)
    return host / calls, (time.perf_counter() - t0) / calls


def _rows(a, device, dtype):
    """``[(name, pass, fn, knob overrides, calls per fn)]``: what the table measures."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, a.seq, a.heads, a.head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(1, a.seq, a.kv_heads, a.head_dim, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn_like(q)
    scale = a.head_dim ** -0.5
    rows = []
    for backend in available_backends(device, dtype):
        if backend == "torch":
            continue
        out, lse = attention_forward(q, k, v, True, backend=backend)
        rows += [(backend, "fwd", lambda b=backend: attention_forward(q, k, v, True, backend=b), {}, 1),
                 (backend, "bwd", lambda b=backend, o=out, l=lse: attention_backward(dout, q, k, v, o, l, True,
                                                                                    backend=b), {}, 1)]
    if "triton" in available_backends(device, dtype):
        from distlab.kernels.triton_attention import flash_forward

        rows += [("triton launch", "fwd", lambda: flash_forward(q, k, v, True, scale), {}, 1),
                 ("triton launch, plain", "fwd", lambda: flash_forward(q, k, v, True, scale),
                  {"TRITON_LAUNCH": "plain"}, 1),
                 ("triton launch, TMA", "fwd", lambda: flash_forward(q, k, v, True, scale),
                  {"TRITON_ATTN_TMA": "fwd"}, 1),
                 ("triton launch, no TMA", "fwd", lambda: flash_forward(q, k, v, True, scale),
                  {"TRITON_ATTN_TMA": "0"}, 1)]
        out, lse = attention_forward(q, k, v, True, backend="triton")
        rows += [("triton, plain", "bwd", lambda: attention_backward(dout, q, k, v, out, lse, True, backend="triton"),
                  {"TRITON_LAUNCH": "plain"}, 1)]
        from distlab.kernels.lse_merge import lse_merge_

        acc, acc_lse = out.float(), lse.clone()
        rows += [("lse merge", "fwd", lambda: lse_merge_(acc, acc_lse, out, lse), {}, 1)]
    from distlab.kernels import fa4

    if fa4.runs_on(device, dtype):   # the same FA4 calls without distlab's wrapper (#24: within 10 µs of it)
        fi = fa4._interface()
        out, lse = fa4.fa4_forward(q, k, v, True, scale)
        rows += [("fa4 bare", "fwd", lambda: fi._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True,
                                                                return_lse=True), {}, 1),
                 ("fa4 bare", "bwd", lambda: fi._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale,
                                                                causal=True), {}, 1)]
    if a.ring_world > 1:
        rows += _ring_rows(a, device, dtype)
    return rows


def _ring_rows(a, device, dtype):
    """One rank's ring forward and backward at W = ``ring_world`` (zigzag, causal, rank 0) over resident K/V:
    the host time of its W steps, reported per step."""
    from distlab.cp.emulate import ResidentRing, rank_rows
    from distlab.cp.ring import _ring_backward, _ring_forward, check_steps_per_launch

    w, s = a.ring_world, a.seq * a.ring_world   # each rank holds --seq tokens
    g = torch.Generator(device="cpu").manual_seed(2)
    q, k, v = (torch.randn(1, s, h, a.head_dim, generator=g).to(device, dtype)
               for h in (a.heads, a.kv_heads, a.kv_heads))
    shard = {r: rank_rows(r, w, s, "zigzag").to(device) for r in range(w)}
    kv = [(k[:, shard[(0 - i) % w]].contiguous(), v[:, shard[(0 - i) % w]].contiguous()) for i in range(w)]
    q_r = q[:, shard[0]].contiguous()
    dout = torch.randn_like(q_r)
    scale = a.head_dim ** -0.5
    rows = []
    for backend in ("triton", "fa4"):
        if backend not in available_backends(device, dtype):
            continue
        ring = ResidentRing(w, 0, kv)
        n = check_steps_per_launch(None, backend, w)   # what ring_attention runs by default (triton: 4)
        out, lse = _ring_forward(q_r, *kv[0], ring, True, "zigzag", scale, backend, n)
        out = out.to(dtype)
        rows += [(f"ring step W{w}, {backend}" + (f", {n} steps a launch" if n > 1 else ""), "fwd",
                  lambda b=backend, r=ring, n=n: _ring_forward(q_r, *kv[0], r, True, "zigzag", scale, b, n), {}, w)]
        if n > 1:
            rows += [(f"ring step W{w}, {backend}, 1 step a launch", "fwd",
                      lambda b=backend, r=ring: _ring_forward(q_r, *kv[0], r, True, "zigzag", scale, b), {}, w)]
        rows += [(f"ring step W{w}, {backend}", "bwd",
                  lambda b=backend, r=ring, o=out, l=lse: _ring_backward(dout, q_r, *kv[0], o, l, r, True, "zigzag",
                                                                         scale, b), {}, w)]
        if backend != "triton":   # a launch group's blocks fused into one call (distlab.cp.ring_fused), fwd and bwd
            rows += [(f"ring step W{w}, {backend}, 4 steps fused", "fwd",
                      lambda b=backend, r=ring: _ring_forward(q_r, *kv[0], r, True, "zigzag", scale, b, 4), {}, w),
                     (f"ring step W{w}, {backend}, 4 steps fused", "bwd",
                      lambda b=backend, r=ring, o=out, l=lse: _ring_backward(dout, q_r, *kv[0], o, l, r, True,
                                                                             "zigzag", scale, b, 4), {}, w)]
            fused_bwd = (lambda b=backend, r=ring, o=out, l=lse: _ring_backward(dout, q_r, *kv[0], o, l, r, True,
                                                                                "zigzag", scale, b, 4))
            # the same with each fused block's K/V concatenated, not received into its buffer (ring_landing)
            rows += [(f"ring step W{w}, {backend}, 4 steps fused, cat", "fwd",
                      lambda b=backend, r=ring: _ring_forward(q_r, *kv[0], r, True, "zigzag", scale, b, 4),
                      {"RING_KV_LANDING": "0"}, w),
                     (f"ring step W{w}, {backend}, 4 steps fused, cat", "bwd", fused_bwd, {"RING_KV_LANDING": "0"}, w)]
            # the later blocks' dK/dV scratch a fresh torch.zeros each (FA4RingBackward.prepare's keep_scratch off);
            # the half-shard row sets folded (FA4_RING_FOLD=half; auto folds none at S8192's shard), with the glue's
            # adds in Triton and in torch
            rows += [(f"ring step W{w}, {backend}, 4 steps fused, {name}", "bwd", fused_bwd, knobs_of, w)
                     for name, knobs_of in (("scratch a block", {"FA4_RING_KEEP_SCRATCH": "0"}),
                                            ("half folded", {"FA4_RING_FOLD": "half"}),
                                            ("half folded, torch adds", {"FA4_RING_FOLD": "half",
                                                                         "FA4_RING_GLUE": "fold"}))]
    return rows


def main(argv=None):
    p = StudyParser(prog="python -m distlab.kernels.host_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=positive_int, default=2048)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=1)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--calls", type=positive_int, default=200)
    p.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds; the table shows the fastest")
    p.add_argument("--ring-world", type=int, default=8, help="W of the ring-step rows (each rank holds --seq "
                   "tokens); 1: none")
    p.add_argument("--profile", metavar="ROW", default=None, help="also cProfile the calls of this row (name, or "
                   "'name/pass'), printing the functions where the host time goes")
    p.add_argument("--skip-launches", action="store_true",
                   help="CPU, no GPU: the Triton rows with every launch skipped (Triton's interpreter defines the "
                        "kernels, DISTLAB_TRITON_LAUNCH=skip): the host work around the launches, float32, small "
                        "shapes by default (S256, D64)")
    add_common_args(p, iters=20, warmup=5, dtype="bfloat16", gpu_tool=True)
    a = p.parse_args(argv)
    if a.skip_launches:
        return _skip_launches(a)
    device = device_of(a, "distlab.kernels.host_cost", gpu_tool=True, cpu_hint="it measures a GPU queue")
    if device.type != "cuda":
        raise ValueError("host cost is measured against a GPU's queue; on CPU every call is synchronous "
                         "(--skip-launches: the host work around the launches)")
    from distlab.bench import to_dtype

    dtype = to_dtype(a.dtype)
    specs = _rows(a, device, dtype)
    if a.profile:
        _profiled_row(specs, a.profile)   # a wrong name fails now, not after the timing rounds
    print(f"host time per call, {torch.cuda.get_device_name(device)}: S{a.seq}, {a.heads} q / {a.kv_heads} kv "
          f"heads, D{a.head_dim}, causal, {a.dtype}; fastest of {a.rounds} interleaved rounds of {a.calls} calls")
    host = {i: [] for i in range(len(specs))}
    wall = {i: [] for i in range(len(specs))}
    for _ in range(a.rounds):
        for i, (_, _, fn, over, per) in enumerate(specs):
            with knobs.override(**over):
                h, w = host_seconds(fn, max(1, a.calls // per), device)
            host[i].append(h / per)
            wall[i].append(w / per)
    rows = []
    print(f"{'row':<24} {'pass':<5} {'host µs':>9} {'median':>8} {'wall µs':>9} {'GPU µs':>9}")
    for i, (name, pass_, fn, over, per) in enumerate(specs):
        with knobs.override(**over):
            gpu = timeit(fn, a.iters, a.warmup, device) / per
        row = {"row": name, "pass": pass_, "host_s": min(host[i]), "host_median_s": statistics.median(host[i]),
               "wall_s": min(wall[i]), "gpu_s": gpu, "per_call_of": per, "knobs": over}
        rows.append(row)
        print(f"{name:<24} {pass_:<5} {row['host_s'] * 1e6:>9.1f} {row['host_median_s'] * 1e6:>8.1f} "
              f"{row['wall_s'] * 1e6:>9.1f} {gpu * 1e6:>9.1f}", flush=True)
    if a.profile:
        _profile(specs, a.profile, a.calls, device)
    if a.json:
        write_json(a.json, {"args": vars(a), "device": torch.cuda.get_device_name(device), "rows": rows})


def _skip_launches(a):
    """The Triton rows on the CPU with no launch: what Python, checks, allocations and launch keys cost."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel is defined: they run nowhere anyway
    device = torch.device("cpu")
    if a.seq == 2048 and a.head_dim == 128:   # the GPU defaults: CPU allocations of that size cost more
        a.seq, a.head_dim = 256, 64
    # split GQA dK/dV as a GPU takes it at these shapes (too few key tiles to fill its SMs; the CPU has none)
    with knobs.override(TRITON_LAUNCH="skip", TRITON_ATTN_SPLIT_GROUPS="1" if a.heads > a.kv_heads else "auto"):
        specs = [s for s in _rows(a, device, torch.float32) if s[0] != "torch" and "TRITON_LAUNCH" not in s[3]]
        print(f"host time per call with every Triton launch skipped (CPU): S{a.seq}, {a.heads} q / {a.kv_heads} kv "
              f"heads, D{a.head_dim}, causal, float32; fastest of {a.rounds} interleaved rounds of {a.calls} calls")
        times = {i: [] for i in range(len(specs))}
        for _ in range(a.rounds):
            for i, (_, _, fn, over, per) in enumerate(specs):
                with knobs.override(**over):
                    times[i].append(host_seconds(fn, max(1, a.calls // per), device)[0] / per)
    rows = [{"row": name, "pass": pass_, "host_s": min(times[i]), "host_median_s": statistics.median(times[i]),
             "per_call_of": per, "knobs": over} for i, (name, pass_, _, over, per) in enumerate(specs)]
    print(f"{'row':<40} {'pass':<5} {'host µs':>9} {'median':>8}")
    for r in rows:
        print(f"{r['row']:<40} {r['pass']:<5} {r['host_s'] * 1e6:>9.1f} {r['host_median_s'] * 1e6:>8.1f}")
    if a.json:
        write_json(a.json, {"args": vars(a), "device": "cpu, launches skipped", "rows": rows})


def _profiled_row(specs, which):
    """The row ``--profile`` names (``name`` or ``name/pass``), or a ValueError listing the rows."""
    name, _, pass_ = which.partition("/")
    found = [s for s in specs if s[0] == name and (not pass_ or s[1] == pass_)]
    if not found:
        raise ValueError(f"--profile {which!r}: no such row (name, or 'name/pass'); rows: "
                         f"{sorted({s[0] for s in specs})}")
    return found[0]


def _profile(specs, which, calls, device):
    import cProfile
    import pstats

    _, _, fn, over, _ = _profiled_row(specs, which)
    with knobs.override(**over):
        fn()
        torch.cuda.synchronize(device)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize(device)
    print(f"cProfile of {calls} calls of {which} (tottime: the function's own time):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    run_study(main)
