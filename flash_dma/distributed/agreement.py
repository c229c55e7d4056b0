"""Collective validation: every rank raises the same error, or none does, before any transfer.

A rank that raised on its own while the others went on into the ring would leave them waiting
for it forever. So each rank checks its own inputs, catching the error, and the ranks exchange
what they found (one ``all_gather_object``) with a description of their inputs; then each
raises the first error, or a mismatch between ranks, naming the rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def agree(group, check: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's ``check()`` result, in rank order, once all ranks have run it without error.

    ``check`` validates this rank's inputs and returns a description of them. A ``ValueError`` or
    ``TypeError`` it raises on any rank is raised on every rank, prefixed with that rank. Other
    exceptions are raised as they are, on the rank that hit them, after the exchange.
    """
    description, error, unexpected = None, None, None
    try:
        description = check()
    except (ValueError, TypeError) as caught:
        error = (type(caught).__name__, str(caught))
    except Exception as caught:  # not an input error: still take part in the exchange, then raise
        unexpected = caught
        error = ("ValueError", f"{type(caught).__name__}: {caught}")
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (description, error), group=group)
    if unexpected is not None:
        raise unexpected
    for rank, (_, failure) in enumerate(every):
        if failure is not None:
            kind, message = failure
            raise _ERRORS[kind](f"rank {rank}: {message}")
    return [d for d, _ in every]


def require_same(descriptions: list[dict[str, Any]], keys: dict[str, str]) -> None:
    """Each ``key`` of ``keys`` (mapped to the words naming it) must be equal on every rank."""
    for key, words in keys.items():
        values = [d[key] for d in descriptions]
        if any(v != values[0] for v in values):
            got = ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))
            raise ValueError(f"{words}: expected the same on every rank of the group, got {got}")
