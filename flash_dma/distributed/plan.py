"""Which keys a rank attends at one ring step, and the kernel calls that attend them.

At each step a rank's queries meet the keys of one rank (itself first). Every pair of a query
chunk and a key chunk is cut to the rows and keys that the causal/window band leaves in contact
(global positions), and the pair is then one of:

- empty: no call, and the key chunk is not sent unless another pair needs it;
- full: every row sees every key; full pairs that tile a rectangle become one call;
- banded: one call whose window is the band shifted into the pair's own coordinates.

Cutting the pair first keeps that shifted window non-negative on both sides, which is what
the kernels' bottom-right aligned windows express (-1 meaning unbounded).

A key chunk whose per-key mask keeps nothing is never sent; one whose kept keys fill only some
blocks of :data:`BLOCK` keys, and that meets only full pairs (positions do not matter there),
is sent compacted: its kept blocks only.

A rank's calls return partial outputs for ranges of its rows; :func:`output_runs` cuts each
call's rows where the number of calls that cover them changes, so that the forward knows, per
run, whether it is the rows' first result, a middle one or the last.
"""

from __future__ import annotations

from itertools import permutations
from typing import NamedTuple

import torch

from flash_dma.distributed.layout import Chunk

BLOCK = 128  # keys per block of the kept-key summaries: the kernels' key tile


class Band(NamedTuple):
    """Key j is visible to query i iff ``lo <= j - i <= hi`` (global positions); None is unbounded."""

    lo: int | None
    hi: int | None

    @classmethod
    def of(cls, window: tuple[int, int]) -> "Band":
        left, right = window
        return cls(None if left < 0 else -left, None if right < 0 else right)


class Call(NamedTuple):
    """One kernel call: local query rows ``[rows)`` against key-buffer rows ``[keys)``."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    window: tuple[int, int]  # bottom-right aligned over this rectangle; -1 unbounded


class Segment(NamedTuple):
    """A run of the source rank's keys in the step's key buffer."""

    offset: int  # first key in the source's shard
    length: int
    start: int  # its global position


class Step(NamedTuple):
    """What one rank attends of one source rank: the key buffer (its segments, concatenated) and the calls."""

    segments: tuple[Segment, ...]
    calls: tuple[Call, ...]

    @property
    def length(self) -> int:
        return sum(s.length for s in self.segments)

    def shard_index(self) -> torch.Tensor:
        """``[length]`` int64: the source shard's row of each buffer row."""
        return torch.cat([torch.arange(s.offset, s.offset + s.length) for s in self.segments])

    def key_runs(self, first: int, last: int) -> list[tuple[int, int]]:
        """Global ``(start, length)`` runs of buffer rows ``[first, last)``."""
        runs, at = [], 0
        for s in self.segments:
            lo, hi = max(first, at), min(last, at + s.length)
            if lo < hi:
                runs.append((s.start + lo - at, hi - lo))
            at += s.length
        return runs


class _Pair(NamedTuple):
    chunk: int  # index of the key chunk among the source's
    rows: tuple[int, int]  # global query positions
    keys: tuple[int, int]  # global key positions
    window: tuple[int, int]
    full: bool


def _cut(q: Chunk, k: Chunk, band: Band, chunk: int) -> _Pair | None:
    """The pair of ``q`` and ``k`` cut to what the band leaves in contact, or None if nothing is."""
    qa, qb, ka, kb = q.start, q.stop, k.start, k.stop
    if band.hi is not None:
        qa, kb = max(qa, k.start - band.hi), min(kb, q.stop + band.hi)
    if band.lo is not None:
        qb, ka = min(qb, k.stop - band.lo), max(ka, q.start + band.lo)
    if qa >= qb or ka >= kb:
        return None
    full = (band.lo is None or ka - (qb - 1) >= band.lo) and (band.hi is None or (kb - 1) - qa <= band.hi)
    if full:
        window = (-1, -1)
    else:
        shift = kb - qb  # the bottom-right diagonal's offset j - i
        window = (-1 if band.lo is None else shift - band.lo, -1 if band.hi is None else band.hi - shift)
    return _Pair(chunk, (qa, qb), (ka, kb), window, full)


def _kept_runs(kept: list[bool], chunk: Chunk) -> list[Segment]:
    """The chunk's kept blocks as segments, adjacent blocks joined."""
    segments, run_start = [], None
    flags = kept + [False]
    for block, keep in enumerate(flags):
        if keep and run_start is None:
            run_start = block
        elif not keep and run_start is not None:
            first, last = run_start * BLOCK, min(block * BLOCK, chunk.length)
            segments.append(Segment(chunk.offset + first, last - first, chunk.start + first))
            run_start = None
    return segments


