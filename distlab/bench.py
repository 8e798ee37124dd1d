"""What every study shares: its entry point, argument parser and types, one dtype table, device and memory
checks, a progress line, JSON and plots.

    if __name__ == "__main__":
        run_study(main)          # every ``python -m distlab...`` study ends like this

``run_study`` turns the errors a person can make into one line and an exit status: invalid arguments and
inputs (``ValueError``, including the parser's own) exit with status 2 as ``error: <what is wrong>``, a
missing file as well; anything else is a bug and keeps its traceback (status 1). Under ``distlab run``
(``DISTLAB_ERROR_DIR`` set) a failing rank writes its error to that folder instead of printing it, and the
launcher prints each distinct error once with the ranks that raised it (``distlab/cli.py``).
``StudyParser`` is ``argparse.ArgumentParser`` that raises instead of printing its usage on every rank,
and prints ``--help`` on rank 0 only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback

import torch

# one dtype vocabulary for every study: the canonical name, then the spellings it accepts
DTYPE_NAMES = {
    "float32": ("float32", "fp32", "f32", "float"),
    "bfloat16": ("bfloat16", "bf16"),
    "float16": ("float16", "fp16", "f16", "half"),
    "float64": ("float64", "fp64", "f64", "double"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_SPELLINGS = {alias: name for name, aliases in DTYPE_NAMES.items() for alias in aliases}


ERROR_GRACE_S = 5.0   # how long a failed rank waits for the others' errors under distlab run


class UsageError(ValueError):
    """A command line that cannot run (raised by ``StudyParser`` and the argument types below)."""


def dtype_arg(*allowed: str):
    """An argparse ``type``: any spelling of a dtype (``fp32``, ``float32``, ``float``, ``bf16`` ...) -> its
    canonical name; ``allowed`` (canonical names) limits which dtypes the study takes."""
    allowed = allowed or tuple(DTYPE_NAMES)

    def parse(text: str) -> str:
        name = _SPELLINGS.get(text.lower())
        if name is None or name not in allowed:
            spell = ", ".join(f"{n} ({'/'.join(DTYPE_NAMES[n][1:3])})" for n in allowed)
            raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; this study takes {spell}")
        return name

    parse.__name__ = "dtype"
    return parse


def to_dtype(name: str) -> torch.dtype:
    """The torch dtype of any accepted spelling."""
    return DTYPES[_SPELLINGS[name.lower()]]


def positive_int(text: str) -> int:
    return _bounded_int(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _bounded_int(text, 0, "an integer >= 0")


def _bounded_int(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text} is not {what}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


class StudyParser(argparse.ArgumentParser):
    """argparse that raises ``UsageError`` (one line, status 2 through ``run_study``) instead of printing
    its usage on every rank, and prints ``--help`` on rank 0 only."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see --help)")

    def _print_message(self, message, file=None):
        if _rank() == 0:
            super()._print_message(message, file)


def run_study(main, argv=None) -> None:
    """Run a study's ``main``; turn a person's mistakes into one line and status 2 (see the module doc)."""
    try:
        main() if argv is None else main(argv)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:   # the output went to a pipe that closed (| head): not an error of the study
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        _fail(str(e) if isinstance(e, ValueError) else f"{e.strerror or e}: {e.filename}", 2)
    except Exception as e:   # a bug, not a mistake: keep the traceback (printed once by distlab run)
        stalled = collective_timeout(e)
        _fail(stalled or traceback.format_exc().rstrip(), 1)
    from distlab.profiling import end_process

    end_process()


