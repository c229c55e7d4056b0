"""The public attention functions. ``docs/api.md`` is the contract they implement."""

from __future__ import annotations

import functools

import torch

from flash_dma.backends import BACKENDS, resolve_backend
from flash_dma.block_mask import BlockMask
from flash_dma.inputs import UNBOUNDED, normalize_inputs
from flash_dma.kv_cache import normalize_kvcache_inputs
from flash_dma.packed import normalize_varlen_inputs
from flash_dma.topk import normalize_topk_inputs


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
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Dynamic-mask attention with a trainable additive bias.

    ``s = softcap_fn(softmax_scale * q @ k^T) + attn_bias``, restricted to the keys that the
    mask, the causal rule and the window leave visible, then ``out = softmax(s) @ v``.
    Tiles of the attention matrix whose mask is all false are skipped.

    Args:
        query: ``[B, Sq, H, D]``, float16, bfloat16 or float32, or float8_e4m3fn (forward only, with
            the descales below); D from 1 to 256.
        key: ``[B, Sk, Hkv, D]``, same dtype and device; ``H % Hkv == 0`` (GQA/MQA).
        value: ``[B, Sk, Hkv, D]``.
        attn_mask: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` bool (True = attend) or 0/1 integer, or None.
            A head dimension of Hkv is shared by the query heads of each group.
        attn_bias: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` float32 or ``query.dtype`` (bfloat16 for FP8
            inputs), or None. It receives a gradient of its own shape (summed over its broadcast
            dimensions).
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
        backend: ``"triton"``, ``"flex"`` (PyTorch FlexAttention, CUDA), ``"reference"`` or None (Triton
            on CUDA, reference elsewhere).
        q_descale, k_descale, v_descale: FP8 inputs only: ``[B, Hkv]`` float32 factors that the
            inputs of each (batch, key/value head) are multiplied by (None: 1), as in
            FlashAttention-3; query heads take their group's.

    Returns:
        ``out`` ``[B, Sq, H, D]`` in ``query.dtype`` (bfloat16 for FP8 inputs); with ``return_lse``
        also ``lse`` ``[B, H, Sq]`` float32 (natural log, not differentiable). A query row with no
        visible key gets ``out = 0``, ``lse = -inf`` and zero gradients.
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
        descales=(q_descale, k_descale, v_descale),
    )
    implementation = resolve_backend(backend, query.device)
    if query.numel() == 0 or key.shape[1] == 0:
        # Empty problems have nothing to launch; the reference handles them with autograd intact.
        implementation = resolve_backend("reference", query.device)
    out, lse = implementation.attention(problem)
    return (out, lse) if return_lse else out