def _merged(calls: list[Call]) -> list[Call]:
    """Unbounded calls joined while two of them tile a rectangle."""
    calls = list(calls)
    joined = True
    while joined:
        joined = False
        for a, b in permutations(calls, 2):
            if a.rows == b.rows and a.keys[1] == b.keys[0]:
                merged = Call(a.rows, (a.keys[0], b.keys[1]), a.window)
            elif a.keys == b.keys and a.rows[1] == b.rows[0]:
                merged = Call((a.rows[0], b.rows[1]), a.keys, a.window)
            else:
                continue
            calls = [c for c in calls if c is not a and c is not b] + [merged]
            joined = True
            break
    return sorted(calls)


def kept_blocks(kept_keys: torch.Tensor | None, chunk: Chunk) -> list[bool] | None:
    """Per block of the chunk, whether it holds a key that ``kept_keys`` ``[S_r]`` (bool, over the
    rank's shard) keeps; None when there is no per-key mask (every key counts as kept)."""
    if kept_keys is None:
        return None
    padded = kept_keys.new_zeros(-(-chunk.length // BLOCK) * BLOCK)
    padded[: chunk.length] = kept_keys[chunk.offset : chunk.offset + chunk.length]
    return padded.view(-1, BLOCK).any(dim=1).tolist()


def plan_step(
    queries: list[Chunk],
    keys: list[Chunk],
    band: Band,
    kept: list[list[bool] | None],
    *,
    same_rank: bool,
    compact: bool,
) -> Step:
    """The step of a rank with query chunks ``queries`` over the key chunks ``keys`` of a source rank.

    ``kept``: per key chunk, :func:`kept_blocks` of its per-key mask (None: no per-key mask).
    ``same_rank``: the keys are the rank's own (its shard is the buffer, never compacted).
    ``compact``: chunks that meet only full pairs may be sent as their kept blocks.
    """
    if same_rank and band.lo is None and band.hi in (None, 0):
        # A shard's tokens are in global order: one call over the whole shard, causal or not.
        length = sum(c.length for c in keys)
        calls = (Call((0, length), (0, length), (-1, -1 if band.hi is None else 0)),) if length else ()
        return Step(tuple(Segment(c.offset, c.length, c.start) for c in keys), calls)
    pairs = []
    for index, k in enumerate(keys):
        if k.length == 0 or (kept[index] is not None and not any(kept[index])):
            continue
        pairs += [p for q in queries if q.length for p in [_cut(q, k, band, index)] if p is not None]
    needed = range(len(keys)) if same_rank else sorted({p.chunk for p in pairs})
    segments, place, compacted = [], {}, set()
    for index in needed:
        k = keys[index]
        first = sum(s.length for s in segments)
        own = [p for p in pairs if p.chunk == index]
        whole = all(p.full and p.keys == (k.start, k.stop) for p in own)
        if compact and not same_rank and whole and kept[index] is not None and not all(kept[index]):
            segments += _kept_runs(kept[index], k)
            compacted.add(index)
        else:
            segments.append(Segment(k.offset, k.length, k.start))
        place[index] = (first, sum(s.length for s in segments))  # its rows in the buffer
    full_calls, calls = [], []
    for p in pairs:
        q = next(c for c in queries if c.start <= p.rows[0] < c.stop)
        k = keys[p.chunk]
        rows = (q.offset + p.rows[0] - q.start, q.offset + p.rows[1] - q.start)
        first, stop = place[p.chunk]
        key_rows = (first, stop) if p.chunk in compacted else (first + p.keys[0] - k.start, first + p.keys[1] - k.start)
        (full_calls if p.full else calls).append(Call(rows, key_rows, p.window))
    return Step(tuple(segments), tuple(sorted(calls + _merged(full_calls))))


class Run(NamedTuple):
    """Query rows of one call's result, and their place among the calls that cover them."""

    rows: tuple[int, int]  # local query rows [start, stop)
    index: int  # calls before this one that cover these rows
    count: int  # calls that cover them in all, this one included

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def _covering(calls: list[tuple[int, int]], lo: int, hi: int) -> int:
    return sum(1 for a, b in calls if a <= lo and hi <= b)


def output_runs(calls: list[tuple[int, int]]) -> list[tuple[Run, ...]]:
    """Per call, given the row ranges ``[a, b)`` of a rank's calls in the order they run: its rows
    as runs of equal coverage, adjacent runs of equal coverage joined."""
    edges = sorted({edge for rows in calls for edge in rows})
    result = []
    for i, (a, b) in enumerate(calls):
        cuts = [e for e in edges if a <= e <= b]
        runs: list[Run] = []
        for lo, hi in zip(cuts, cuts[1:]):
            index = _covering(calls[:i], lo, hi)
            run = Run((lo, hi), index, index + _covering(calls[i:], lo, hi))
            if runs and (runs[-1].index, runs[-1].count) == (index, run.count):
                run = run._replace(rows=(runs.pop().rows[0], hi))
            runs.append(run)
        result.append(tuple(runs))
    return result


def uncovered_rows(calls: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The ranges of rows ``[0, length)`` that no call covers (they see no key: out 0, lse -inf)."""
    gaps, at = [], 0
    for a, b in sorted(calls):
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    return gaps + ([(at, length)] if at < length else [])
