"""Top-k index attention inputs: each query attends the keys listed for it (DeepSeek's DSA form).

``indices`` ``[B, Sq, Hkv, W]`` int32 lists, per query and key/value head, the keys its group of
query heads attends; the rules of ``docs/api.md`` ("flash_dma_topk_func") decide which entries
count. :func:`normalize_topk_inputs` turns the arguments into a :class:`TopkProblem` that every
backend can trust, or raises a ``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dma.inputs import _check_qkv, _last_dim_contiguous, check_bias_tensor, normalize_settings


@dataclass(frozen=True)
class TopkProblem:
    """One top-k index attention call, validated. ``window`` folds ``is_causal`` in."""

    query: torch.Tensor  # [B, Sq, H, D]
    key: torch.Tensor  # [B, Sk, Hkv, D]
    value: torch.Tensor  # [B, Sk, Hkv, D]
    indices: torch.Tensor  # [B, Sq, Hkv, W] int32
    attn_bias: torch.Tensor | None  # per pair [1|B, Sq, 1|Hkv|H, W] or per key [1|B, 1|Hkv|H, Sk]
    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    deterministic: bool


def _check_indices(indices, query, key) -> None:
    batch, seqlen_q, _, _ = query.shape
    num_kv_heads = key.shape[2]
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices: expected dtype torch.int32, got {indices.dtype}")
    if indices.device != query.device:
        raise ValueError(f"indices: expected device {query.device} (the device of query), got {indices.device}")
    if indices.dim() != 4 or tuple(indices.shape[:3]) != (batch, seqlen_q, num_kv_heads):
        raise ValueError(
            f"indices: expected shape [B, Sq, Hkv, W] = [{batch}, {seqlen_q}, {num_kv_heads}, W], "
            f"got {tuple(indices.shape)}"
        )


def _check_topk_bias(bias, query, key, indices) -> None:
    batch, seqlen_q, num_heads, _ = query.shape
    seqlen_k, num_kv_heads = key.shape[1], key.shape[2]
    check_bias_tensor(bias, query)
    heads = (1, num_kv_heads, num_heads)
    width = indices.shape[3]
    per_pair = bias.dim() == 4 and bias.shape[0] in (1, batch) and bias.shape[1] == seqlen_q
    per_pair = per_pair and bias.shape[2] in heads and bias.shape[3] == width
    per_key = bias.dim() == 3 and bias.shape[0] in (1, batch) and bias.shape[1] in heads and bias.shape[2] == seqlen_k
    if not (per_pair or per_key):
        raise ValueError(
            f"attn_bias: expected per pair [1|B, Sq, 1|Hkv|H, W] = [1|{batch}, {seqlen_q}, 1|{num_kv_heads}|{num_heads}, "
            f"{width}] or per key [1|B, 1|Hkv|H, Sk] = [1|{batch}, 1|{num_kv_heads}|{num_heads}, {seqlen_k}], "
            f"got shape {tuple(bias.shape)}"
        )


def normalize_topk_inputs(
    query, key, value, indices, attn_bias, *, softmax_scale, is_causal, window_size, softcap, deterministic
) -> TopkProblem:
    """Validate the arguments of :func:`flash_dma.flash_dma_topk_func`. Index values are not read
    (that would synchronise with the device): entries outside ``[0, Sk)`` count as none."""
    _check_qkv(query, key, value)
    _check_indices(indices, query, key)
    if attn_bias is not None:
        _check_topk_bias(attn_bias, query, key, indices)
    return TopkProblem(
        query=_last_dim_contiguous(query),
        key=_last_dim_contiguous(key),
        value=_last_dim_contiguous(value),
        indices=indices,
        attn_bias=attn_bias,
        **normalize_settings(query, softmax_scale, is_causal, window_size, softcap, deterministic),
    )
