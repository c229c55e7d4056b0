"""Top-k index attention inputs: each query attends the keys listed for it (DeepSeek's DSA form).

``indices`` ``[B, Sq, Hkv, W]`` int32 lists, per query and key/value head, the keys its group of
query heads attends; the rules of ``docs/api.md`` ("flash_dma_topk_func") decide which entries
count. :func:`normalize_topk_inputs` turns the arguments into a :class:`TopkProblem` that every
backend can trust, or raises a ``TypeError``/``ValueError`` naming the argument.
:func:`as_mask_problem` states the same call as a ``flash_dma_func`` problem over the packed
per-query mask, which the dense kernels walk faster where the lists cover much of the causal band
(the Triton backend chooses per pass: ``dispatch.topk_plan``, ``docs/api.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dma.backends.reference import valid_indices
from flash_dma.bit_mask import BitMask
from flash_dma.inputs import (
    AttentionProblem,
    _check_qkv,
    _last_dim_contiguous,
    check_bias_tensor,
    normalize_settings,
    sizes_allowed,
)
from flash_dma.masks import listed_bit_mask

# A key listed several times weighs as the sum of its entries' exp(bias - max), each in (0, 1]:
# summed as integers in units of 2**-40, which add exactly in any order (CUDA's scatter_add fixes
# none), so the sum is bitwise reproducible. The unit is far below float32's resolution of the log
# taken after, and int64 holds 2**23 entries of one key.
_ENTRY_SUM_UNIT = 2.0**-40
# Elements of the [B, Hd, rows, Sk] plane made at a time: bounds the temporaries (a max and a sum each).
_PLANE_CHUNK_ELEMENTS = 1 << 24


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
    unique_indices: bool  # the caller's word that no key counts twice in one list (no plane needed)


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
            f"attn_bias: expected per pair [1|B, Sq, 1|Hkv|H, W] = [{sizes_allowed(1, batch)}, {seqlen_q}, {sizes_allowed(*heads)}, "
            f"{width}] or per key [1|B, 1|Hkv|H, Sk] = [{sizes_allowed(1, batch)}, {sizes_allowed(*heads)}, {seqlen_k}], "
            f"got shape {tuple(bias.shape)}"
        )


def normalize_topk_inputs(
    query, key, value, indices, attn_bias, *, softmax_scale, is_causal, window_size, softcap, deterministic,
    unique_indices=False,
) -> TopkProblem:
    """Validate the arguments of :func:`flash_dma.flash_dma_topk_func`. Index values are not read
    (that would synchronise with the device): entries outside ``[0, Sk)`` count as none, and
    ``unique_indices`` is taken at its word."""
    _check_qkv(query, key, value)
    _check_indices(indices, query, key)
    if attn_bias is not None:
        _check_topk_bias(attn_bias, query, key, indices)
    if not isinstance(unique_indices, bool):
        raise TypeError(f"unique_indices: expected a bool, got {type(unique_indices).__name__} {unique_indices!r}")
    return TopkProblem(
        query=_last_dim_contiguous(query),
        key=_last_dim_contiguous(key),
        value=_last_dim_contiguous(value),
        indices=indices,
        attn_bias=attn_bias,
        **normalize_settings(query, softmax_scale, is_causal, window_size, softcap, deterministic),
        unique_indices=unique_indices,
    )


def plane_heads(problem: TopkProblem) -> int:
    """Heads of the float32 bias plane ``[B, Hd, Sq, Sk]`` that the packed mask of ``problem``
    needs (:func:`as_mask_problem`), or 0 when it needs none: with ``unique_indices`` and no bias
    per listed pair, a bit says all an entry does. ``Hd`` is H for a bias per query head with GQA,
    else Hkv."""
    bias, num_heads, num_kv_heads = problem.attn_bias, problem.query.shape[2], problem.key.shape[2]
    if problem.unique_indices and (bias is None or bias.dim() == 3):
        return 0
    bias_heads = 1 if bias is None else bias.shape[2 if bias.dim() == 4 else 1]
    return num_heads if bias_heads == num_heads != num_kv_heads else num_kv_heads


class _ListedBias(torch.autograd.Function):
    """The per-pair bias plane of a top-k call: ``bias`` ``[B, Hd, Sq, W]`` float32 of the entries
    listing ``keys`` ``[B, Hd, Sq, W]`` int64 (``Sk`` for an entry that does not count) ->
    ``[B, Hd, Sq, Sk]`` float32, at each listed key the log-sum-exp of its entries' biases
    (``log(count)`` for zero biases), ``-inf`` where no entry counts.

    Attention over the plane weighs key j by ``exp(s_j) * sum_w exp(bias_w)``: exactly what its
    entries weigh as separate pairs. The gradient of entry w is the plane's gradient at its key
    times ``exp(bias_w - plane)``, its share of the sum.
    """

    @staticmethod
    def forward(ctx, bias, keys, seqlen_k: int):
        batch, heads, rows, _ = keys.shape
        plane = bias.new_empty(batch, heads, rows, seqlen_k)
        step = max(1, _PLANE_CHUNK_ELEMENTS // max(1, batch * heads * (seqlen_k + 1)))
        for start in range(0, rows, step):
            chunk_keys, chunk_bias = keys[:, :, start : start + step], bias[:, :, start : start + step]
            spare = (*chunk_keys.shape[:3], seqlen_k + 1)  # column Sk takes the entries that do not count
            top = bias.new_full(spare, float("-inf")).scatter_reduce_(-1, chunk_keys, chunk_bias, "amax")
            top_of_entry = top.gather(-1, chunk_keys)
            # A key whose entries are all -inf stays at a sum of 0: a plane of -inf, which masks it.
            share = torch.exp(torch.where(top_of_entry == float("-inf"), float("-inf"), chunk_bias - top_of_entry))
            units = torch.zeros(spare, dtype=torch.int64, device=keys.device)
            units.scatter_add_(-1, chunk_keys, torch.round(share / _ENTRY_SUM_UNIT).long())
            plane[:, :, start : start + step] = (top + torch.log(units.double() * _ENTRY_SUM_UNIT).float())[..., :seqlen_k]
        ctx.save_for_backward(bias, keys, plane)
        return plane

    @staticmethod
    def backward(ctx, grad_plane):
        bias, keys, plane = ctx.saved_tensors
        seqlen_k = plane.shape[-1]
        at = keys.clamp(max=seqlen_k - 1)
        total = plane.gather(-1, at)
        counts = (keys < seqlen_k) & (total > float("-inf"))  # a masked key's plane gradient is 0, its weight undefined
        share = torch.exp(torch.where(counts, bias - total, float("-inf")))
        return grad_plane.gather(-1, at) * share, None, None


def as_mask_problem(problem: TopkProblem, bits: BitMask | None = None) -> AttentionProblem:
    """``problem`` as a ``flash_dma_func`` problem with the same outputs and gradients.

    The mask is the ``BitMask`` ``[B, Hkv, Sq, Sk]`` of the entries that count: ``bits`` when the
    caller built it (the Triton backend, on the GPU), else built here; neither synchronises with
    the host. The bias: with ``unique_indices`` and no bias per listed pair, the caller's per-key
    bias ``[1|B, 1|Hkv|H, Sk]`` as ``[., ., 1, Sk]``, or none. Otherwise a float32 plane
    ``[B, Hd, Sq, Sk]`` (:func:`plane_heads`) that carries what a bit cannot: a key listed several
    times (each entry is one pair) and a per-pair bias (:class:`_ListedBias`), plus a per-key bias
    added to its columns. Either way the gradient flows back to the caller's bias in that bias's
    shape. ``deterministic`` carries over: reproducible gradients when asked for, as the index
    kernels give them.
    """
    query, key = problem.query, problem.key
    seqlen_q, seqlen_k = query.shape[1], key.shape[1]
    bias = problem.attn_bias
    heads = plane_heads(problem)
    counting = None
    if bits is None or heads > 0:
        counting = valid_indices(problem.indices, 0, seqlen_q, seqlen_k, problem.window)  # [B, Sq, Hkv, W]
    if bits is None:
        bits = listed_bit_mask(torch.where(counting, problem.indices, -1).transpose(1, 2), seqlen_k)
    if heads == 0:
        attn_bias = None if bias is None else bias[:, :, None, :]
    else:
        keys = torch.where(counting, problem.indices.long(), seqlen_k).transpose(1, 2)  # [B, Hkv, Sq, W]
        if heads != key.shape[2]:
            keys = keys.repeat_interleave(heads // key.shape[2], dim=1)  # [B, H, Sq, W]
        if bias is not None and bias.dim() == 4:  # per pair [1|B, Sq, 1|Hd, W]
            entry_bias = bias.float().transpose(1, 2).expand(keys.shape)
        else:
            entry_bias = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        attn_bias = _ListedBias.apply(entry_bias, keys, seqlen_k)
        if bias is not None and bias.dim() == 3:  # per key [1|B, 1|Hd, Sk]
            attn_bias = attn_bias + bias.float()[:, :, None, :]
    return AttentionProblem(
        query=query, key=key, value=problem.value, attn_mask=bits, attn_bias=attn_bias, block_mask=None,
        softmax_scale=problem.softmax_scale, window=problem.window, softcap=problem.softcap, deterministic=problem.deterministic,
    )
