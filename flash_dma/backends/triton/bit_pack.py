"""Dense masks packed into a BitMask on the GPU: words and block states in one read of the mask.

A per-pair mask ``[Bm, Hm, Sqm, Skm]`` as users pass it (a bool or 0/1 integer tensor, or an
additive float mask that holds the dtype's minimum, or -inf, where a pair is dropped: transformers'
eager masks, v1's ``create_mask(min_dtype=...)``) costs a byte or more per pair. One program per
block of ``block_q x block_k`` pairs reads its elements once and writes

- the block's words (``bit_mask.py``'s layout: key ``j`` of row ``i`` is bit ``j % 32`` of word
  ``j // 32``; rows padded to 128 keys with zero bits), and
- the block's state (EMPTY, PARTIAL or FULL), so that the summary needs no second read.

Everything else (the summary's lists) is 1/16 384 of the mask's pairs. Nothing synchronises with
the host; under ``torch.compile`` the pack is a custom op (``ops.pack_bits``).
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

# Mask elements loaded per step of a block: 64 rows of a bool mask read four keys an int32 (of 32,
# 64 and 128 rows, 64 measured fastest on an H100); a mask read a key an element takes as many
# elements in fewer rows (64 rows of 128 floats spilled 656 bytes).
_STEP_ELEMENTS = 64 * 32


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
    "stride_mb", "stride_mh", "stride_mk", "stride_wb", "stride_wh", "stride_sb", "stride_sh", "stride_sq",
    "seqlen_q", "columns", "num_heads", "key_blocks", "state_blocks", "width", "block_q", "lowest",
])
def _pack_bits_kernel(
    Mask, Words, State,
    stride_mb, stride_mh, stride_mq, stride_mk, stride_wb, stride_wh, stride_wq, stride_sb, stride_sh, stride_sq,
    seqlen_q, columns, num_heads, key_blocks, state_blocks, width, block_q, lowest,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, LANES: tl.constexpr, ADDITIVE: tl.constexpr,
    KEYS_CONTIGUOUS: tl.constexpr,
):
    """One block: its words, and its state if it is one of the summary's ``state_blocks`` columns
    (rows are padded to 128 keys, so with blocks of fewer keys the last programs only write zeros).

    The mask is read as ``columns`` elements per row of LANES keys each (``_kept_lanes``)."""
    COLUMNS: tl.constexpr = BLOCK_K // LANES  # loaded elements per row of the block
    WORDS: tl.constexpr = BLOCK_K // 32
    PER_WORD: tl.constexpr = 32 // LANES  # loaded elements per word
    ALL_LANES: tl.constexpr = (1 << LANES) - 1
    qb = tl.program_id(0) // key_blocks
    kb = tl.program_id(0) % key_blocks
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    words_base = Words + b.to(tl.int64) * stride_wb + h.to(tl.int64) * stride_wh
    cols = kb * COLUMNS + tl.arange(0, COLUMNS)  # [COLUMNS]
    col_ok = cols < columns
    if KEYS_CONTIGUOUS:
        col_offsets = cols
    else:
        col_offsets = cols.to(tl.int64) * stride_mk
    word_idx = kb * WORDS + tl.arange(0, WORDS)  # [WORDS]
    shift = LANES * tl.arange(0, PER_WORD)  # [PER_WORD]: where each element's lanes go in its word
    q_end = tl.minimum(qb * block_q + block_q, seqlen_q)
    any_kept = tl.zeros([ROWS, COLUMNS], dtype=tl.int32)
    all_kept = tl.full([ROWS, COLUMNS], ALL_LANES, dtype=tl.int32)
    for r in range(qb * block_q, q_end, ROWS):
        rows = r + tl.arange(0, ROWS)  # [ROWS]
        row_ok = rows < q_end
        inside = row_ok[:, None] & col_ok[None, :]  # [ROWS, COLUMNS]
        values = tl.load(mask_base + rows.to(tl.int64)[:, None] * stride_mq + col_offsets[None, :], mask=inside, other=0)
        kept = tl.where(inside, _kept_lanes(values, lowest, LANES, ADDITIVE), 0)  # [ROWS, COLUMNS]
        # Distinct bits: their sum is their OR (bit 31, the sign bit, wraps as it should).
        words = tl.sum(tl.reshape(kept, [ROWS, WORDS, PER_WORD]) << shift[None, None, :], axis=2)  # [ROWS, WORDS]
        tl.store(
            words_base + rows.to(tl.int64)[:, None] * stride_wq + word_idx[None, :], words,
            mask=row_ok[:, None] & (word_idx < width)[None, :],
        )
        any_kept |= kept
        all_kept &= tl.where(inside, kept, ALL_LANES)
    if kb < state_blocks:
        nonempty = (tl.max(tl.max(any_kept, 1), 0) > 0).to(tl.int32)
        full = (tl.min(tl.min(all_kept, 1), 0) == ALL_LANES).to(tl.int32)
        state = nonempty + nonempty * full  # EMPTY 0, PARTIAL 1, FULL 2
        tl.store(State + b.to(tl.int64) * stride_sb + h * stride_sh + qb * stride_sq + kb, state.to(tl.int8))


# Row strides specialised: rows that start on 16 bytes load and store as vectors.
pack_launcher = Launcher(_pack_bits_kernel, tensors=("Mask", "Words", "State"), specialized=("stride_mq", "stride_wq"))


def _bytes_as_words(mask: torch.Tensor) -> torch.Tensor | None:
    """A bool or 8-bit mask with contiguous keys viewed as int32, four keys an element (rows of a
    multiple of 4 keys, on 4 bytes), so that the kernel reads it in wide loads; else None."""
    if mask.element_size() != 1 or mask.shape[3] % 4 or mask.stride(3) != 1 or mask.storage_offset() % 4:
        return None
    if any(stride % 4 for stride in mask.stride()[:3]):
        return None
    return mask.view(torch.uint8).view(torch.int32)


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
        (tensor_layout(mask), block_q, block_k), tensors,
        lambda: (
            [*tensors, *view.stride(), *words.stride()[:3], *state.stride()[:3], sq, view.shape[3], nh, key_blocks,
             state_blocks, width, block_q, 0.0 if floor is None else floor, _STEP_ELEMENTS * lanes // block_k, block_k, lanes, floor is not None,
             contiguous],
            (),
        ),
        configs.single_program_config, lambda meta: (nqb * key_blocks, nb * nh),
    )
    return words, state
