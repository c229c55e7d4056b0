"""Dense masks packed into a BitMask on the GPU: words and block states in one read of the mask.

A per-pair mask ``[Bm, Hm, Sqm, Skm]`` as users pass it (a bool or 0/1 integer tensor, or an
additive float mask that holds the dtype's minimum, or -inf, where a pair is dropped: transformers'
eager masks, v1's ``create_mask(min_dtype=...)``) costs a byte or more per pair. The packer reads each
block of ``block_q x block_k`` pairs once and writes

- the block's words (``bit_mask.py``'s layout: key ``j`` of row ``i`` is bit ``j % 32`` of word
  ``j // 32``; rows padded to 128 keys with zero bits), and
- the block's state (EMPTY, PARTIAL or FULL), so that the summary needs no second read.

One program per block, its steps' loads in flight together. Everything else (the summary's lists)
is 1/16 384 of the mask's pairs. Nothing synchronises with the host; under ``torch.compile`` the
pack is a custom op (``ops.pack_bits``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import kernel_view, tensor_layout
from flash_dma.bit_mask import WORD_BITS, additive_floor, words_per_row
from flash_dma.block_mask import state_shape
from flash_dma.integers import cdiv

# Mask elements a step loads: 64 rows of a 128-key block of a bool mask read four keys an int32;
# a mask read a key an element takes as many elements in fewer rows (64 rows of 128 floats spilled
# 656 bytes).
_STEP_ELEMENTS = 64 * 32
# Steps staged through shared memory 3 deep (cp.async): fastest or tied of the walks in docs/design-notes.md, "Dense masks packed once".
_STAGES = 3


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
    "stride_mk", "stride_sb", "stride_sh", "stride_sq", "seqlen_q", "keys", "num_heads", "query_blocks", "key_blocks",
    "state_blocks", "block_q", "lowest",
])
def _pack_bits_kernel(
    Mask, Words, State,
    stride_mb, stride_mh, stride_mq, stride_mk, stride_wb, stride_wh, stride_wq, stride_sb, stride_sh, stride_sq,
    seqlen_q, columns, keys, num_heads, query_blocks, key_blocks, state_blocks, width, block_q, lowest,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, LANES: tl.constexpr, ADDITIVE: tl.constexpr,
    KEYS_CONTIGUOUS: tl.constexpr, STAGES: tl.constexpr,
):
    """One block: its words, and its state if it is one of the summary's ``state_blocks`` columns
    (rows are padded to 128 keys, so with blocks of fewer keys the last programs only write zeros).

    Blocks are numbered ``(batch x head, query block, key block)``, key blocks fastest. The mask
    is read as ``columns`` elements per row of LANES keys each (``_kept_lanes``), ROWS rows a
    step, STAGES steps' loads in flight (the compiler pipelines a loop without dots only where the
    loop itself asks for stages).
    """
    COLUMNS: tl.constexpr = BLOCK_K // LANES  # loaded elements per row of the block
    WORDS: tl.constexpr = BLOCK_K // 32
    PER_WORD: tl.constexpr = 32 // LANES  # loaded elements per word
    block = tl.program_id(0)
    kb = block % key_blocks
    qb = block // key_blocks % query_blocks
    bh = block // key_blocks // query_blocks
    b = bh // num_heads
    h = bh % num_heads
    mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    words_base = Words + b.to(tl.int64) * stride_wb + h.to(tl.int64) * stride_wh
    cols = kb * COLUMNS + tl.arange(0, COLUMNS)  # [COLUMNS]
    col_ok = cols < columns
    if KEYS_CONTIGUOUS:
        col_offsets = cols
    else:
        col_offsets = cols.to(tl.int64) * stride_mk
    word_idx = kb * WORDS + tl.arange(0, WORDS)  # [WORDS]
    word_ok = word_idx < width
    shift = LANES * tl.arange(0, PER_WORD)  # [PER_WORD]: where each element's lanes go in its word
    # Keys past the end count as kept when a block's words are tested for FULL.
    valid = tl.minimum(tl.maximum(keys - 32 * word_idx, 0), 32)  # [WORDS]: keys of each word
    padding = tl.where(valid == 32, 0, tl.full([WORDS], -1, tl.int32) << tl.minimum(valid, 31))
    q_end = tl.minimum(qb * block_q + block_q, seqlen_q)
    any_words = tl.zeros([ROWS, WORDS], dtype=tl.int32)
    all_words = tl.full([ROWS, WORDS], -1, dtype=tl.int32)
    for r in tl.range(qb * block_q, q_end, ROWS, num_stages=STAGES):
        rows = r + tl.arange(0, ROWS)  # [ROWS]
        row_ok = rows < q_end
        inside = row_ok[:, None] & col_ok[None, :]  # [ROWS, COLUMNS]
        values = tl.load(mask_base + rows.to(tl.int64)[:, None] * stride_mq + col_offsets[None, :], mask=inside, other=0)
        kept = _kept_lanes(values, lowest, LANES, ADDITIVE)  # [ROWS, COLUMNS]
        if ADDITIVE:
            kept = tl.where(inside, kept, 0)  # a masked-off element loads as 0.0, which an additive mask keeps
        # Distinct bits: their sum is their OR (bit 31, the sign bit, wraps as it should).
        words = tl.sum(tl.reshape(kept, [ROWS, WORDS, PER_WORD]) << shift[None, None, :], axis=2)  # [ROWS, WORDS]
        tl.store(words_base + rows.to(tl.int64)[:, None] * stride_wq + word_idx[None, :], words,
                 mask=row_ok[:, None] & word_ok[None, :])
        # The state from the words (1/8 of the loaded elements), rows past the block counting as kept.
        any_words |= words
        all_words &= tl.where(row_ok[:, None], words | padding[None, :], -1)
    if kb < state_blocks:
        nonempty = tl.max(tl.max((any_words != 0).to(tl.int32), 1), 0)
        full = tl.min(tl.min((all_words == -1).to(tl.int32), 1), 0)
        state = nonempty + nonempty * full  # EMPTY 0, PARTIAL 1, FULL 2
        tl.store(State + b.to(tl.int64) * stride_sb + h * stride_sh + qb * stride_sq + kb, state.to(tl.int8))


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


def step_rows(columns: int, block_q: int) -> int:
    """Rows a step loads: ``_STEP_ELEMENTS`` mask elements in rows of ``columns``, at most a block's rows."""
    return min(max(1, _STEP_ELEMENTS // columns), configs.next_power_of_2(block_q))


def pack_bits(mask: torch.Tensor, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words [Bm, Hm, Sqm, W] int32, state [Bm, Hm, NQB, NKB] int8)`` of ``mask`` ``[Bm, Hm, Sqm, Skm]``.

    ``mask``: bool or 0/1 integer (True or 1 = attend), or an additive float mask (a pair is
    dropped where it holds the dtype's minimum, -inf or NaN). Blocks of ``block_q x block_k``
    (``block_k`` a power of two >= 32); an axis of size 1 is one block.
    """
    nb, nh, sq, sk = mask.shape
    block_q = block_q if sq > 1 else 1
    _, _, nqb, state_blocks = shape = state_shape(mask.shape, block_q, block_k)
    width = words_per_row(sk)
    key_blocks = max(state_blocks, cdiv(width * WORD_BITS, block_k))
    words = torch.empty(nb, nh, sq, width, dtype=torch.int32, device=mask.device)
    state = torch.empty(shape, dtype=torch.int8, device=mask.device)
    floor = additive_floor(mask.dtype)
    wide = _bytes_as_words(mask)
    view = kernel_view(mask) if wide is None else wide
    lanes = sk // view.shape[3]
    contiguous = view.stride(3) == 1 or sk == 1
    tensors = [view, words, state]
    pack_launcher.launch(
        # The view's lanes depend on the mask's alignment, which its layout does not give.
        (tensor_layout(mask), block_q, block_k, lanes), tensors,
        lambda: (
            [*tensors, *view.stride(), *words.stride()[:3], *state.stride()[:3], sq, view.shape[3], sk, nh, nqb,
             key_blocks, state_blocks, width, block_q, 0.0 if floor is None else floor,
             step_rows(block_k // lanes, block_q), block_k, lanes, floor is not None, contiguous, _STAGES],
            (),
        ),
        lambda: [triton.Config({}, num_warps=4, num_stages=_STAGES)], lambda meta: (nb * nh * nqb * key_blocks,),
    )
    return words, state