def collective_timeout(error: BaseException) -> str | None:
    """One line for a collective that timed out (a rank frozen, dead or far behind), naming the collective
    and the distlab code that called it; None for any other error."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not re.search(r"[Tt]imed out|[Tt]imeout|Watchdog caught", text):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    ops = [f.name for f in frames if f.filename.endswith(os.path.join("torch", "distributed", "distributed_c10d.py"))
           and not f.name.startswith("_") and f.name != "wrapper"]
    ours = [f for f in frames if f"{os.sep}distlab{os.sep}" in f.filename
            and not f.filename.endswith(("bench.py", f"{os.sep}comm.py"))]
    where = f" called from {os.path.relpath(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})" if ours else ""
    limit = os.environ.get("DISTLAB_TIMEOUT_S", "300")   # not knobs.get: reporting must not fail again
    return (f"collective {ops[0] if ops else '(unknown)'}{where} timed out after {limit} s waiting "
            f"for the other ranks of its group: one of them is frozen, dead or that much slower "
            f"(DISTLAB_TIMEOUT_S sets the limit). {text.splitlines()[-1][:200]}")


def _fail(message: str, code: int) -> None:
    error_dir = os.environ.get("DISTLAB_ERROR_DIR")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if error_dir and os.path.isdir(error_dir):
        tmp = os.path.join(error_dir, f".rank{_rank()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"rank": _rank(), "code": code, "message": message}, f)
        os.replace(tmp, os.path.join(error_dir, f"rank{_rank()}.json"))
        # the launcher stops every rank once one exits: give the others (a mistake in the arguments fails on
        # all of them, a second apart) a moment to file theirs, so the summary names every rank that failed
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        deadline = time.monotonic() + ERROR_GRACE_S
        while time.monotonic() < deadline and len([f for f in os.listdir(error_dir) if f.endswith(".json")]) < local:
            time.sleep(0.05)
    else:
        where = f" (rank {_rank()})" if world > 1 else ""
        text = f"error{where}: {message}" if code == 2 else f"error{where}:\n{message}"
        print(text, file=sys.stderr, flush=True)
    _destroy_groups()
    sys.exit(code)


def _destroy_groups() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            dist.destroy_process_group()
        except Exception:   # leaving anyway; a failed teardown must not hide the error above
            pass


def resolve_device(device: str | None) -> torch.device:
    """``--device``: None -> cuda when present, else cpu; a CUDA device asked for on a machine without one
    is refused with the fix."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} asked for, but this machine has no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu or leave --device out")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: distlab runs on cpu or cuda")
    return dev


def require_gpu(study: str, cpu_hint: str = "--device cpu runs a CPU-sized check of the same code path") -> None:
    """Refuse GPU-only work (kernel timings) on a machine without CUDA, saying what runs instead."""
    if not torch.cuda.is_available():
        raise ValueError(f"{study} times GPU kernels and needs a CUDA device; this machine has none ({cpu_hint})")


def add_common_args(p, iters=None, warmup=None, dtype=None, dtypes=None, gpu_tool=False, plot=False, profile=False,
                    profile_dir="traces", device=True) -> None:
    """The flags every study and benchmark shares, spelled once: ``--device`` (a ``gpu_tool`` runs on CPU
    only when asked: ``device_of``), ``--iters`` / ``--warmup`` (None: the study's GPU/CPU default),
    ``--dtype`` (``dtypes``: the spellings it takes), ``--json``, and
    ``--plot`` / ``--profile`` / ``--profile-dir`` where the study makes them. ``False`` for ``iters``,
    ``warmup`` or ``dtype``: the study has no such flag."""
    if device:
        p.add_argument("--device", default=None, help="cuda (default); cpu only when asked for: a CPU-sized "
                       "code-path check" if gpu_tool else "default: cuda when present, else cpu")
    if iters is not False:
        p.add_argument("--iters", type=positive_int, default=iters, help="timed runs" + ("" if iters else
                       " (default: the study's, per device)"))
    if warmup is not False:
        p.add_argument("--warmup", type=nonnegative_int, default=warmup, help="untimed runs first" + (
                       "" if warmup is not None else " (default: the study's, per device)"))
    if dtype is not False:
        p.add_argument("--dtype", type=dtype_arg(*(dtypes or ())), default=dtype,
                       help="default: bf16 on GPU, fp32 on CPU" if dtype is None else None)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    if plot:
        p.add_argument("--plot", metavar="PNG", default=None, help="plot the results (needs matplotlib)")
    if profile:
        from distlab.profiling import MODES

        p.add_argument("--profile", choices=MODES, default="none", help="trace a few steps (torch: one "
                       "Chrome trace per rank; nsys: a cudaProfilerStart/Stop window)")
        p.add_argument("--profile-dir", default=profile_dir, help="where --profile torch writes its traces")


def device_of(args, study: str, gpu_tool: bool = False, cpu_hint: str | None = None) -> torch.device:
    """The study's device from ``--device``; a ``gpu_tool`` (kernel timings) refuses a machine without CUDA
    unless ``--device cpu`` was given."""
    if gpu_tool and args.device is None:
        require_gpu(study, *([cpu_hint] if cpu_hint else []))
    return resolve_device(args.device)


