"""Building the summaries the kernels walk: block summaries (:class:`BlockMask`) and bit masks
(:class:`BitMask`) from an element-wise mask, a bool tensor or block states.

On a CUDA device the block states and their lists come from the Triton kernels of
``backends/triton/block_summary.py`` (no host synchronisation: a summary can be built inside a
CUDA graph, and under ``torch.compile`` each step is a custom op); elsewhere from the plain-torch
versions in ``block_mask.py``. Bits are packed, with their block states, by one Triton kernel on a
CUDA device (``backends/triton/bit_pack.py``), with torch elsewhere (``bit_mask.py``).
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.ops import packed_bits, summary_lists, summary_state
from flash_dma.bit_mask import WORD_BITS, BitMask, block_states, pack_mask_words
from flash_dma.block_mask import (
    DEFAULT_BLOCK_SIZE,
    PARTIAL,
    BlockMask,
    block_lists,
    check_block_size,
    state_shape,
    summarize_mask,
)
from flash_dma.packed import packed_rows

def block_mask_from_state(
    state: torch.Tensor,
    mask_shape: tuple[int, int, int, int],
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    needs_mask: bool | None = None,
) -> BlockMask:
    """A summary from per-block states ``[Bm, Hm, NQB, NKB]`` (EMPTY/PARTIAL/FULL) of a mask of
    shape ``mask_shape`` cut into blocks of ``block_size`` (an axis of size 1 is one block).

    ``needs_mask``: whether PARTIAL blocks may occur (then the element-wise mask goes with the
    summary); None reads it off the states, which synchronises with the device once.
    """
    check_block_size(block_size)
    expected = state_shape(mask_shape, *block_size)
    if tuple(state.shape) != expected:
        raise ValueError(
            f"state: expected shape {expected} for a mask of shape {tuple(mask_shape)} in blocks of "
            f"{tuple(block_size)}, got {tuple(state.shape)}"
        )
    state = state.to(torch.int8)
    if needs_mask is None:
        needs_mask = bool((state == PARTIAL).any())
    if state.is_cuda:
        kv_lists, q_lists = summary_lists(state, False), summary_lists(state, True)
    else:
        kv_lists, q_lists = block_lists(state), block_lists(state.transpose(-1, -2))
    return BlockMask(
        state=state,
        kv_lists=kv_lists,
        q_lists=q_lists,
        mask_shape=tuple(int(s) for s in mask_shape),
        block_size=tuple(block_size),
        needs_mask=needs_mask,
    )


def _check_mask_tensor(attn_mask, floats: bool = False) -> None:
    """A 4-D bool or integer mask (or, with ``floats``, an additive float one)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dim() != 4:
        raise ValueError(
            f"attn_mask: expected a 4-D mask [1|B, 1|Hkv|H, 1|Sq, 1|Sk], got shape {tuple(attn_mask.shape)}"
        )
    if attn_mask.dtype.is_complex or (attn_mask.dtype.is_floating_point and not floats):
        kinds = "a bool, 0/1 integer or additive float" if floats else "a bool or 0/1 integer"
        raise TypeError(f"attn_mask: expected {kinds} tensor, got {attn_mask.dtype}")


def build_block_mask(
    attn_mask: torch.Tensor,
    *,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> BlockMask:
    """Summarise a boolean mask into a reusable :class:`BlockMask`.

    Args:
        attn_mask: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` bool (True = attend) or 0/1 integer mask.
        block_size: ``(block_q, block_k)``, each a power of two from 16 to 256. The kernels' tiles
            divide the blocks, so smaller blocks skip finer but cost longer lists.
        cu_seqlens_k, max_seqlen_k: packed sequences (``flash_dma_varlen_func``): then
            ``attn_mask`` is per key, packed ``[1|Hkv|H, total_k]`` or per sequence ``[1|N,
            1|Hkv|H, 1|max_seqlen_k]``, and the summary has one entry per sequence.

    Returns:
        A :class:`BlockMask` on the mask's device. The mask is read once and no ``[Sq, Sk]``
        temporary is made; on a CUDA device it takes three kernel launches and no host
        synchronisation, so it can run inside a CUDA graph.
    """
    if cu_seqlens_k is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a torch.Tensor, got {type(attn_mask).__name__}")
        attn_mask, _ = packed_rows("attn_mask", attn_mask, cu_seqlens_k, max_seqlen_k, False)
    _check_mask_tensor(attn_mask)
    check_block_size(block_size)
    state = summary_state(attn_mask, *block_size) if attn_mask.is_cuda else summarize_mask(attn_mask, *block_size)
    return block_mask_from_state(state, tuple(attn_mask.shape), block_size, needs_mask=True)


def check_bit_block_size(block_size) -> None:
    """A bit mask's key blocks hold whole 32-bit words."""
    check_block_size(block_size)
    if block_size[1] < WORD_BITS:
        raise ValueError(f"block_size: a bit mask needs key blocks of at least {WORD_BITS} keys, got {tuple(block_size)}")


def bit_mask_from_words(words: torch.Tensor, shape: tuple[int, int, int, int], block_size=DEFAULT_BLOCK_SIZE) -> BitMask:
    """A :class:`BitMask` of packed ``words`` ``[Bm, Hm, Sqm, W]`` holding a mask of ``shape``,
    with its summary read from the words (no host synchronisation)."""
    check_bit_block_size(block_size)
    state = block_states(words, shape, block_size)
    return BitMask(words=words, shape=tuple(int(s) for s in shape), summary=block_mask_from_state(state, shape, block_size, True))


def pack_mask(attn_mask: torch.Tensor, *, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> BitMask:
    """Pack a mask into a :class:`BitMask`: one bit per element, with its block summary.

    Args:
        attn_mask: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` bool (True = attend) or 0/1 integer; or an
            additive float mask (SDPA's and transformers' eager form), whose pairs at or below the
            dtype's minimum (or -inf, or NaN) are dropped. Pass an additive mask as ``attn_bias``
            too for the values it adds: the bits only say which pairs are kept.
        block_size: ``(block_q, block_k)`` of the summary; ``block_k >= 32``.

    Returns:
        A :class:`BitMask` on the mask's device, its words 1/8 of a bool mask's bytes. The mask
        is read once (on a CUDA device by one kernel that writes the words and the block states
        together, at memory speed); nothing synchronises with the host.
    """
    _check_mask_tensor(attn_mask, floats=True)
    check_bit_block_size(block_size)
    shape = tuple(attn_mask.shape)
    if not attn_mask.is_cuda:
        return bit_mask_from_words(pack_mask_words(attn_mask), shape, block_size)
    words, state = packed_bits(attn_mask, *block_size)
    return BitMask(words=words, shape=shape, summary=block_mask_from_state(state, shape, block_size, True))
