"""The packed per-query mask of top-k indices, built on the GPU, for the passes of a top-k call
that walk it (``dispatch.topk_plan``).

:func:`topk_bit_mask` turns ``indices`` ``[B, Sq, Hkv, W]`` into the ``BitMask`` ``[B, Hkv, Sq, Sk]``
of the entries that count (in ``[0, Sk)`` and in the query's causal/window band, as the index
kernels count them), with no host synchronisation and no byte per pair:

- the words are zeroed, then one program per (query, batch x K/V head) ORs each counting entry's
  bit into its word by an atomic (a row's entries may share a word; a key listed twice sets one bit);
- one program per (query block, batch x K/V head, :data:`_KEY_BLOCKS` key blocks) reads the words
  once and writes the blocks' states (EMPTY, PARTIAL or FULL), from which the summary's lists follow.

The torch version (``flash_dma.masks.listed_bit_mask``) writes a bool per pair first: about 8x the
words' bytes, a chunk of rows at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import band, tensor_layout
from flash_dma.backends.triton.topk.tiles import counts_in_band
from flash_dma.bit_mask import BitMask, words_per_row
from flash_dma.block_mask import DEFAULT_BLOCK_SIZE
from flash_dma.integers import cdiv

_ENTRIES = 1024  # list entries a program reads per step
_KEY_BLOCKS = 16  # key blocks of 128 keys per state program: a [128, 64] tile of words


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_kv_heads", "width", "band_lo", "band_hi"])
def _topk_bits_kernel(
    Indices, Words,
    stride_ib, stride_is, stride_ih, stride_iw, stride_wb, stride_wh, stride_wq,
    seqlen_q, seqlen_k, num_kv_heads, width, band_lo, band_hi,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    b = (tl.program_id(1) // num_kv_heads).to(tl.int64)
    h = (tl.program_id(1) % num_kv_heads).to(tl.int64)
    index_row = Indices + b * stride_ib + i * stride_is + h * stride_ih
    word_row = Words + b * stride_wb + h * stride_wh + i * stride_wq
    for w0 in range(0, width, BLOCK_W):
        slots = w0 + tl.arange(0, BLOCK_W)
        keys = tl.load(index_row + slots.to(tl.int64) * stride_iw, mask=slots < width, other=-1)
        valid = counts_in_band(keys, i, seqlen_q, seqlen_k, band_lo, band_hi)
        # Bit 31 is the sign bit: 1 << 31 wraps to it in int32, as the layout wants.
        tl.atomic_or(word_row + (keys >> 5), 1 << (keys & 31), mask=valid, sem="relaxed")


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_kv_heads", "key_blocks"])
def _bit_states_kernel(
    Words, State,
    stride_wb, stride_wh, stride_wq, stride_sb, stride_sh, stride_sq,
    seqlen_q, seqlen_k, num_kv_heads, key_blocks,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, KEY_BLOCKS: tl.constexpr,
):
    WORDS: tl.constexpr = BLOCK_K // 32
    qb = tl.program_id(0)
    b = (tl.program_id(1) // num_kv_heads).to(tl.int64)
    h = (tl.program_id(1) % num_kv_heads).to(tl.int64)
    first_block = tl.program_id(2) * KEY_BLOCKS
    rows = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    row_ok = rows < seqlen_q
    word_idx = first_block * WORDS + tl.arange(0, KEY_BLOCKS * WORDS)  # [KEY_BLOCKS * WORDS]
    word_ok = word_idx < key_blocks * WORDS
    words = tl.load(
        Words + b * stride_wb + h * stride_wh + rows.to(tl.int64)[:, None] * stride_wq + word_idx[None, :],
        mask=row_ok[:, None] & word_ok[None, :], other=0,
    )
    # A word's bits of keys past Sk (and rows past Sq) count as set for FULL and as clear for "any".
    keys_in_word = tl.minimum(tl.maximum(seqlen_k - word_idx * 32, 0), 32)
    in_range = tl.where(keys_in_word == 32, -1, (1 << tl.minimum(keys_in_word, 31)) - 1)
    set_or_outside = ((words | ~in_range[None, :]) == -1) | (~row_ok[:, None])
    any_set = tl.max(tl.max(tl.reshape((words != 0).to(tl.int32), [BLOCK_Q, KEY_BLOCKS, WORDS]), 2), 0)  # [KEY_BLOCKS]
    all_set = tl.min(tl.min(tl.reshape(set_or_outside.to(tl.int32), [BLOCK_Q, KEY_BLOCKS, WORDS]), 2), 0)
    state = any_set + any_set * all_set  # EMPTY 0, PARTIAL 1, FULL 2
    blocks = first_block + tl.arange(0, KEY_BLOCKS)
    tl.store(State + b * stride_sb + h * stride_sh + qb * stride_sq + blocks, state.to(tl.int8), mask=blocks < key_blocks)


_BITS_LAUNCHER = Launcher(
    _topk_bits_kernel, tensors=("Indices", "Words"),
    specialized=("stride_ib", "stride_is", "stride_ih", "stride_iw", "stride_wb", "stride_wh", "stride_wq"),
)
_STATES_LAUNCHER = Launcher(
    _bit_states_kernel, tensors=("Words", "State"),
    specialized=("stride_wb", "stride_wh", "stride_wq", "stride_sb", "stride_sh", "stride_sq"),
)


def _words_and_states(
    indices: torch.Tensor, seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words [B, Hkv, Sq, W] int32, state [B, Hkv, NQB, NKB] int8)`` of :func:`topk_bit_mask`."""
    batch, _, num_kv_heads, width = indices.shape
    block_q, block_k = DEFAULT_BLOCK_SIZE
    words = torch.zeros(batch, num_kv_heads, seqlen_q, words_per_row(seqlen_k), dtype=torch.int32, device=indices.device)
    band_lo, band_hi = band(window_left, window_right, seqlen_q, seqlen_k)
    if width > 0 and seqlen_q > 0:
        tensors = [indices, words]
        _BITS_LAUNCHER.launch(
            (tensor_layout(indices), words.shape, seqlen_k, band_lo, band_hi), tensors,
            lambda: ([*tensors, *indices.stride(), *words.stride()[:3], seqlen_q, seqlen_k, num_kv_heads, width, band_lo,
                      band_hi, _ENTRIES], ()),
            configs.single_program_config, lambda meta: (seqlen_q, batch * num_kv_heads),
        )
    query_blocks, key_blocks = cdiv(seqlen_q, block_q), cdiv(seqlen_k, block_k)
    state = torch.empty(batch, num_kv_heads, query_blocks, key_blocks, dtype=torch.int8, device=indices.device)
    if state.numel() > 0:
        tensors = [words, state]
        _STATES_LAUNCHER.launch(
            (words.shape, seqlen_k), tensors,
            lambda: ([*tensors, *words.stride()[:3], *state.stride()[:3], seqlen_q, seqlen_k, num_kv_heads, key_blocks,
                      block_q, block_k, _KEY_BLOCKS], ()),
            configs.single_program_config, lambda meta: (query_blocks, batch * num_kv_heads, cdiv(key_blocks, _KEY_BLOCKS)),
        )
    return words, state