def flash_dma_topk_func(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    indices: torch.Tensor,
    attn_bias: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0,
    deterministic: bool = False,
    unique_indices: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Top-k index attention: each query attends the keys listed for it (DeepSeek's DSA form, GQA).

    The query heads of a key/value head's group share that head's list. An entry counts when it is
    in ``[0, Sk)`` and inside the causal/window band of its query (``-1`` pads a list); each entry
    that counts is one attended pair, so a key listed twice counts twice. Scores, softmax, LSE,
    empty rows and gradients follow :func:`flash_dma_func`. On the Triton backend each pass walks
    the indices or runs as the same attention over the packed per-query mask, whichever a cost
    model finds faster for the call's shapes (``docs/api.md``); the results are the same.

    Args:
        query: ``[B, Sq, H, D]``, float16, bfloat16 or float32; D from 1 to 256.
        key, value: ``[B, Sk, Hkv, D]``, same dtype and device; ``H % Hkv == 0``.
        indices: ``[B, Sq, Hkv, W]`` int32, the keys each query's group attends; values are not
            checked on the host (no synchronisation): entries outside ``[0, Sk)`` count as none.
        attn_bias: per selected pair ``[1|B, Sq, 1|Hkv|H, W]`` (slot w of ``indices``), or per key
            ``[1|B, 1|Hkv|H, Sk]`` (gathered at the listed keys); float32 or ``query.dtype``, or
            None. Its gradient has its own shape.
        softmax_scale: multiplies ``q @ k^T``; defaults to ``D ** -0.5``.
        is_causal: entry j counts for query i only if ``j <= i + Sk - Sq`` (bottom-right aligned).
        window_size: ``(left, right)``, -1 unbounded, as for :func:`flash_dma_func`.
        softcap: when > 0, scores are ``softcap * tanh(x / softcap)`` before the bias is added.
        deterministic: make the gradients bitwise reproducible (dK and dV summed key by key in a
            fixed order, instead of added by atomics: about 3x the backward's time).
        unique_indices: the caller's promise that no key counts twice in one list (as from
            :func:`~flash_dma.masks.topk_indices`); not checked (that would synchronise). It lets
            the packed mask run without a float32 bias plane of ``4 Sk`` bytes per query and head
            (which it needs to count repeats), so on far longer calls; with a per-pair bias the
            plane is needed all the same. If a key does repeat, the result is undefined: the
            mask counts it once, the index walk once per entry.
        return_lse: also return the log-sum-exp of the scores.
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, reference elsewhere).

    Returns:
        ``out`` ``[B, Sq, H, D]`` in ``query.dtype``; with ``return_lse`` also ``lse`` ``[B, H, Sq]``
        float32 (natural log, not differentiable). A query row with no counting entry gets
        ``out = 0``, ``lse = -inf`` and zero gradients.
    """
    problem = normalize_topk_inputs(
        query,
        key,
        value,
        indices,
        attn_bias,
        softmax_scale=softmax_scale,
        is_causal=is_causal,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        unique_indices=unique_indices,
    )
    implementation = resolve_backend(backend, query.device)
    if query.numel() == 0 or key.shape[1] == 0 or indices.shape[3] == 0:
        implementation = resolve_backend("reference", query.device)
    out, lse = implementation.topk_attention(problem)
    return (out, lse) if return_lse else out


def flash_dma_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0,
    block_mask: BlockMask | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """:func:`flash_dma_func` over packed sequences of different lengths (FlashAttention's varlen).

    Sequence i owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; each is attended as its own problem (causal and
    windows bottom-right aligned per sequence), and sequences never see each other.

    Args:
        q: ``[total_q, H, D]``; k, v: ``[total_k, Hkv, D]``, as for :func:`flash_dma_func`.
        cu_seqlens_q, cu_seqlens_k: ``[N + 1]`` int32 (or int64) cumulative lengths, from 0 to the total.
        max_seqlen_q, max_seqlen_k: the longest query and key lengths (ints, so that no call
            synchronises with the device).
        attn_mask: per-key bool or 0/1 integer, packed ``[1|Hkv|H, total_k]`` or per sequence
            ``[1|N, 1|Hkv|H, 1|max_seqlen_k]``, or None.
        attn_bias: per-key float, in the same two forms, or None. Its gradient has its shape.
        block_mask: a summary of ``attn_mask`` from ``build_block_mask(..., cu_seqlens_k=...)``
            or ``topk_block_mask(..., cu_seqlens_k=...)``: one entry per sequence.
        Other arguments: as for :func:`flash_dma_func`.

    Returns:
        ``out`` ``[total_q, H, D]``; with ``return_lse`` also ``lse`` ``[H, total_q]`` float32.
    """
    problem = normalize_varlen_inputs(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        attn_mask,
        attn_bias,
        softmax_scale=softmax_scale,
        is_causal=is_causal,
        window_size=window_size,
        softcap=softcap,
        block_mask=block_mask,
        deterministic=deterministic,
    )
    implementation = resolve_backend(backend, q.device)
    if problem.max_seqlen_q == 0 or problem.max_seqlen_k == 0:
        implementation = resolve_backend("reference", q.device)
    out, lse = implementation.attention(problem)
    return (out[0], lse[0]) if return_lse else out[0]


def flash_dma_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    bias_cache: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0,
    num_splits: int = 0,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Attention over a KV cache, appending new keys in place first (FlashAttention's convention).

    Entry b of the batch holds ``cache_seqlens[b]`` keys. The new ``k``/``v`` (and ``bias``) are
    written at positions ``cache_seqlens[b]`` onwards, then ``q`` attends to positions ``[0,
    cache_seqlens[b] + S_new)``, causal and windows bottom-right aligned to that length. Cache
    slots past it are never read or written. Forward only; split-KV for long caches.

    Args:
        q: ``[B, Sq, H, D]``.
        k_cache, v_cache: ``[B_cache, S_cache, Hkv, D]``, or with ``block_table`` a pool of pages
            ``[num_pages, page_size, Hkv, D]`` (any page size; 256 is a good one).
        k, v: ``[B, S_new, Hkv, D]`` new keys and values, or None.
        cache_seqlens: keys already cached per entry: an int, ``[B]`` int32, or None for a full cache.
        cache_batch_idx: ``[B]`` int32, the cache row of each entry (contiguous caches only).
        block_table: ``[B, max_pages]`` int32, the pages of each entry, in order (paged caches).
        attn_mask: ``[1|B, 1|Hkv|H, 1|Sq, 1|capacity]`` bool or 0/1 over key positions, where
            capacity is ``S_cache`` or ``max_pages * page_size``; or None.
        bias_cache: a per-key bias stored in the cache's layout, ``[B_cache, S_cache, 1|Hkv|H]``
            or ``[num_pages, page_size, 1|Hkv|H]``, float32 or q's dtype; or None.
        bias: ``[B, S_new, 1|Hkv|H]``, the new keys' bias, appended to ``bias_cache``.
        num_splits: split-KV parts, 0 to choose from the problem and the GPU.
        Other arguments: as for :func:`flash_dma_func`.

    Values of ``cache_seqlens``, ``cache_batch_idx`` and ``block_table`` are checked on the host
    (a ValueError naming the argument) except inside a CUDA graph capture or torch.compile,
    where the kernels clamp every index into the cache instead.

    Returns:
        ``out`` ``[B, Sq, H, D]``; with ``return_lse`` also ``lse`` ``[B, H, Sq]`` float32.
    """
    cached = normalize_kvcache_inputs(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        cache_batch_idx,
        block_table,
        attn_mask,
        bias_cache,
        bias,
        num_splits,
        softmax_scale=softmax_scale,
        is_causal=is_causal,
        window_size=window_size,
        softcap=softcap,
    )
    implementation = resolve_backend(backend, q.device)
    if q.numel() == 0 or cached.capacity == 0:
        implementation = resolve_backend("reference", q.device)
    out, lse = implementation.attention_with_cache(cached)
    return (out, lse) if return_lse else out


def flash_dma_func_auto(backend: str | None = None):
    """``flash_dma_func`` with ``backend`` fixed; None picks the best backend per call's device."""
    _check_backend_name(backend, BACKENDS)
    return functools.partial(flash_dma_func, backend=backend)


def _check_backend_name(backend, names) -> None:
    if backend is not None and backend not in names:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, names))} or None, got {backend!r}")


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
    *,
    backend: str | None = None,
):
    """Drop-in for the Flash-DMA / Flash-Sparse-Attention v1 entry point, with its argument order.

    Shapes are those of :func:`flash_dma_func`, and so is ``backend``. Unlike v1, causal masking is
    bottom-right aligned, fully masked rows return 0, and softcap is the standard
    ``cap * tanh(x / cap)`` (``docs/migration.md`` lists every difference).

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
        backend=backend,
    )
    return (out, lse, None) if return_attn_probs else out


flash_sparse_attn_func = flash_dmattn_func
