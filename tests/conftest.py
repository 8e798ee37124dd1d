"""Shared fixtures: one pool of gloo processes per world size, kept for the whole session; pools whose workers
run Triton's CPU interpreter, the last two world sizes kept; tests that mostly wait, started early."""

import concurrent.futures

import pytest
import torch

from distlab.testing import ProcessGroupPool

_POOLS: dict[int, ProcessGroupPool] = {}


@pytest.fixture(scope="session")
def pools():
    """``pools(W)`` -> a live ProcessGroupPool of W gloo ranks (started on first use, restarted if killed)."""

    def get(world_size: int) -> ProcessGroupPool:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive:
            pool = _POOLS[world_size] = ProcessGroupPool(world_size)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()


_INTERPRETED: dict[int, ProcessGroupPool] = {}


@pytest.fixture(scope="session")
def interpreted_pools():
    """``interpreted_pools(W)`` -> a pool of W gloo ranks whose workers run Triton's CPU interpreter (switched on
    before they define the kernels); the two most recently used world sizes are kept."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")

    def get(world_size: int) -> ProcessGroupPool:
        pool = _INTERPRETED.pop(world_size, None)
        if pool is None or not pool.alive:
            pool = ProcessGroupPool(world_size, env={"TRITON_INTERPRET": "1"})
        _INTERPRETED[world_size] = pool                  # the most recent last
        while len(_INTERPRETED) > 2:
            _INTERPRETED.pop(next(iter(_INTERPRETED))).close()
        return pool

    yield get
    for pool in _INTERPRETED.values():
        pool.close()


_EARLY: dict = {}


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Tests marked ``starts_early`` (no fixtures; most of their time is waiting, e.g. for a timeout and a
    launcher's grace period to run out, on little CPU: the gloo tests slow down badly beside busy cores) start
    in a thread once collection is done, so their wait overlaps the tests before them; each reports, in its
    place in the run, what it raised."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        if item.get_closest_marker("starts_early") and not item.get_closest_marker("skip"):
            _EARLY[item.nodeid] = concurrent.futures.ThreadPoolExecutor(1).submit(item.function)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    started = _EARLY.pop(pyfuncitem.nodeid, None)
    if started is None:
        return None
    started.result()   # the test's own assertion error, if it failed
    return True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
