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

_ROWS = 32  # query rows read per step of a block: [32, block_k] elements, 32 bytes a thread at block_k 128


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit(do_not_specialize=[
    "stride_mb", "stride_mh", "stride_mq", "stride_mk", "stride_wb", "stride_wh", "stride_wq",
    "stride_sb", "stride_sh", "stride_sq", "seqlen_q", "seqlen_k", "num_heads", "key_blocks", "state_blocks",
    "width", "block_q", "lowest",
])
def _pack_bits_kernel(
    Mask, Words, State,
    stride_mb, stride_mh, stride_mq, stride_mk, stride_wb, stride_wh, stride_wq, stride_sb, stride_sh, stride_sq,
    seqlen_q, seqlen_k, num_heads, key_blocks, state_blocks, width, block_q, lowest,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ADDITIVE: tl.constexpr, KEYS_CONTIGUOUS: tl.constexpr,
):
    """One block: its words, and its state if it is one of the summary's ``state_blocks`` columns
    (rows are padded to 128 keys, so with blocks of fewer keys the last programs only write zeros)."""
    WORDS: tl.constexpr = BLOCK_K // 32
    qb = tl.program_id(0) // key_blocks
    kb = tl.program_id(0) % key_blocks
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    words_base = Words + b.to(tl.int64) * stride_wb + h.to(tl.int64) * stride_wh
    keys = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    key_ok = keys < seqlen_k
    if KEYS_CONTIGUOUS:
        key_offsets = keys
    else:
        key_offsets = keys.to(tl.int64) * stride_mk
    word_idx = kb * WORDS + tl.arange(0, WORDS)  # [WORDS]
    bit = 1 << tl.arange(0, 32)  # [32] int32; bit 31 is the sign bit
    q_end = tl.minimum(qb * block_q + block_q, seqlen_q)
    any_kept = 0
    all_kept = 1
    for r in range(qb * block_q, q_end, ROWS):
        rows = r + tl.arange(0, ROWS)  # [ROWS]
        row_ok = rows < q_end
        inside = row_ok[:, None] & key_ok[None, :]  # [ROWS, BLOCK_K]
        values = tl.load(mask_base + rows.to(tl.int64)[:, None] * stride_mq + key_offsets[None, :], mask=inside, other=0)
        if ADDITIVE:
            kept = values.to(tl.float32) > lowest  # bit_mask.kept_pairs: NaN, -inf and the dtype's minimum drop the pair
        else:
            kept = values != 0
        kept = kept & inside
        split = tl.reshape(kept.to(tl.int32), [ROWS, WORDS, 32]) * bit[None, None, :]  # [ROWS, WORDS, 32]
        words = tl.reduce(split, 2, _bitwise_or)  # [ROWS, WORDS]
        tl.store(
            words_base + rows.to(tl.int64)[:, None] * stride_wq + word_idx[None, :], words,
            mask=row_ok[:, None] & (word_idx < width)[None, :],
        )
        any_kept = tl.maximum(any_kept, tl.max(tl.max(kept.to(tl.int32), 1), 0))
        all_kept = tl.minimum(all_kept, tl.min(tl.min(tl.where(inside, kept, True).to(tl.int32), 1), 0))
    if kb < state_blocks:
        state = any_kept + any_kept * all_kept  # EMPTY 0, PARTIAL 1, FULL 2
        tl.store(State + b.to(tl.int64) * stride_sb + h * stride_sh + qb * stride_sq + kb, state.to(tl.int8))


pack_launcher = Launcher(_pack_bits_kernel, tensors=("Mask", "Words", "State"), specialized=())


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
    view = kernel_view(mask)
    contiguous = mask.stride(3) == 1 or sk == 1
    tensors = [view, words, state]
    pack_launcher.launch(
        (tensor_layout(mask), block_q, block_k), tensors,
        lambda: (
            [*tensors, *mask.stride(), *words.stride()[:3], *state.stride()[:3], sq, sk, nh, key_blocks, state_blocks,
             width, block_q, 0.0 if floor is None else floor, _ROWS, block_k, floor is not None, contiguous],
            (),
        ),
        configs.single_program_config, lambda meta: (nqb * key_blocks, nb * nh),
    )
    return words, state
