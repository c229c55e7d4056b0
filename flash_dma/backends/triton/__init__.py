"""The Triton backend: forward and backward kernels behind ``torch.library`` custom ops.

How the kernels walk a mask's sparsity is chosen here, from shapes alone (no host sync):

- a block summary given (``block_mask``): its lists, tile by tile. A summary declares block
  structure, and whole tiles load and pipeline best;
- a mask alone, on a small problem: every tile reads the mask element-wise. Below
  :data:`SMALL_PROBLEM` scores this costs less than one more launch to prepare a walk;
- a per-key mask alone (``[., 1|Hkv, 1, Sk]``): a key list, so that tiles hold only kept keys,
  however scattered (``key_list.py``);
- any other mask alone: the lists of a summary built here;
- no mask: every tile inside the causal/window band.
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.ops import attention_op, key_list, kvcache_forward, launch_forward, packed_sequences
from flash_dma.block_mask import build_block_mask

SMALL_PROBLEM = 1 << 24  # B x H x Sq x Sk
# A decode reads every key's K and V to serve a few query rows, so below SMALL_PROBLEM scores it
# may still read far more than a key list costs (two launches, about 10 us on an H100): past this
# many bytes of K and V, a per-key mask over a cache is gathered through a key list.
KEY_LIST_CACHE_BYTES = 8 << 20


def _per_key(mask, num_heads: int, num_kv_heads: int) -> bool:
    """Whether one set of keys serves every query (and every query head of a GQA group)."""
    return mask.shape[2] == 1 and (mask.shape[1] in (1, num_kv_heads) or num_heads == num_kv_heads)


def _kernel_inputs(problem) -> tuple:
    """The inputs of ``forward_op`` for a validated :class:`~flash_dma.inputs.AttentionProblem`."""
    mask, block_mask = problem.attn_mask, problem.block_mask
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, _ = problem.entries
    kv_lists = q_lists = keys = None
    list_block_q = list_block_k = 0
    if block_mask is None and mask is not None and batch * num_heads * seqlen_q * seqlen_k > SMALL_PROBLEM:
        if _per_key(mask, num_heads, num_kv_heads):
            keys, mask = key_list(mask, seqlen_k), None
        else:
            block_mask = build_block_mask(mask)
    if block_mask is not None:
        kv_lists, q_lists = block_mask.kv_lists, block_mask.q_lists
        # An axis of one summary block spans the whole axis (broadcast or short): size 0 says so.
        list_block_q = block_mask.block_size[0] if block_mask.state.shape[2] > 1 else 0
        list_block_k = block_mask.block_size[1] if block_mask.state.shape[3] > 1 else 0
        # Without PARTIAL blocks the element-wise mask is never read.
        mask = mask if block_mask.needs_mask else None
    left, right = problem.window
    return (
        problem.query, problem.key, problem.value, mask, problem.attn_bias, kv_lists, q_lists, keys,
        problem.cu_seqlens_q, problem.cu_seqlens_k, list_block_q, list_block_k, problem.softmax_scale, left, right,
        problem.softcap, problem.deterministic, problem.max_seqlen_q, problem.max_seqlen_k,
    )


def attention(problem):
    """Backend entry point: ``(out, lse)`` for a validated :class:`~flash_dma.inputs.AttentionProblem`."""
    return attention_op(*_kernel_inputs(problem))


def partial_forward(problem):
    """``(out, lse)`` without autograd: for callers that drive the backward themselves
    (context parallelism merges the results of several calls, then differentiates each)."""
    return launch_forward(*_kernel_inputs(problem))


def partial_backward(problem, dout, out, lse, bias_requires_grad: bool):
    """``(dq, dk, dv, dbias or None)`` of ``problem`` for a softmax normalised by ``lse``; dq, dk
    and dv in float32.

    ``out`` and ``lse`` ``[B, H, Sq]`` may be those of a larger attention that this problem is part
    of (its keys a subset of that one's): the gradients are then this part's share of its gradients.
    """
    q, k, v, mask, bias, kv_lists, q_lists, keys, cu_q, cu_k, *settings, deterministic, max_q, max_k = _kernel_inputs(problem)
    # float32 gradients: the caller sums several calls' before rounding once.
    return attention_backward(
        dout, q, k, v, out, lse.contiguous(), mask, bias, kv_lists, q_lists, keys, *settings, deterministic,
        bias_requires_grad, sequences=packed_sequences(cu_q, cu_k, max_q, max_k), grad_dtype=torch.float32,
    )


def attention_with_cache(cached):
    """Backend entry point of ``flash_dma_with_kvcache``: ``(out, lse)`` for a
    :class:`~flash_dma.kv_cache.CachedProblem`. A per-key mask becomes a key list when the problem
    is large or the cache's K and V are (:data:`KEY_LIST_CACHE_BYTES`); any other mask is read
    element-wise (decode masks are per key)."""
    problem = cached.problem
    mask = problem.attn_mask
    batch, seqlen_q, num_heads, _ = problem.query.shape
    num_kv_heads = problem.key.shape[2]
    kv_bytes = 2 * batch * num_kv_heads * cached.capacity * problem.key.shape[3] * problem.key.element_size()
    large = batch * num_heads * seqlen_q * cached.capacity > SMALL_PROBLEM or kv_bytes > KEY_LIST_CACHE_BYTES
    keys = None
    if mask is not None and large and _per_key(mask, num_heads, num_kv_heads):
        keys, mask = key_list(mask, cached.capacity), None
    left, right = problem.window
    return kvcache_forward(
        problem.query, problem.key, problem.value, mask, problem.attn_bias, keys, cached.seqlens_k, cached.cache_rows,
        cached.block_table, cached.page_size, cached.capacity, problem.softmax_scale, left, right, problem.softcap,
        cached.num_splits,
    )
