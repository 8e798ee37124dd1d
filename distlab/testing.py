"""A pool of real gloo process groups that runs test functions on every rank.

    python -m pytest tests/test_ring.py     # the tests use one pool per world size for the whole session

Starting W processes costs seconds, so tests keep a pool per world size and send it work:
``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank (after ``init_process_group``) and
returns the per-rank results in rank order (``pool.map(fn, jobs)`` deals one-process jobs out over the
ranks). ``fn`` must be importable by name (a module-level function of a test module or package). If any
rank raises, ``run`` raises ``RankErrors`` holding every rank's error; ``pool.run_all(fn, ...)`` returns
``(ok, value_or_error_text)`` per rank instead, for tests that expect every rank to refuse an input. A
task that does not finish in ``timeout_s`` kills the pool (its process group may be stuck in a collective),
and the error says which ranks did not answer.

Workers use one thread each (a 2-core machine runs 8 of them) and the group's collectives time out
after ``group_timeout_s`` so a bug fails instead of hanging. The process groups a task creates (a
``DeviceMesh``'s subgroups) are destroyed when it returns: each gloo group keeps threads that poll, and
a pool that had served the model tests held 97 threads per worker, a third of a core between four.

Workers are forked from a forkserver that imported torch once, so a new pool costs no ``import torch``
(0.1 s instead of seconds). They see the environment the forkserver started with (the first pool's),
plus ``env``, which each worker sets before it imports anything else (e.g. ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import queue
import time
import traceback

from distlab.ports import free_port


class RankErrors(RuntimeError):
    """Raised when some ranks failed; ``errors`` maps rank -> error text."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"[rank {r}] {e}" for r, e in sorted(errors.items())))


def _groups() -> list:
    """Every process group this process holds (the default one included). torch has no public list of
    them, so this reads ``distributed_c10d``'s own map."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def _destroy_groups_but(keep) -> int:
    """Destroy every process group not in ``keep`` (a task's mesh subgroups: each keeps gloo threads polling,
    i.e. CPU, until destroyed); returns how many."""
    import torch.distributed as dist

    created = [group for group in _groups() if group not in keep]
    for group in created:
        dist.destroy_process_group(group)
    return len(created)


def _worker(rank, world, port, group_timeout_s, tasks, results, env):
    os.environ.update(env)   # before anything reads it (TRITON_INTERPRET: when the kernels are defined)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    results.put((rank, -1, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        groups_before = set(_groups())
        try:
            results.put((rank, task_id, True, fn(*args, **kwargs)))
        except BaseException as e:  # report everything, keep serving
            results.put((rank, task_id, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        if _destroy_groups_but(groups_before):
            gc.collect()   # and free them: the meshes that held them sit in reference cycles
    dist.destroy_process_group()


class ProcessGroupPool:
    def __init__(self, world_size: int, group_timeout_s: float = 60.0, start_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, port, group_timeout_s, self.tasks[r], self.results,
                                        dict(env or {})))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self._next_id = 0
        self._collect(-1, start_timeout_s)

    def _collect(self, task_id: int, timeout_s: float) -> list[tuple[bool, object]]:
        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            try:
                rank, tid, ok, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(got))
                self.close(kill=True)
                raise TimeoutError(f"ranks {missing} of a {self.world_size}-process pool did not answer within "
                                   f"{timeout_s:.0f} s; the pool was killed") from None
            if tid == task_id:  # answers to an earlier, timed-out task are dropped
                got[rank] = (ok, value)
        return [got[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run_all(self, fn, *args, timeout_s: float = 180.0, **kwargs) -> list[tuple[bool, object]]:
        """``fn(*args, **kwargs)`` on every rank; ``[(ok, result or error text)]`` in rank order."""
        if not self.alive:
            raise RuntimeError("the process pool is not alive")
        self._next_id += 1
        for t in self.tasks:
            t.put((self._next_id, fn, args, kwargs))
        return self._collect(self._next_id, timeout_s)

    def run(self, fn, *args, timeout_s: float = 180.0, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order, or ``RankErrors``."""
        outcome = self.run_all(fn, *args, timeout_s=timeout_s, **kwargs)
        errors = {r: v for r, (ok, v) in enumerate(outcome) if not ok}
        if errors:
            raise RankErrors(errors)
        return [v for _, v in outcome]

    def map(self, fn, jobs, timeout_s: float = 180.0) -> list:
        """``fn(*job)`` for each of ``jobs`` (tuples of arguments), dealt out over the ranks (rank r takes jobs
        r, r + W, ...): one-process work (no collectives) run W at a time. The results in job order."""
        jobs = [tuple(job) for job in jobs]
        done = dict(pair for share in self.run(_share_of_jobs, fn, jobs, timeout_s=timeout_s) for pair in share)
        return [done[i] for i in range(len(jobs))]

    def close(self, kill: bool = False) -> None:
        for p, t in zip(self.procs, self.tasks):
            if p.is_alive() and not kill:
                t.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()


