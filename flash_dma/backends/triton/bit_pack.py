"""Dense masks packed into a BitMask on the GPU: words and block states in one read of the mask.

A per-pair mask ``[Bm, Hm, Sqm, Skm]`` as users pass it (a bool or 0/1 integer tensor, or an
additive float mask that holds the dtype's minimum, or -inf, where a pair is dropped: transformers'
eager masks, v1's ``create_mask(min_dtype=...)``) costs a byte or more per pair. The packer reads each
block of ``block_q x block_k`` pairs once and writes

- the block's words (``bit_mask.py``'s layout: key ``j`` of row ``i`` is bit ``j % 32`` of word
  ``j // 32``; rows padded to 128 keys with zero bits), and
- the block's state (EMPTY, PARTIAL or FULL), so that the summary needs no second read.

How programs cover the blocks (one per block, or a few per multiprocessor walking many, with
their next loads in flight) is a :class:`Walk`. Everything else (the summary's lists) is
1/16 384 of the mask's pairs. Nothing synchronises with the host; under ``torch.compile`` the
pack is a custom op (``ops.pack_bits``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import kernel_view, tensor_layout
from flash_dma.bit_mask import WORD_BITS, additive_floor, words_per_row
from flash_dma.block_mask import state_shape
from flash_dma.integers import cdiv

# Mask elements a step loads (``Walk.step_elements``): 64 rows of a 128-key block of a bool mask
# read four keys an int32; a mask read a key an element takes as many elements in fewer rows (64
# rows of 128 floats spilled 656 bytes).
_STEP_ELEMENTS = 64 * 32
# TMA copies boxes of at most 256 elements a side.
_TMA_BOX = 256


class Walk(NamedTuple):
    """How the packer's programs cover a mask. The variants under measurement are :data:`WALKS`;
    :func:`pack_bits` takes ``WALKS[SHIPPED]``.

    A *tile* is ``block_q`` rows by ``blocks`` key blocks; a step loads ``step_elements`` mask
    elements of it (whole rows of the tile).
    """

    blocks: int  # key blocks per tile: each row of a step is ``blocks x block_k`` consecutive keys
    programs_per_sm: int  # 0: a program per tile; else that many per multiprocessor, each walking every P-th tile
    tma: bool  # steps copied by Hopper's copy engine through a tensor descriptor, where the mask's layout allows
    evict_first: bool  # loads hint L2 to drop the mask's lines first (read once); staged loads (cp.async) lose the hint
    step_elements: int
    num_warps: int
    num_stages: int  # > 1: the loop's loads pipelined through shared memory, that many steps deep


WALKS = {
    # A program per block, its steps one after the other.
    "blocks": Walk(1, 0, False, False, _STEP_ELEMENTS, 4, 1),
    # A program per block, all its steps' loads in flight at once (through shared memory, cp.async).
    "blocks-staged": Walk(1, 0, False, False, _STEP_ELEMENTS, 4, 3),
    # Four programs per multiprocessor (as many as surely fit: a program left to a second wave would
    # double the time), each walking blocks in one loop, three steps ahead (cp.async).
    "persistent": Walk(1, 4, False, False, _STEP_ELEMENTS, 4, 4),
    # Four programs per multiprocessor walking blocks, three steps ahead, copied by TMA.
    "persistent-tma": Walk(1, 4, True, False, _STEP_ELEMENTS, 4, 4),
}
SHIPPED = "blocks"


@triton.jit
def _kept_lanes(values, lowest, LANES: tl.constexpr, ADDITIVE: tl.constexpr):
    """Loaded mask elements -> int32 whose bit ``l`` says whether the element's lane ``l`` is kept.

    With LANES 4 each element is four bool bytes read as one int32 (byte ``l`` at bit ``8 l``,
    each 0 or 1: the bits never carry); otherwise one mask element per lane (``bit_mask.kept_pairs``: for an additive
    mask NaN, -inf and the dtype's minimum drop the pair).
    """
    if LANES == 4:
        # Byte l's bit moves to bit 24 + l; the cross terms land below bit 24 or past bit 31.
        kept = (values * 0x01020408) >> 24
    elif ADDITIVE:
        kept = (values.to(tl.float32) > lowest).to(tl.int32)
    else:
        kept = (values != 0).to(tl.int32)
    return kept


@triton.jit(do_not_specialize=[
    "stride_mk", "stride_sb", "stride_sh", "stride_sq", "seqlen_q", "keys", "num_heads", "query_blocks", "key_tiles",
    "state_blocks", "block_q", "tiles", "lowest",
])
def _pack_bits_kernel(
    Mask, Words, State,
    stride_mb, stride_mh, stride_mq, stride_mk, stride_wb, stride_wh, stride_wq, stride_sb, stride_sh, stride_sq,
    seqlen_q, columns, keys, num_heads, query_blocks, key_tiles, state_blocks, width, block_q, tiles, lowest,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr, ADDITIVE: tl.constexpr,
    KEYS_CONTIGUOUS: tl.constexpr, TMA: tl.constexpr, EVICT_FIRST: tl.constexpr, STAGES: tl.constexpr,
):
    """Tiles ``p, p + P, ...`` (``P`` programs): each tile's words, and its blocks' states where
    they are among the summary's ``state_blocks`` columns (rows are padded to 128 keys, so with
    blocks of fewer keys the last tiles only write zeros).

    One loop over every step of every tile, so that with STAGES > 1 the next steps' loads (the
    next tile's too) are in flight while this one's are packed: the compiler pipelines a loop
    without dots only where the loop itself asks for stages. The mask is read as ``columns``
    elements per row of LANES keys each (``_kept_lanes``); tiles are numbered ``(batch x head,
    query block, key tile)``, key tiles fastest.
    """
    COLUMNS: tl.constexpr = BLOCKS * BLOCK_K // LANES  # loaded elements per row of a tile
    WORDS: tl.constexpr = BLOCKS * BLOCK_K // 32
    BLOCK_WORDS: tl.constexpr = BLOCK_K // 32
    PER_WORD: tl.constexpr = 32 // LANES  # loaded elements per word
    first = tl.program_id(0)
    programs = tl.num_programs(0)
    steps = tl.cdiv(block_q, ROWS)
    if TMA:
        # The launch checks that the mask's rows, batch by batch and head by head, form one matrix.
        source = tl.make_tensor_descriptor(
            Mask, shape=[tiles // (query_blocks * key_tiles) * seqlen_q, columns], strides=[stride_mq, 1],
            block_shape=[ROWS, COLUMNS],
        )
    shift = LANES * tl.arange(0, PER_WORD)  # [PER_WORD]: where each element's lanes go in its word
    any_words = tl.zeros([ROWS, WORDS], dtype=tl.int32)
    all_words = tl.full([ROWS, WORDS], -1, dtype=tl.int32)
    for i in tl.range(tl.cdiv(tiles - first, programs) * steps, num_stages=STAGES):
        tile = first + i // steps * programs
        step = i % steps
        kt = tile % key_tiles
        qb = tile // key_tiles % query_blocks
        bh = tile // key_tiles // query_blocks
        b = bh // num_heads
        h = bh % num_heads
        r = qb * block_q + step * ROWS
        rows = r + tl.arange(0, ROWS)  # [ROWS]
        row_ok = rows < tl.minimum(qb * block_q + block_q, seqlen_q)
        cols = kt * COLUMNS + tl.arange(0, COLUMNS)  # [COLUMNS]
        inside = row_ok[:, None] & (cols < columns)[None, :]  # [ROWS, COLUMNS]
        if TMA:
            values = source.load([bh * seqlen_q + r, kt * COLUMNS])
        else:
            if KEYS_CONTIGUOUS:
                col_offsets = cols
            else:
                col_offsets = cols.to(tl.int64) * stride_mk
            pointers = (
                Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + rows.to(tl.int64)[:, None] * stride_mq
                + col_offsets[None, :]
            )
            if EVICT_FIRST:
                values = tl.load(pointers, mask=inside, other=0, eviction_policy="evict_first")
            else:
                values = tl.load(pointers, mask=inside, other=0)
        kept = _kept_lanes(values, lowest, LANES, ADDITIVE)  # [ROWS, COLUMNS]
        if ADDITIVE or TMA:
            # A masked-off additive element loads as 0.0 (kept); TMA copies whole boxes (the next block's rows).
            kept = tl.where(inside, kept, 0)
        # Distinct bits: their sum is their OR (bit 31, the sign bit, wraps as it should).
        words = tl.sum(tl.reshape(kept, [ROWS, WORDS, PER_WORD]) << shift[None, None, :], axis=2)  # [ROWS, WORDS]
        word_idx = kt * WORDS + tl.arange(0, WORDS)  # [WORDS]
        tl.store(
            Words + b.to(tl.int64) * stride_wb + h.to(tl.int64) * stride_wh + rows.to(tl.int64)[:, None] * stride_wq
            + word_idx[None, :], words, mask=row_ok[:, None] & (word_idx < width)[None, :],
        )
        # States from the words (1/8 of the loaded elements): a block is FULL where every word
        # holds its keys' bits, keys past the end and rows past the block counting as kept.
        valid = tl.minimum(tl.maximum(keys - 32 * word_idx, 0), 32)  # [WORDS]: keys of each word
        padding = tl.where(valid == 32, 0, tl.full([WORDS], -1, tl.int32) << tl.minimum(valid, 31))
        padded = tl.where(row_ok[:, None], words | padding[None, :], -1)
        any_words = tl.where(step == 0, words, any_words | words)
        all_words = tl.where(step == 0, padded, all_words & padded)
        if step == steps - 1:
            nonempty = tl.max(tl.max(tl.reshape(any_words != 0, [ROWS, BLOCKS, BLOCK_WORDS]).to(tl.int32), 2), 0)
            full = tl.min(tl.min(tl.reshape(all_words == -1, [ROWS, BLOCKS, BLOCK_WORDS]).to(tl.int32), 2), 0)
            state = nonempty + nonempty * full  # [BLOCKS]: EMPTY 0, PARTIAL 1, FULL 2
            kb = kt * BLOCKS + tl.arange(0, BLOCKS)
            tl.store(
                State + b.to(tl.int64) * stride_sb + h * stride_sh + qb * stride_sq + kb, state.to(tl.int8),
                mask=kb < state_blocks,
            )


# Specialised: the strides to a row and the row lengths that bound a step, so that rows that start
# on 16 bytes and whose bound is a multiple of 16 elements load and store as 16-byte vectors.
pack_launcher = Launcher(_pack_bits_kernel, tensors=("Mask", "Words", "State"), specialized=(
    "stride_mb", "stride_mh", "stride_mq", "stride_wb", "stride_wh", "stride_wq", "columns", "width",
))


def _bytes_as_words(mask: torch.Tensor) -> torch.Tensor | None:
    """A bool or 8-bit mask with contiguous keys viewed as int32, four keys an element (rows of a
    multiple of 4 keys, on 4 bytes), so that the kernel reads it in wide loads; else None."""
    if mask.element_size() != 1 or mask.shape[3] % 4 or mask.stride(3) != 1 or mask.storage_offset() % 4:
        return None
    if any(stride % 4 for stride in mask.stride()[:3]):
        return None
    return mask.view(torch.uint8).view(torch.int32)


def step_rows(walk: Walk, columns: int, block_q: int) -> int:
    """Rows a step loads: ``walk.step_elements`` mask elements in rows of ``columns``, at most a block's rows."""
    return min(max(1, walk.step_elements // columns), configs.next_power_of_2(block_q))


def copy_engine_reads(walk: Walk, view: torch.Tensor, columns: int, rows: int) -> bool:
    """Whether the kernel copies steps of ``rows x columns`` elements of the mask as the kernel
    reads it, ``view`` ``[Bm, Hm, Sqm, C]``, by TMA: where ``walk`` asks, on Hopper, with boxes
    TMA takes, and the view one matrix of ``Bm Hm Sqm`` rows (consecutive elements in a row, rows,
    heads and batches one after the other, 16-byte aligned)."""
    nb, nh, sq, _ = view.shape
    stride_b, stride_h, stride_q, stride_k = view.stride()
    return (
        walk.tma and configs.tma_enabled(view.device) and columns <= _TMA_BOX and rows <= _TMA_BOX
        and columns * view.element_size() % 16 == 0 and stride_k == 1 and (nh == 1 or stride_h == sq * stride_q)
        and (nb == 1 or stride_b == nh * sq * stride_q) and view.data_ptr() % 16 == 0
        and stride_q * view.element_size() % 16 == 0
    )


def pack_bits(mask: torch.Tensor, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words [Bm, Hm, Sqm, W] int32, state [Bm, Hm, NQB, NKB] int8)`` of ``mask`` ``[Bm, Hm, Sqm, Skm]``.

    ``mask``: bool or 0/1 integer (True or 1 = attend), or an additive float mask (a pair is
    dropped where it holds the dtype's minimum, -inf or NaN). Blocks of ``block_q x block_k``
    (``block_k`` a power of two >= 32); an axis of size 1 is one block.
    """
    return pack_bits_walking(mask, block_q, block_k, WALKS[SHIPPED])


def pack_bits_walking(mask: torch.Tensor, block_q: int, block_k: int, walk: Walk) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_bits` (same arguments, same ``words [Bm, Hm, Sqm, W]`` and ``state [Bm, Hm, NQB,
    NKB]``) with its programs laid out as ``walk`` says."""
    nb, nh, sq, sk = mask.shape
    block_q = block_q if sq > 1 else 1
    _, _, nqb, state_blocks = shape = state_shape(mask.shape, block_q, block_k)
    width = words_per_row(sk)
    key_tiles = cdiv(max(state_blocks, cdiv(width * WORD_BITS, block_k)), walk.blocks)
    tiles = nb * nh * nqb * key_tiles
    words = torch.empty(nb, nh, sq, width, dtype=torch.int32, device=mask.device)
    state = torch.empty(shape, dtype=torch.int8, device=mask.device)
    floor = additive_floor(mask.dtype)
    wide = _bytes_as_words(mask)
    view = kernel_view(mask) if wide is None else wide
    lanes = sk // view.shape[3]
    tile_columns = walk.blocks * block_k // lanes  # elements of a tile's row
    rows = step_rows(walk, tile_columns, block_q)
    tma = copy_engine_reads(walk, view, tile_columns, rows)
    contiguous = view.stride(3) == 1 or sk == 1
    programs = tiles
    if walk.programs_per_sm:
        programs = min(tiles, walk.programs_per_sm * configs.multiprocessor_count(mask.device))
    tensors = [view, words, state]
    pack_launcher.launch(
        # The view's lanes and the copy engine depend on the mask's alignment, which its layout does not give.
        (tensor_layout(mask), block_q, block_k, walk, lanes, tma), tensors,
        lambda: (
            [*tensors, *view.stride(), *words.stride()[:3], *state.stride()[:3], sq, view.shape[3], sk, nh, nqb,
             key_tiles, state_blocks, width, block_q, tiles, 0.0 if floor is None else floor,
             rows, block_k, walk.blocks, lanes, floor is not None, contiguous, tma, walk.evict_first, walk.num_stages],
            walk,
        ),
        lambda: [triton.Config({}, num_warps=walk.num_warps, num_stages=walk.num_stages)], lambda meta: (programs,),
    )
    return words, state
