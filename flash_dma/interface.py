"""The public attention functions. ``docs/api.md`` is the contract they implement."""

from __future__ import annotations

import functools

import torch

from flash_dma.backends import BACKENDS, resolve_backend
from flash_dma.block_mask import BlockMask
from flash_dma.inputs import UNBOUNDED, normalize_inputs


def flash_dma_func(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0,  # an int: torch.compile(dynamic=True) makes float defaults symbolic and retraces
    block_mask: BlockMask | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Dynamic-mask attention with a trainable additive bias.

    ``s = softcap_fn(softmax_scale * q @ k^T) + attn_bias``, restricted to the keys that the
    mask, the causal rule and the window leave visible, then ``out = softmax(s) @ v``.
    Tiles of the attention matrix whose mask is all false are skipped.

    Args:
        query: ``[B, Sq, H, D]``, float16, bfloat16 or float32; D from 1 to 256.
        key: ``[B, Sk, Hkv, D]``, same dtype and device; ``H % Hkv == 0`` (GQA/MQA).
        value: ``[B, Sk, Hkv, D]``.
        attn_mask: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` bool (True = attend) or 0/1 integer, or None.
            A head dimension of Hkv is shared by the query heads of each group.
        attn_bias: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` float32 or ``query.dtype``, or None. It receives a
            gradient of its own shape (summed over its broadcast dimensions).
        softmax_scale: multiplies ``q @ k^T``; defaults to ``D ** -0.5``.
        is_causal: key j is visible to query i iff ``j <= i + Sk - Sq`` (bottom-right aligned).
        window_size: ``(left, right)``: query i sees keys ``i + Sk - Sq - left`` to
            ``i + Sk - Sq + right``; -1 means unbounded. With ``is_causal``, right is 0.
        softcap: when > 0, scores are ``softcap * tanh(x / softcap)`` before the bias is added.
        block_mask: a :class:`BlockMask` of ``attn_mask`` (from :func:`build_block_mask`), or a
            block-level mask on its own (from :func:`flash_dma.masks.topk_block_mask`). Reuse one
            across layers and calls; without it the Triton backend builds one per call.
        deterministic: make the gradients bitwise reproducible.
        return_lse: also return the log-sum-exp of the scores.
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, reference elsewhere).

    Returns:
        ``out`` ``[B, Sq, H, D]`` in ``query.dtype``; with ``return_lse`` also ``lse`` ``[B, H, Sq]``
        float32 (natural log, not differentiable). A query row with no visible key gets
        ``out = 0``, ``lse = -inf`` and zero gradients.
    """
    problem = normalize_inputs(
        query,
        key,
        value,
        attn_mask,
        attn_bias,
        softmax_scale=softmax_scale,
        is_causal=is_causal,
        window_size=window_size,
        softcap=softcap,
        block_mask=block_mask,
        deterministic=deterministic,
    )
    implementation = resolve_backend(backend, query.device)
    if query.numel() == 0 or key.shape[1] == 0:
        # Empty problems have nothing to launch; the reference handles them with autograd intact.
        implementation = resolve_backend("reference", query.device)
    out, lse = implementation.attention(problem)
    return (out, lse) if return_lse else out


def flash_dma_func_auto(backend: str | None = None):
    """``flash_dma_func`` with ``backend`` fixed; None picks the best backend per call's device."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))} or None, got {backend!r}")
    return functools.partial(flash_dma_func, backend=backend)


def flash_dmattn_func(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    deterministic: bool | None = None,
    return_attn_probs: bool | None = None,
):
    """Drop-in for the Flash-DMA / Flash-Sparse-Attention v1 entry point, with its argument order.

    Shapes are those of :func:`flash_dma_func`. Unlike v1, causal masking is bottom-right
    aligned, fully masked rows return 0, and softcap is the standard ``cap * tanh(x / cap)``.

    Returns:
        ``out`` ``[B, Sq, H, D]``; with ``return_attn_probs`` the tuple ``(out, lse, None)``:
        ``lse`` is ``[B, H, Sq]`` float32, and the probabilities are not materialised.
    """
    out, lse = flash_dma_func(
        query,
        key,
        value,
        attn_mask,
        attn_bias,
        softmax_scale=softmax_scale,
        is_causal=bool(is_causal),
        softcap=0.0 if softcap is None else softcap,
        deterministic=bool(deterministic),
        return_lse=True,
    )
    return (out, lse, None) if return_attn_probs else out


flash_sparse_attn_func = flash_dmattn_func
