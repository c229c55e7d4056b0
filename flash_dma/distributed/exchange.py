"""Point-to-point transfers between the ranks of a group, posted together and awaited later.

On NCCL the transfers run on NCCL's own stream, so posting the next step's transfers before
computing the current step overlaps the two; ``wait`` makes the current stream wait for them.
Bool tensors travel as bytes (not every backend takes bool).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class Transfers:
    """Sends and receives of one exchange; ``received`` holds the receive buffers once waited for."""

    def __init__(self, group, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]):
        """``sends``/``receives``: ``(tensor, group rank of the peer)``; receive buffers are filled in place."""
        self.received = [t for t, _ in receives]
        # Contiguous copies are kept alive here until the transfer is done.
        self._sent = [(_wire(t.contiguous()), peer) for t, peer in sends]
        ops = [dist.P2POp(dist.isend, t, self._peer(group, peer), group) for t, peer in self._sent]
        ops += [dist.P2POp(dist.irecv, _wire(t), self._peer(group, peer), group) for t, peer in receives]
        self._works = dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def _peer(group, rank: int) -> int:
        return rank if group is None else dist.get_global_rank(group, rank)

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], []
        return self.received