def available_bytes(device: torch.device) -> int:
    """Memory free for new allocations: the GPU's free memory, or the machine's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def check_memory(need_per_rank: float, device: torch.device, what: str) -> None:
    """Refuse, before allocating, a run whose buffers cannot fit: on a CPU every local rank shares the
    machine's memory; on a GPU each rank has its own device. The estimate is printed with the refusal."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    need, free = need_per_rank * local, available_bytes(device)
    if need > 0.9 * free:
        ranks = f" x {local} local ranks" if local > 1 else ""
        raise ValueError(f"{what} needs about {fmt_bytes(need_per_rank)} per rank{ranks} = {fmt_bytes(need)}, "
                         f"but {fmt_bytes(free)} is free on {device.type}; choose a smaller size")


def progress(items, label: str):
    """Yield ``items``; on rank 0 with a terminal on stderr, show ``label [i/n] item`` as it goes (rich
    when installed, one rewritten line otherwise). Silent in logs and pipes."""
    items = list(items)
    if _rank() != 0 or not sys.stderr.isatty() or not items:
        yield from items
        return
    try:
        from rich.progress import Progress
    except ImportError:
        start = time.perf_counter()
        for i, item in enumerate(items):
            print(f"\r{label} [{i + 1}/{len(items)}] {getattr(item, 'name', item)} ({time.perf_counter() - start:.0f} s)\033[K",
                  end="", file=sys.stderr, flush=True)
            yield item
        print("\r\033[K", end="", file=sys.stderr, flush=True)
        return
    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=len(items))
        for item in items:
            bar.update(task, description=f"{label}: {getattr(item, 'name', item)}")
            yield item
            bar.advance(task)


def timeit(fn, iters, warmup, device, mode="gpu"):
    """Median seconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU). On a GPU each timed call is
    queued behind a spin kernel (``torch.cuda._sleep``) that outlasts its CPU-side launch work, so the
    events time the GPU's work and not Python's launch latency (as under a CUDA graph or a busy stream);
    without it a 0.1 ms kernel would be timed 10–30% slow. ``mode="wall"``: ``time_wall`` instead. The one
    timer of every study and benchmark: "GPU" and "wall" are these two modes."""
    if mode == "wall":
        return time_wall(fn, iters, warmup, device)
    if mode != "gpu":
        raise ValueError(f"timing mode {mode!r}: gpu or wall")
    cpu = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        cpu = time.perf_counter() - t0        # the last warm call's enqueue time (compiles are done by then)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        spin = int(min(2 * cpu + 50e-6, 0.02) * 2e9)   # cycles at ~2 GHz: twice the enqueue time, ≤ 20 ms
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(spin)
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


def time_ranks(fn, iters: int, warmup: int, device: torch.device, barrier: bool = True) -> float:
    """Median seconds of one call of a distributed ``fn()`` (a CP or TP step): the ranks aligned by a barrier
    and the device synchronised before each call, so every rank times the same collective step."""
    import torch.distributed as dist

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if barrier and dist.is_initialized():
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_wall(fn, iters: int, warmup: int, device: torch.device, rounds: int = 3) -> float:
    """Seconds per call of ``fn()`` run back to back from Python (no spin kernel, no graph): what a real
    loop pays, launch latency included — the "wall" figure that benchmarks headline. ``rounds`` rounds of
    ``iters`` calls, each synchronised at its end; the median round's mean. One round of five calls was
    the figure until 2026-12-05, when on an H100 a multi-stream packed ring rank's forward read 5.0 ms wall
    against 0.96 ms of GPU time, and its neighbours 1.0–2.1 ms: one-off host stalls. A cost every call pays
    is in every round; a stall in one round no longer sets the figure."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def time_alternating(fns: dict, iters: int, warmup: int, device: torch.device, mode: str = "gpu",
                     rounds: int = 5) -> dict:
    """Median seconds per call of each of ``fns`` (``{name: fn}``), timed in ``rounds`` rounds that take the
    functions in turn — round i starts at the i-th, so none always goes first — each round ``iters`` calls of
    one function (``timeit``'s way for ``mode``: "gpu" or "wall"). Functions compared this way share the
    device's state: a GPU's clock moves with its load (an H100 under FA4's kernels: 1590-1980 MHz, its power
    cap holding it down, 2026-12-06), so an anchor timed once before a schedule and the schedule timed after
    it need not run at the same clock."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least 1")
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[name]
            if mode == "wall":
                times[name].append(time_wall(fn, iters, 0, device, rounds=1))
            else:
                times[name].append(timeit(fn, iters, 1, device, mode))
    return {name: statistics.median(t) for name, t in times.items()}


def write_json(path: str, result) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) when the plot extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'distlab[plot]')")
        return None
    return plt