def _share_of_jobs(fn, jobs):
    """This rank's share of ``ProcessGroupPool.map``: ``[(job index, fn(*job))]``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return [(i, fn(*jobs[i])) for i in range(rank, len(jobs), world)]


def run_in_triton_interpreter(code: str, timeout_s: float = 300):
    """Run ``code`` in a fresh Python with ``TRITON_INTERPRET=1`` (it must be set before triton is imported:
    the kernels' CPU tests), this checkout first on the path; the ``CompletedProcess``, output captured.
    Skips the calling test when triton is not installed (the gpu extra)."""
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)


def install_fa4_stand_in(compute: bool = True) -> dict:
    """Put a stand-in of FlashAttention-4's forward interface in ``sys.modules`` (``flash_attn.cute.interface``)
    for CPU tests and host-time checks of the code that records and replays FA4's compiled kernel
    (``distlab.kernels.fa4``, ``distlab.cp.ring_kept``): ``_flash_attn_fwd(q, k, v, softmax_scale, causal,
    return_lse)`` allocates out and a float32 LSE ``(batch, heads, seq)``, finds its "compiled kernel" in
    ``_flash_attn_fwd.compile_cache`` (made on the first call of a key, as FA4 compiles) and calls it with
    ``(q, k, v, out, lse, scale, causal)`` — FA4's contract as the recorder relies on it. The kernel computes
    the attention with the ``torch`` backend (``compute=False``: nothing, for host timing). Returns the
    stand-in's counters (``calls``: interface calls, ``kernel``: kernel calls); ``remove_fa4_stand_in()``
    takes it out."""
    import sys
    import types

    import torch

    counts = {"calls": 0, "kernel": 0}

    def compiled(q, k, v, out, lse, scale, causal):
        counts["kernel"] += 1
        if compute:
            from distlab.kernels.attention import attention_forward

            o, l = attention_forward(q, k, v, causal, scale, backend="torch")
            out.copy_(o)
            lse.copy_(l)

    def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, **_):
        counts["calls"] += 1
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
        key = (q.dtype, q.shape[2] // k.shape[2], causal)
        cache = _flash_attn_fwd.compile_cache
        if key not in cache:
            cache[key] = compiled
        cache[key](q, k, v, out, lse, softmax_scale, causal)
        return out, lse

    _flash_attn_fwd.compile_cache = {}
    top, cute, interface = (types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"))
    interface._flash_attn_fwd = _flash_attn_fwd
    top.cute, cute.interface = cute, interface
    for name in (top.__name__, cute.__name__, interface.__name__):   # what was there before the first stand-in
        _SAVED_MODULES.setdefault(name, sys.modules.get(name))
    sys.modules.update({m.__name__: m for m in (top, cute, interface)})
    return counts


_SAVED_MODULES: dict = {}


@contextlib.contextmanager
def fa4_pretended(interface=None):
    """FA4 taken as present on every device and dtype of this process (``fa4.runs_on`` true; ``interface``, if
    given, is what ``fa4._interface()`` returns), for CPU tests of the code around FA4's kernels. The backend
    lookups that ``distlab.kernels.attention`` caches are forgotten on the way in and on the way out: a pool's
    worker serves many tests, and one that cached ``fa4`` for CPU float64 made later tests' ``auto`` pick it."""
    from distlab.kernels import attention, fa4

    saved = fa4.runs_on, fa4._interface
    fa4.runs_on = lambda device, dtype: True
    if interface is not None:
        fa4._interface = lambda: interface
    attention._available.cache_clear()
    attention._resolve.cache_clear()
    try:
        yield
    finally:
        fa4.runs_on, fa4._interface = saved
        attention._available.cache_clear()
        attention._resolve.cache_clear()


def remove_fa4_stand_in():
    """Undo ``install_fa4_stand_in`` (the modules it replaced, if any, are put back); forget FA4's replays."""
    import sys

    from distlab.kernels import fa4

    for name, module in _SAVED_MODULES.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    _SAVED_MODULES.clear()
    fa4._REPLAYS.clear()
