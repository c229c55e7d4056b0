"""A mask stored as one interval of query rows per key: the O(Sk) form of a causal top-k.

Under the causal rule a query sees a prefix of the keys, and the prefixes only grow from one
query to the next. A per-key selection made within them (each query keeps the ``keep``
best-scoring keys it sees, as Doge does) therefore keeps every key for one contiguous run of
queries: a key drops out once ``keep`` keys that outrank it are visible, and never returns.
:class:`KeyIntervals` stores that run, ``[start_j, end_j)`` in query rows, instead of a bit per
(query, key): FlashMask's column intervals.

Layout: ``end`` ``[Bm, Hm, Sk]`` int32 and ``start`` (the same, or None for 0), any strides (a
broadcast axis may have stride 0); key ``j`` of query row ``i`` is kept iff
``start[..., j] <= i < end[..., j]``. Values outside ``[0, Sq]`` are allowed (an interval past the
rows is empty). The causal rule is not part of the mask: it stays the caller's ``is_causal``.

Everything here is plain torch on any device; the kernels' side (the block summary, the words of
the equivalent :class:`~flash_dma.bit_mask.BitMask`, and the intervals of a causal top-k) is in
``backends/triton/key_intervals.py``, and the builders are in ``flash_dma/masks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dma.block_mask import BlockMask
from flash_dma.integers import cdiv

# Elements of a [rows or query blocks, Sk] temporary made at a time; bounds the memory here.
_CHUNK_ELEMENTS = 1 << 24


def _rows_per_chunk(per_row: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(per_row, 1))


def causal_starts(query_len: int, key_len: int, device: torch.device) -> torch.Tensor:
    """int32 ``[key_len]``: the first query row that sees each key under the bottom-right causal rule
    (query row ``i`` sits at key position ``i + key_len - query_len``), 0 for the keys every query sees."""
    return torch.clamp(torch.arange(key_len, device=device) - (key_len - query_len), min=0).to(torch.int32)


def interval_rows(start: torch.Tensor | None, end: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """bool ``[Bm, Hm, stop - first, Sk]``: query rows ``[first, stop)`` of the intervals ``start``/``end``
    ``[Bm, Hm, Sk]`` (``start`` None: 0)."""
    rows = torch.arange(first, stop, device=end.device)[:, None]
    inside = rows < end[:, :, None, :]
    return inside if start is None else inside & (start[:, :, None, :] <= rows)


def interval_states(
    start: torch.Tensor | None, end: torch.Tensor, query_len: int, block_size: tuple[int, int]
) -> torch.Tensor:
    """EMPTY/PARTIAL/FULL per block of the intervals ``start``/``end`` ``[Bm, Hm, Sk]`` over
    ``query_len`` rows: int8 ``[Bm, Hm, NQB, NKB]`` (an axis of size 1 is one block).

    Exact: a block is FULL when every key's interval covers all its rows, EMPTY when none meets
    them. O(Sk) work per query block, a chunk of query blocks at a time.
    """
    batch, heads, key_len = end.shape
    block_q = block_size[0] if query_len > 1 else 1
    block_k = block_size[1] if key_len > 1 else 1
    key_blocks, query_blocks = cdiv(key_len, block_k), cdiv(query_len, block_q)
    pad = key_blocks * block_k - key_len
    start = torch.zeros_like(end) if start is None else start
    states = []
    step = _rows_per_chunk(batch * heads * key_len)
    for first in range(0, query_blocks, step):
        rows_first = torch.arange(first, min(query_blocks, first + step), device=end.device) * block_q
        rows_stop = torch.clamp(rows_first + block_q, max=query_len)[:, None]
        rows_first = rows_first[:, None]
        covers = (start[:, :, None] <= rows_first) & (end[:, :, None] >= rows_stop)  # [Bm, Hm, c, Sk]
        meets = torch.maximum(start[:, :, None], rows_first) < torch.minimum(end[:, :, None], rows_stop)
        # Keys past the end are neutral: they cover every row and meet none.
        covers = torch.nn.functional.pad(covers, (0, pad), value=True).unflatten(-1, (key_blocks, block_k)).all(-1)
        meets = torch.nn.functional.pad(meets, (0, pad), value=False).unflatten(-1, (key_blocks, block_k)).any(-1)
        states.append(meets.to(torch.int8) * (1 + covers.to(torch.int8)))  # EMPTY 0, PARTIAL 1, FULL 2
    return torch.cat(states, dim=2) if len(states) > 1 else states[0]


def causal_topk_ends(scores: torch.Tensor, allowed: torch.Tensor | None, keep: int, query_len: int) -> torch.Tensor:
    """int32 ``[Bm, Hm, Sk]``: the end rows of a causal top-k (see ``masks.causal_topk_intervals``), in
    plain torch, a chunk of keys at a time.

    ``scores`` ``[Bm, Hm, Sk]`` float; ``allowed`` ``[Bm, Hm, Sk]`` bool or None. Key ``j'`` outranks
    key ``j`` when it is allowed and scores higher, or the same and ``j' < j``; a NaN score is never
    allowed. Query row ``i`` sees the keys up to position ``p = i + Sk - Sq`` and keeps ``j`` while
    fewer than ``keep`` of them outrank it: ``end_j`` is the row of the first position at which
    ``keep`` keys outranking ``j`` are visible (``Sq`` if none is), and 0 for a key that is not
    allowed or that ``keep`` earlier keys already outrank.
    """
    key_len = scores.shape[-1]
    valid = ~torch.isnan(scores)
    if allowed is not None:
        valid = valid & allowed
    positions = torch.arange(key_len, device=scores.device)
    ends = []
    step = _rows_per_chunk(scores.shape[0] * scores.shape[1] * key_len)
    for first in range(0, key_len, step):
        mine = positions[first : first + step, None]  # [c, 1]
        score = scores[:, :, first : first + step, None]  # [Bm, Hm, c, 1]
        others = scores[:, :, None, :]
        before = valid[:, :, None, :] & (positions < mine) & (others >= score)
        after = valid[:, :, None, :] & (positions > mine) & (others > score)
        need = keep - before.sum(-1, keepdim=True)  # outrankers after j that end its run
        reached = after.cumsum(-1) >= need
        # The first position where the count reaches `need`; Sk (past every position) if it never does.
        found = torch.where(reached.any(-1), reached.to(torch.int8).argmax(-1), key_len)
        end = torch.clamp(found - (key_len - query_len), 0, query_len)
        ends.append(torch.where(valid[:, :, first : first + step] & (need[..., 0] > 0), end, 0))
    return torch.cat(ends, dim=-1).to(torch.int32)


@dataclass(frozen=True, eq=False)
class KeyIntervals:
    """A boolean mask ``[Bm, Hm, Sq, Sk]`` stored as one interval of query rows per key, with its
    block summary: ``mask[b, h, i, j] = start[b, h, j] <= i < end[b, h, j]``.

    Pass it as ``flash_dma_func(..., attn_mask=intervals)`` (no ``block_mask``: it carries its
    own). Build it with :func:`flash_dma.masks.interval_mask` from intervals of your own,
    :func:`flash_dma.masks.causal_topk_intervals` from per-key scores, or
    ``flash_dma.create_mask(..., is_causal=True)``.

    Attributes:
        start: ``[Bm, Hm, Sk]`` int32, each key's first query row, or None for 0.
        end: ``[Bm, Hm, Sk]`` int32, one past each key's last query row.
        shape: ``(Bm, Hm, Sq, Sk)``; it broadcasts as ``[1|B, 1|Hkv|H, Sq, Sk]``: over batch and
            heads as any mask, never over queries or keys.
        summary: the :class:`~flash_dma.block_mask.BlockMask` of the same mask, its states exact
            (``needs_mask=True``: its PARTIAL blocks are read from the intervals).
    """

    start: torch.Tensor | None
    end: torch.Tensor
    shape: tuple[int, int, int, int]
    summary: BlockMask

    @property
    def device(self) -> torch.device:
        return self.end.device

    def dim(self) -> int:
        return 4

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The mask's query rows ``[start, stop)`` as bool ``[Bm, Hm, stop - start, Sk]``."""
        return interval_rows(self.start, self.end, start, stop)

    def dense(self) -> torch.Tensor:
        """The whole mask as bool ``[Bm, Hm, Sq, Sk]`` (for tests and small problems)."""
        return self.rows(0, self.shape[2])

    def __repr__(self) -> str:
        start = "0" if self.start is None else "start"
        return f"KeyIntervals(shape={self.shape}, rows=[{start}, end), summary={self.summary!r})"
