"""A process group that stays up across tests: N worker processes that run functions on request.

Starting processes and a process group costs seconds; a pool does it once per module and world
size. ``run(fn, *args)`` runs ``fn(*args)`` on every rank at once and returns each rank's
result, or each rank's exception. A pool that does not answer within its timeout is torn down
(a hang is a failure, never a stuck CI job).

On a machine with CUDA, rank r uses GPU r over NCCL (NVLink multicast off); elsewhere gloo.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

TIMEOUT_S = 300


@dataclass
class Failure:
    """An exception raised on one rank."""

    kind: str
    message: str
    trace: str


def _serve(rank: int, world: int, store: str, tasks, results) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if os.environ.get("TRITON_INTERPRET") == "1":  # as tests/conftest.py does in the test processes
        from tests.helpers import speed_up_interpreter

        speed_up_interpreter()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S), **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}),
    )
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, fn(*args)))
        except BaseException as error:  # reported to the test, which decides
            results.put((rank, Failure(type(error).__name__, str(error), traceback.format_exc())))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int):
        self.world = world
        context = mp.get_context("spawn")
        self._store = tempfile.NamedTemporaryFile(delete=False).name
        os.unlink(self._store)
        self._tasks = [context.Queue() for _ in range(world)]
        self._results = context.Queue()
        self._processes = [
            context.Process(target=_serve, args=(rank, world, self._store, self._tasks[rank], self._results), daemon=True)
            for rank in range(world)
        ]
        for p in self._processes:
            p.start()

    def run(self, fn, *args) -> list:
        """``fn(*args)`` on every rank: the results (or :class:`Failure`) in rank order."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        results = [None] * self.world
        for _ in range(self.world):
            try:
                rank, result = self._results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                self.close(force=True)
                raise AssertionError(f"the process group did not answer within {TIMEOUT_S} s (a hang)") from None
            results[rank] = result
        return results

    def run_ok(self, fn, *args) -> list:
        """As :meth:`run`, failing the test with every rank's traceback if any rank raised."""
        results = self.run(fn, *args)
        failures = [f"rank {r}:\n{res.trace}" for r, res in enumerate(results) if isinstance(res, Failure)]
        assert not failures, "\n".join(failures)
        return results

    def close(self, force: bool = False) -> None:
        if not force:
            for tasks in self._tasks:
                tasks.put(None)
            for p in self._processes:
                p.join(timeout=30)
        for p in self._processes:
            if p.is_alive():
                p.kill()
        if os.path.exists(self._store):
            os.unlink(self._store)
