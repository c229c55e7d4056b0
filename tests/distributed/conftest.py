"""Process-group pools shared by this folder's tests: one per world size, started on first use."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.pool import Pool


@pytest.fixture(scope="session")
def pools():
    started: dict[int, Pool] = {}

    def get(world: int) -> Pool:
        if torch.cuda.is_available() and world > torch.cuda.device_count():
            pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
        if world not in started or not all(p.is_alive() for p in started[world]._processes):
            started[world] = Pool(world)
        return started[world]

    yield get
    for pool in started.values():
        pool.close()
