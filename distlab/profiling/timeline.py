"""Each GPU kernel one call launches, in order: its duration and the idle gap before it (torch.profiler).

    python -m distlab.cp.emulate --world 8 --seq 32768 --backend triton --timeline     # GPU

Where a schedule of many kernels loses time against one fused call, the timeline says which: the
kernels themselves (durations), or the GPU idling between them (gaps: launch latency, a dependency, a
tail wave that the next kernel cannot fill). The call is queued behind a spin kernel, so the host's
launch latency shows as a gap only where the GPU really waited for it. With ``origins`` each kernel also
names its stream and the PyTorch op that launched it with the op's input shapes (a bare
``elementwise_kernel`` is then an ``aten::add_ [2, 1, 4096, 8, 128]``), and the printout closes with the
kernel time summed by op (``by_origin``).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch


def kernel_timeline(fn, warmup: int = 2, spin_s: float = 0.005, origins: bool = False):
    """``[(name, start_us, duration_us), ...]`` of the device kernels (and memsets/copies) one ``fn()``
    runs, start relative to the first; on a GPU only (CUPTI sees kernels in CUDA-graph replays too).
    ``origins``: each also with its stream and the PyTorch op that launched it, its input shapes
    (``(name, start, dur, stream, origin)``: a bare ``elementwise_kernel`` says which add or copy it is; give
    it the eager call: a CUDA graph's replay launches no ops, its kernels come back with no origin)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if origins else [])
    with profile(activities=activities, record_shapes=origins) as prof:
        torch.cuda._sleep(int(spin_s * 2e9))
        fn()
        torch.cuda.synchronize()
    if origins:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                return kernels_of_trace(json.load(f))
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and not _spin(e.name)), key=lambda e: e.time_range.start)
    if not events:
        return []
    t0 = events[0].time_range.start
    return [(e.name, e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in events]


def _spin(name: str) -> bool:
    return "sleep" in name.lower() or "spin" in name.lower()


def kernels_of_trace(trace: dict):
    """``(name, start_us, duration_us, stream, origin)`` of each device event of a Chrome trace exported by
    ``torch.profiler`` with CPU and CUDA activities: ``origin`` is the CPU op of the same ``External id`` (the
    op on top of the stack at the launch: ``aten::add_``, ``aten::copy_``; a Triton or CuTe launch outside
    any op has none, ``""``) with its input shapes, e.g. ``aten::add_ [2, 8, 4096, 8, 128] [...]``."""
    ops = {}
    device = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat == "cpu_op" and "External id" in args:
            dims = " ".join(str(d) for d in args.get("Input Dims", []) if d)
            ops[args["External id"]] = f"{e['name']} {dims}".strip()
        elif cat in ("kernel", "gpu_memset", "gpu_memcpy") and not _spin(e["name"]):
            device.append(e)
    device.sort(key=lambda e: e["ts"])
    if not device:
        return []
    t0 = device[0]["ts"]
    return [(e["name"], e["ts"] - t0, e["dur"], (e.get("args") or {}).get("stream"),
             ops.get((e.get("args") or {}).get("External id"), "")) for e in device]


def summarize(timeline) -> dict:
    """Busy time (the union of kernel intervals), span (first start to last end) and their ratio."""
    busy, end = 0.0, 0.0
    for _, start, dur, *_ in timeline:
        stop = start + dur
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {"kernels": len(timeline), "busy_us": busy, "span_us": end, "busy_fraction": busy / end if end else 0.0}


def format_timeline(timeline, title: str, flops=None) -> str:
    """One line per kernel: start, gap before it, duration (and TFLOP/s where ``flops[i]`` is given); with
    ``kernel_timeline(origins=True)``'s entries, its stream and the op that launched it too."""
    lines = [f"-- {title}", f"{'#':>3} {'start us':>9} {'gap us':>7} {'dur us':>8} {'TFLOP/s':>8}  kernel"]
    end = 0.0
    for i, (name, start, dur, *where) in enumerate(timeline):
        rate = f"{flops[i] / dur / 1e6:>8.1f}" if flops and i < len(flops) and flops[i] else f"{'':>8}"
        more = f"  s{where[0]} {where[1][:90]}" if where else ""
        lines.append(f"{i:>3} {start:>9.1f} {start - end:>7.1f} {dur:>8.1f} {rate}  {name[:70]:<70}{more}".rstrip())
        end = max(end, start + dur)
    s = summarize(timeline)
    lines.append(f"    {s['kernels']} kernels, busy {s['busy_us']:.1f} us of a {s['span_us']:.1f} us span "
                 f"({100 * s['busy_fraction']:.1f}%)")
    if timeline and len(timeline[0]) > 3:
        lines.append("    by op: " + "; ".join(f"{label} {n}x {us:.1f} us" for label, n, us in by_origin(timeline)))
    return "\n".join(lines)


def _short(name: str) -> str:
    """A kernel's name without its template and argument lists (CuTe DSL's: without ``_object_at_…``)."""
    return name.split("(")[0].split("<")[0].split("_object_at_")[0].strip().split(" ")[-1][:80]


def by_origin(timeline):
    """``kernel_timeline(origins=True)``'s kernels grouped by what launched them — the op's name (shapes
    dropped), else the kernel's own name without its template and arguments — as ``(label, kernels, µs)``, the
    most time first (durations summed: kernels that overlap count in full)."""
    groups: dict = {}
    for name, _, dur, _, origin in timeline:
        label = origin.split(" ")[0] if origin else _short(name)
        n, us = groups.get(label, (0, 0.0))
        groups[label] = (n + 1, us + dur)
    return sorted(((label, n, us) for label, (n, us) in groups.items()), key=lambda g: -g[2])
