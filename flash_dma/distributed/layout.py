"""How a sequence is cut across the ranks of a process group, and helpers to shard and unshard it.

The sequence of S tokens is cut into equal chunks (the first ``S % chunks`` one token longer):

- ``"zigzag"``: 2N chunks; rank r holds chunks r and 2N-1-r, in that order. Under causal
  attention an early chunk has little to attend and a late one much: pairing them gives every
  rank the same work (ring-flash-attention's zigzag layout).
- ``"contiguous"``: N chunks; rank r holds chunk r. Balanced without causal masking only.

A rank's shard is its chunks concatenated, so its tokens are in global order, with gaps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


class ContextParallel(NamedTuple):
    """Where a sharded sequence lives: the process group and the layout of its shards (for
    :class:`~flash_dma.modules.DynamicMaskAttention`'s ``context_parallel`` argument)."""

    group: object = None  # a torch.distributed ProcessGroup; None is the whole world
    layout: str = "zigzag"


class Chunk(NamedTuple):
    """A run of consecutive tokens held by one rank."""

    start: int  # global position of its first token
    length: int
    offset: int  # position of its first token in the rank's shard

    @property
    def stop(self) -> int:
        return self.start + self.length


def layout_chunks(total: int, world: int, layout: str) -> list[list[Chunk]]:
    """Per rank, its chunks of a sequence of ``total`` tokens, in shard order."""
    parts = 2 * world if layout == "zigzag" else world
    sizes = [total // parts + (i < total % parts) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    owned = [(r, parts - 1 - r) if layout == "zigzag" else (r,) for r in range(world)]
    result = []
    for indices in owned:
        offset, chunks = 0, []
        for i in indices:
            chunks.append(Chunk(starts[i], sizes[i], offset))
            offset += sizes[i]
        result.append(chunks)
    return result


def shard_length(total: int, world: int, rank: int, layout: str) -> int:
    """Tokens that ``rank`` holds of a sequence of ``total``."""
    return sum(c.length for c in layout_chunks(total, world, layout)[rank])


def _group_info(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def shard_sequence(x: torch.Tensor, group=None, *, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of ``x``, the whole sequence along ``dim`` (the same on every rank).

    No communication. For a mask or bias ``[., ., Sq, Sk]``, shard the query axis (``dim=2``) of
    per-query and two-dimensional forms, and the key axis (``dim=3``) of per-key forms.
    """
    _check_layout(layout)
    world, rank = _group_info(group)
    chunks = layout_chunks(x.shape[dim], world, layout)[rank]
    return torch.cat([x.narrow(dim, c.start, c.length) for c in chunks], dim=dim)


def shard_positions(total: int, group=None, *, layout: str = "zigzag", device=None) -> torch.Tensor:
    """``[S_local]`` int64: the global positions of this rank's tokens (rotary embeddings need them)."""
    _check_layout(layout)
    world, rank = _group_info(group)
    chunks = layout_chunks(total, world, layout)[rank]
    return torch.cat([torch.arange(c.start, c.stop, device=device) for c in chunks])


def gather_lengths(length: int | None, group) -> list[int | None]:
    """Every rank's ``length`` (None from a rank without one), in rank order (a collective)."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, length, group=group)
    return every


def unshard_sequence(x: torch.Tensor, group=None, *, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence, in global order, from every rank's shard ``x`` along ``dim`` (a collective).

    Shards may differ in length as the layout cuts them. Not differentiable: gather outputs for
    inspection or evaluation, and compute training losses on the shards.
    """
    _check_layout(layout)
    world, _ = _group_info(group)
    lengths = gather_lengths(x.shape[dim], group)
    total = sum(lengths)
    expected = [shard_length(total, world, r, layout) for r in range(world)]
    if lengths != expected:
        raise ValueError(
            f"x: dimension {dim} holds {lengths} tokens on ranks 0..{world - 1}, but the {layout!r} layout cuts "
            f"{total} tokens into {expected}"
        )
    # all_gather wants one shape: pad every shard to the longest.
    longest = max(lengths)
    padded = x.new_zeros(*x.shape[:dim], longest, *x.shape[dim + 1 :])
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded, group=group)
    pieces = [
        (c.start, shards[r].narrow(dim, c.offset, c.length))
        for r, chunks in enumerate(layout_chunks(total, world, layout))
        for c in chunks
    ]
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim=dim)
