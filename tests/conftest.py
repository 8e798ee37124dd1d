"""Shared fixtures: one pool of gloo processes per world size, kept for the whole session; pools whose workers
run Triton's CPU interpreter, the last two world sizes kept."""

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
