"""Ring plans against brute force: the calls of a rank's steps cover exactly the (query, key) pairs
that the global band leaves (and the per-key mask keeps), each once; the merge runs place every
row's results in order. No processes needed."""

from __future__ import annotations

import random

import pytest
import torch

from flash_dma.backends.reference import visible_positions
from flash_dma.distributed.layout import LAYOUTS, layout_chunks
from flash_dma.distributed.plan import BLOCK, Band, kept_blocks, output_runs, plan_step, uncovered_rows

WINDOWS = ((-1, -1), (-1, 0), (0, 0), (5, 0), (40, 17), (300, -1), (-1, 3))


def _positions(chunks) -> torch.Tensor:
    return torch.cat([torch.arange(c.start, c.stop) for c in chunks])


def _coverage(chunks, receiver: int, band: Band, kept) -> torch.Tensor:
    """``[S_r, S]`` int: how many calls of the receiver's steps cover each (query, global key) pair."""
    total = sum(c.length for rank in chunks for c in rank)
    queries = _positions(chunks[receiver])
    covered = torch.zeros(len(queries), total, dtype=torch.int64)
    for source, source_chunks in enumerate(chunks):
        blocks = [kept_blocks(kept[source], c) for c in source_chunks]
        step = plan_step(chunks[receiver], source_chunks, band, blocks, same_rank=receiver == source, compact=True)
        keys = torch.cat([torch.arange(s.start, s.start + s.length) for s in step.segments] or [torch.zeros(0, dtype=torch.int64)])
        assert len(keys) == step.length
        for call in step.calls:
            assert min(call.window) >= -1, call  # the kernels' windows: -1 or a reach
            (a, b), (c, d) = call.rows, call.keys
            visible = visible_positions(torch.arange(b - a), b - a, d - c, call.window).long()
            covered[a:b].index_add_(1, keys[c:d], visible)
    return covered


def _band(queries: torch.Tensor, total: int, band: Band) -> torch.Tensor:
    offsets = torch.arange(total)[None, :] - queries[:, None]
    inside = torch.ones_like(offsets, dtype=torch.bool)
    if band.lo is not None:
        inside &= offsets >= band.lo
    if band.hi is not None:
        inside &= offsets <= band.hi
    return inside


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("total", (1, 7, 300, 1031))
@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_calls_cover_the_band_once(layout, world, total, window):
    chunks = layout_chunks(total, world, layout)
    band = Band.of(window)
    for receiver in range(world):
        covered = _coverage(chunks, receiver, band, [None] * world)
        assert torch.equal(covered, _band(_positions(chunks[receiver]), total, band).long())


@pytest.mark.parametrize("window", WINDOWS[:3], ids=str)
@pytest.mark.parametrize("world", (2, 3))
def test_per_key_masks_skip_and_compact(world, window):
    total = 2 * world * 3 * BLOCK + 57
    kept_keys = torch.rand(total, generator=torch.Generator().manual_seed(world)) < 0.3
    kept_keys[: total // (2 * world)] = False  # rank 0's first chunk keeps nothing
    kept_keys[BLOCK * 5 : BLOCK * 9] = False  # whole blocks that keep nothing
    chunks = layout_chunks(total, world, "zigzag")
    kept = [torch.cat([kept_keys[c.start : c.stop] for c in rank]) for rank in chunks]
    band = Band.of(window)
    sent = 0
    for receiver in range(world):
        covered = _coverage(chunks, receiver, band, kept)
        inside = _band(_positions(chunks[receiver]), total, band)
        assert covered.max() <= 1 and not (covered.bool() & ~inside).any()  # each pair at most once, never outside
        assert torch.equal(covered.bool() | ~(inside & kept_keys[None, :]), torch.ones_like(inside))  # every kept pair
        for source in range(world):
            if source != receiver:
                blocks = [kept_blocks(kept[source], c) for c in chunks[source]]
                step = plan_step(chunks[receiver], chunks[source], band, blocks, same_rank=False, compact=True)
                sent += step.length
                assert all(s.start >= chunks[0][0].stop or s.start + s.length <= chunks[0][0].start for s in step.segments)
    # Compaction and skipping send fewer keys than whole shards would.
    assert sent < (world - 1) * total


def _row_runs(calls: list[tuple[int, int]], length: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Brute force: per call, per row it covers, ``(index, count)``; and every row's count."""
    counts = [sum(1 for a, b in calls if a <= row < b) for row in range(length)]
    places = [[(sum(1 for a, b in calls[:i] if a <= row < b), counts[row]) for row in range(*rows)] for i, rows in enumerate(calls)]
    return places, counts


@pytest.mark.parametrize("seed", range(30))
def test_output_runs_place_every_row(seed):
    gen = random.Random(seed)
    length = gen.randint(1, 40)
    calls = [tuple(sorted(gen.sample(range(length + 1), 2))) for _ in range(gen.randint(0, 6))]
    places, counts = _row_runs(calls, length)
    for rows, runs, expected in zip(calls, output_runs(calls), places):
        assert [r for run in runs for r in range(*run.rows)] == list(range(*rows))
        assert [(run.index, run.count) for run in runs for _ in range(*run.rows)] == expected
        assert all((a.index, a.count) != (b.index, b.count) for a, b in zip(runs, runs[1:]))  # joined
    assert [r for a, b in uncovered_rows(calls, length) for r in range(a, b)] == [r for r in range(length) if not counts[r]]

