"""A mask stored one bit per (query, key), with its block summary: the compact per-query mask.

A per-query mask ``[B, H, Sq, Sk]`` (each query its own keys: a per-query top-k) costs a byte
per pair as a bool tensor, which is most of what a kernel reads on the tiles it keeps. A
:class:`BitMask` stores it in 1/8 of that, packed once (by ``flash_dma.pack_mask``,
``flash_dma.indices_to_mask`` or ``create_mask(..., packed=True)``) and reused by every layer
and both passes, together with the :class:`~flash_dma.block_mask.BlockMask` that lets the
kernels skip its empty tiles and read no bits on its full ones.

Layout of ``words`` ``[Bm, Hm, Sqm, W]`` int32: key ``j`` of row ``i`` is bit ``j % 32`` of
``words[..., i, j // 32]``; ``W = 4 * ceil(Skm / 128)``, so that every row starts on 16 bytes
(whole rows load as vectors), and the bits past ``Skm`` are 0.

Everything here is plain torch on any device; the kernels' side is in the Triton backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dma.block_mask import EMPTY, FULL, PARTIAL, BlockMask
from flash_dma.integers import cdiv

WORD_BITS = 32
ROW_ALIGN = 128  # keys per 16 bytes of a row: rows are padded to a multiple
# Mask elements packed or unpacked at a time; bounds the temporary memory.
_CHUNK_ELEMENTS = 1 << 26


def words_per_row(key_len: int) -> int:
    """Int32 words of one packed row of ``key_len`` keys (at least one 16-byte group)."""
    return cdiv(max(key_len, 1), ROW_ALIGN) * (ROW_ALIGN // WORD_BITS)


def _row_chunks(rows: int, per_row: int) -> tuple[range, int]:
    """Starts of chunks of ``rows`` rows of ``per_row`` elements each within the memory budget, and their size."""
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    return range(0, rows, step), step


def pack_rows(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[..., Sk]`` -> int32 words ``[..., words_per_row(Sk)]`` (the layout above)."""
    key_len = mask.shape[-1]
    width = words_per_row(key_len)
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, width * WORD_BITS - key_len))
    # Made on the device (a list would be copied from the host, which a CUDA graph capture refuses).
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    weights = torch.bitwise_left_shift(torch.ones_like(shifts), shifts)  # 1, 2, 4, ..., 128
    # Eight keys per byte (a sum of distinct powers of two), four little-endian bytes per word.
    packed = (bits.view(*mask.shape[:-1], width * 4, 8) * weights).sum(-1, dtype=torch.uint8)
    return packed.view(torch.int32)


