"""Profiling for every study: ``--profile torch|nsys|none``, NVTX/profiler ranges around phases.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --profile torch --profile-dir traces/
    python -m distlab.profiling.overlap traces/ring_zigzag/trace_rank*.json      # compute/comm overlap
    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda,nvtx \\
        -o ring_%q{RANK} torchrun --nproc-per-node 8 -m distlab.cp.ring --seq 65536 --profile nsys

``torch``: a ``torch.profiler`` schedule (``wait`` steps skipped, ``warmup`` steps traced but dropped,
``active`` steps kept) writes one Chrome/Perfetto trace per rank, ``trace_rank{R}.json``. ``nsys``:
``cudaProfilerStart``/``Stop`` around the active steps, so ``nsys profile --capture-range=cudaProfilerApi``
records exactly those; the line to use is printed. Phases (``phase("ring.block")`` etc.) are
``record_function`` ranges in torch traces and NVTX ranges under nsys; outside a profiling run they cost
one flag check.

torch 2.13's profiler can abort the process at interpreter teardown, after the traces are written
("terminate called without an active exception" from a C++ static destructor; about 1 run in 15 of a
2-rank gloo study). A study's ``__main__`` block therefore ends with ``end_process()``: after a torch
profile it flushes and leaves through ``os._exit(0)``, skipping that teardown.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

MODES = ("none", "torch", "nsys")
_state = {"phases": False, "torch_ran": False}  # instrumentation switches (like a profiler's), not parallel state


def phase(name: str):
    """Mark a phase (block compute, exchange, merge, dispatch, combine) for torch traces and nsys. Outside a
    profiling run: a shared do-nothing context (one flag check; a generator context cost ~2 µs of host time
    per phase, three per ring step)."""
    if not _state["phases"]:
        return _NO_PHASE
    return _phase(name)


_NO_PHASE = contextlib.nullcontext()


@contextlib.contextmanager
def _phase(name: str):
    nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.profiler.record_function(name):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


class Profiler:
    """Profile ``wait + warmup + active`` calls of ``step()`` in ``mode``; a no-op for ``none``."""

    def __init__(self, mode: str = "none", out_dir: str = "traces", rank: int = 0, wait: int = 1,
                 warmup: int = 1, active: int = 2):
        if mode not in MODES:
            raise ValueError(f"unknown profile mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.out_dir, self.rank = mode, out_dir, rank
        self.wait, self.warmup, self.active = wait, warmup, active
        self.steps = wait + warmup + active if mode != "none" else 0
        self._prof, self._count = None, 0
        self.trace_path = os.path.join(out_dir, f"trace_rank{rank}.json") if mode == "torch" else None

    def __enter__(self) -> "Profiler":
        if self.mode == "none":
            return self
        _state["phases"] = True
        if self.mode == "torch":
            _state["torch_ran"] = True
            os.makedirs(self.out_dir, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
                on_trace_ready=lambda p: p.export_chrome_trace(self.trace_path))
            self._prof.__enter__()
        elif self.rank == 0:
            print("nsys: capture window = the active steps; run under\n  nsys profile --capture-range=cudaProfilerApi "
                  "--capture-range-end=stop --trace=cuda,nvtx -o distlab_%q{RANK} <your torchrun command>")
        return self

    def step(self) -> None:
        self._count += 1
        if self.mode == "torch":
            self._prof.step()
        elif self.mode == "nsys" and torch.cuda.is_available():
            if self._count == self.wait + self.warmup:
                torch.cuda.profiler.start()
            elif self._count == self.steps:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()

    def __exit__(self, *exc) -> None:
        if self.mode == "torch":
            self._prof.__exit__(*exc)
        _state["phases"] = False


def profile_steps(fn, mode: str, out_dir: str, rank: int, **schedule) -> str | None:
    """Run ``fn()`` once per profiler step for a whole schedule; return this rank's trace path (torch mode)."""
    with Profiler(mode, out_dir, rank, **schedule) as prof:
        for _ in range(prof.steps):
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.step()
    return prof.trace_path


def kernel_summary(fn, device) -> dict:
    """One call of ``fn`` (after a warm one) under ``torch.profiler``: ``{"wall_s", "kernel_s", "kernels":
    [{"name", "count", "total_us"}, ...]}``, kernels by total GPU time, busiest first. What a benchmark row's
    time is made of: how many launches, which kernels, how much of the wall the GPU was busy."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    _state["torch_ran"] = True
    kernels = [{"name": e.key, "count": e.count, "total_us": e.self_device_time_total}
               for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k["total_us"])
    return {"wall_s": wall, "kernel_s": sum(k["total_us"] for k in kernels) / 1e6, "kernels": kernels}


def end_process() -> None:
    """Call last in a study's ``__main__`` block (after ``shutdown()``): if a torch profiler ran in this
    process, flush stdout/stderr and exit with status 0 through ``os._exit``, so the profiler's teardown
    at interpreter exit cannot abort a run that has finished and written its results. Otherwise a no-op."""
    if not _state["torch_ran"]:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