_words_and_states_op = torch.library.custom_op("flash_dma::topk_bits", _words_and_states, mutates_args=())


@_words_and_states_op.register_fake
def _words_and_states_fake(indices, seqlen_q, seqlen_k, window_left, window_right):
    batch, _, num_kv_heads, _ = indices.shape
    words = indices.new_empty(batch, num_kv_heads, seqlen_q, words_per_row(seqlen_k))
    blocks = (cdiv(seqlen_q, DEFAULT_BLOCK_SIZE[0]), cdiv(seqlen_k, DEFAULT_BLOCK_SIZE[1]))
    return words, indices.new_empty(batch, num_kv_heads, *blocks, dtype=torch.int8)


def topk_bit_mask(indices: torch.Tensor, seqlen_q: int, seqlen_k: int, window: tuple[int, int]) -> BitMask:
    """The ``BitMask`` ``[B, Hkv, Sq, Sk]`` (summary blocks of 128 x 128) of top-k ``indices``
    ``[B, Sq, Hkv, W]`` int32: the entries in ``[0, Sk)`` and inside ``window`` (``(left, right)``,
    -1 unbounded, bottom-right aligned). Its words cost ``Sk / 8`` bytes per query and K/V head.
    Through a custom op when compiling."""
    # Imported here: flash_dma.summaries imports this package's ops, so a top-level import would
    # make importing flash_dma.summaries first a cycle.
    from flash_dma.summaries import block_mask_from_state

    build = _words_and_states_op if torch.compiler.is_compiling() else _words_and_states
    words, state = build(indices, seqlen_q, seqlen_k, *window)
    shape = (indices.shape[0], indices.shape[2], seqlen_q, seqlen_k)
    return BitMask(words=words, shape=shape, summary=block_mask_from_state(state, shape, DEFAULT_BLOCK_SIZE, True))
