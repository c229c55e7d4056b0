"""v1's ``create_mask``, with the arguments of both of its published signatures."""

from __future__ import annotations

import torch

from flash_dma import masks
from flash_dma.inputs import check_choice


def create_mask(
    attention_bias: torch.Tensor,
    query_len: int | None = None,
    type: str = "topk",  # v1's name; this function only passes it on, so the builtin is not needed
    attention_mask: torch.Tensor | None = None,
    window_size: int | None = None,
    min_dtype: float | None = None,
    block_size: int | None = None,
    *,
    batch_size: int | None = None,
    key_len: int | None = None,
) -> torch.Tensor:
    """:func:`flash_dma.masks.create_mask` under v1's calling conventions.

    Positional arguments follow v1's last signature ``(attention_bias, query_len, type,
    attention_mask, window_size, min_dtype, block_size)``; the earlier keywords ``batch_size`` and
    ``key_len`` are accepted too. What is not given is inferred as v1 did (by the native
    ``create_mask``): ``batch_size`` from the padding mask (else the bias), ``key_len`` and
    ``query_len`` from the bias.

    Args:
        attention_bias: ``[1|B, 1|Hkv|H, 1|Sq, Sk]`` float.
        query_len: Sq.
        type: ``"topk"`` or ``"relu"``.
        attention_mask: None, a padding mask ``[B, Sk]`` (or ``[B, Sq]``), or a 4-D mask.
        window_size: keys kept per row with ``type="topk"``.
        min_dtype: keys whose bias is ``<= min_dtype`` count as masked.
        block_size: keep or drop whole runs of ``block_size`` keys.
        batch_size: B.
        key_len: Sk.

    Returns:
        bool, the broadcast shape of the bias and the mask; True = attend.
    """
    check_choice("type", type, masks.MASK_KINDS)  # errors name the caller's argument
    return masks.create_mask(
        attention_bias,
        attention_mask,
        batch_size,
        query_len,
        key_len,
        window_size,
        min_dtype=min_dtype,
        block_size=block_size,
        kind=type,
    )
