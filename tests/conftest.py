"""Shared fixtures: one pool of gloo processes per world size, kept for the whole session."""

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
