"""Each GPU kernel one call launches, in order: its duration and the idle gap before it (torch.profiler).

    python -m distlab.cp.emulate --world 8 --seq 32768 --backend triton --timeline     # GPU

Where a schedule of many kernels loses time against one fused call, the timeline says which: the
kernels themselves (durations), or the GPU idling between them (gaps: launch latency, a dependency, a
tail wave that the next kernel cannot fill). The call is queued behind a spin kernel, so the host's
launch latency shows as a gap only where the GPU really waited for it.
"""

from __future__ import annotations

import torch


def kernel_timeline(fn, warmup: int = 2, spin_s: float = 0.005):
    """``[(name, start_us, duration_us), ...]`` of the device kernels (and memsets/copies) one ``fn()``
    runs, start relative to the first; on a GPU only (CUPTI sees kernels in CUDA-graph replays too)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(int(spin_s * 2e9))
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and "sleep" not in e.name.lower() and "spin" not in e.name.lower()),
                    key=lambda e: e.time_range.start)
    if not events:
        return []
    t0 = events[0].time_range.start
    return [(e.name, e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in events]


def summarize(timeline) -> dict:
    """Busy time (the union of kernel intervals), span (first start to last end) and their ratio."""
    busy, end = 0.0, 0.0
    for _, start, dur in timeline:
        stop = start + dur
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {"kernels": len(timeline), "busy_us": busy, "span_us": end, "busy_fraction": busy / end if end else 0.0}


def format_timeline(timeline, title: str, flops=None) -> str:
    """One line per kernel: start, gap before it, duration (and TFLOP/s where ``flops[i]`` is given)."""
    lines = [f"-- {title}", f"{'#':>3} {'start us':>9} {'gap us':>7} {'dur us':>8} {'TFLOP/s':>8}  kernel"]
    end = 0.0
    for i, (name, start, dur) in enumerate(timeline):
        rate = f"{flops[i] / dur / 1e6:>8.1f}" if flops and i < len(flops) and flops[i] else f"{'':>8}"
        lines.append(f"{i:>3} {start:>9.1f} {start - end:>7.1f} {dur:>8.1f} {rate}  {name[:70]}")
        end = max(end, start + dur)
    s = summarize(timeline)
    lines.append(f"    {s['kernels']} kernels, busy {s['busy_us']:.1f} us of a {s['span_us']:.1f} us span "
                 f"({100 * s['busy_fraction']:.1f}%)")
    return "\n".join(lines)