def pack_words(rows_of, shape: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
    """The words ``[Bm, Hm, Sqm, W]`` of a mask of ``shape`` whose query rows ``[start, stop)`` are
    ``rows_of(start, stop)`` (bool ``[Bm, Hm, rows, Skm]``), made a bounded chunk of rows at a
    time: the mask need never exist whole."""
    batch, heads, rows, key_len = shape
    words = torch.empty(batch, heads, rows, words_per_row(key_len), dtype=torch.int32, device=device)
    chunks, step = _row_chunks(rows, batch * heads * key_len)
    for start in chunks:
        words[:, :, start : start + step] = pack_rows(rows_of(start, min(rows, start + step)))
    return words


def additive_floor(dtype: torch.dtype) -> float | None:
    """The value at or below which an additive float mask of ``dtype`` drops a pair (the dtype's
    minimum, as transformers' eager masks and v1's ``create_mask(min_dtype=...)`` fill it; -inf and
    NaN drop it too); None for bool and integer masks, whose zeros drop pairs."""
    return float(torch.finfo(dtype).min) if dtype.is_floating_point else None


def kept_pairs(mask: torch.Tensor) -> torch.Tensor:
    """bool: the pairs a bool, 0/1 integer or additive float mask keeps (:func:`additive_floor`)."""
    floor = additive_floor(mask.dtype)
    return mask != 0 if floor is None else mask > floor


def pack_mask_words(mask: torch.Tensor) -> torch.Tensor:
    """The words of a bool, 0/1 integer or additive float mask ``[Bm, Hm, Sqm, Skm]``, a chunk of rows at a time."""
    return pack_words(lambda start, stop: kept_pairs(mask[:, :, start:stop]), tuple(mask.shape), mask.device)


def unpack_rows(words: torch.Tensor, key_len: int) -> torch.Tensor:
    """int32 words ``[..., W]`` -> bool ``[..., key_len]``: the inverse of :func:`pack_rows`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    octets = words.contiguous().view(torch.uint8)  # [..., 4 W], little-endian
    bits = (octets.unsqueeze(-1) >> shifts) & 1
    return bits.view(*words.shape[:-1], -1)[..., :key_len].bool()


def _low_bits(counts: torch.Tensor) -> torch.Tensor:
    """int32 words whose lowest ``counts`` bits are set (``counts`` in [0, 32])."""
    full = (torch.ones_like(counts) << counts) - 1  # int64: exact up to 2**32 - 1
    return torch.where(full >= 2**31, full - 2**32, full).to(torch.int32)


def block_states(words: torch.Tensor, shape: tuple[int, int, int, int], block_size: tuple[int, int]) -> torch.Tensor:
    """EMPTY/PARTIAL/FULL per block of a packed mask of ``shape``: int8 ``[Bm, Hm, NQB, NKB]``.

    Read from the words alone (1/8 of the mask's bytes), a chunk of query blocks at a time. An
    axis of size 1 is one block; a key block must hold whole words (``block_k >= 32``).
    """
    batch, heads, query_len, key_len = shape
    block_q = block_size[0] if query_len > 1 else 1
    width = words.shape[-1]
    if key_len > 1:
        words_per_block = block_size[1] // WORD_BITS
        key_blocks = cdiv(key_len, block_size[1])
    else:
        words_per_block, key_blocks = width, 1
    padded_width = key_blocks * words_per_block
    valid = _low_bits(torch.clamp(key_len - WORD_BITS * torch.arange(padded_width, device=words.device), 0, WORD_BITS))
    query_blocks = cdiv(query_len, block_q)
    chunks, step = _row_chunks(query_blocks, block_q * padded_width * batch * heads)
    states = []
    for first in chunks:
        rows = words[:, :, first * block_q : (first + step) * block_q]
        rows = torch.nn.functional.pad(rows, (0, padded_width - width))
        blocks = cdiv(rows.shape[2], block_q)
        # Rows past the end count as all true for FULL and all false for "any".
        pad_rows = blocks * block_q - rows.shape[2]
        any_set = torch.nn.functional.pad(rows != 0, (0, 0, 0, pad_rows), value=False)
        all_set = torch.nn.functional.pad((rows | ~valid) == -1, (0, 0, 0, pad_rows), value=True)
        view = (batch, heads, blocks, block_q, key_blocks, words_per_block)
        nonempty = any_set.view(view).any(dim=5).any(dim=3)
        full = all_set.view(view).all(dim=5).all(dim=3)
        states.append(torch.where(full, FULL, torch.where(nonempty, PARTIAL, EMPTY)).to(torch.int8))
    return torch.cat(states, dim=2) if len(states) > 1 else states[0]


@dataclass(frozen=True, eq=False)
class BitMask:
    """A boolean mask ``[Bm, Hm, Sqm, Skm]`` stored one bit per element, with its block summary.

    Pass it as ``flash_dma_func(..., attn_mask=bit_mask)`` (no ``block_mask``: it carries its
    own). Build it with ``flash_dma.pack_mask``, ``flash_dma.indices_to_mask`` or
    ``flash_dma.create_mask(..., packed=True)``.

    Attributes:
        words: ``[Bm, Hm, Sqm, W]`` int32, the layout of the module doc.
        shape: ``(Bm, Hm, Sqm, Skm)``, the shape of the mask it holds; it broadcasts as a bool
            mask of that shape would (``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]``).
        summary: the :class:`~flash_dma.block_mask.BlockMask` of the same mask
            (``needs_mask=True``: its PARTIAL blocks are read from the bits).
    """

    words: torch.Tensor
    shape: tuple[int, int, int, int]
    summary: BlockMask

    @property
    def device(self) -> torch.device:
        return self.words.device

    def dim(self) -> int:
        return 4

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The mask's query rows ``[start, stop)`` (its one row if it broadcasts over queries) as bool."""
        words = self.words if self.shape[2] == 1 else self.words[:, :, start:stop]
        return unpack_rows(words, self.shape[3])

    def dense(self) -> torch.Tensor:
        """The whole mask as bool ``[Bm, Hm, Sqm, Skm]`` (for tests and small problems)."""
        return self.rows(0, self.shape[2])

    def __repr__(self) -> str:
        return f"BitMask(shape={self.shape}, words={tuple(self.words.shape)}, summary={self.summary!r})"
