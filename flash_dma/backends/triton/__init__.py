"""The Triton backend: forward and backward kernels behind ``torch.library`` custom ops.

How the kernels walk a mask's sparsity is chosen here, from shapes alone (no host sync):

- a block summary given (``block_mask``): its lists, tile by tile. A summary declares block
  structure, and whole tiles load and pipeline best;
- a mask alone, on a small problem: every tile reads the mask element-wise. Below
  :data:`SMALL_PROBLEM` scores this costs less than one more launch to prepare a walk;
- a per-key mask alone (``[., 1|Hkv, 1, Sk]``): a key list, so that tiles hold only kept keys,
  however scattered (``key_list.py``);
- a per-pair mask that the Hopper kernels serve (``dispatch.py``): packed into bits (a
  ``BitMask``'s words, 1/8 of its bytes) with their summary in one read (``bit_pack.py``),
  walked by the summary given or that one;
  a ``BitMask`` passed in is walked by its own summary;
- ``KeyIntervals``: each key's rows, tested by the kernels on PARTIAL tiles only, walked by their
  own summary;
- any other mask alone: the lists of a summary built here;
- no mask: every tile inside the causal/window band.

What a mask tensor becomes (bits, summary, key list) is made once per version of the tensor
(:data:`_DERIVED`), so a mask shared by every layer is read once per step, not once per call.

Each pass of a top-k call (``flash_dma_topk_func``) walks its indices or the same attention over
the packed per-query mask of its entries (``flash_dma.topk.as_mask_problem``, built by
``topk/bits.py``), which the dense kernels walk as above: whichever ``dispatch.topk_plan`` finds
cheaper from the call's shapes. A call whose passes differ runs through ``topk/passes.py``.

The mask builders of ``flash_dma.masks`` reach their kernels through this module: the block
states of a block top-k (:func:`topk_state`) and of key intervals (:func:`interval_state`), and a
causal top-k's intervals (:func:`causal_topk_end_rows`).
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.dispatch import TOPK_PACKED, hopper_takes_bits, topk_plan
from flash_dma.backends.triton.forward import attention_forward
from flash_dma.backends.triton.key_intervals import causal_topk_end_rows, interval_state, kernel_intervals
from flash_dma.backends.triton.launch import AHEAD
from flash_dma.backends.triton.layout import Call, TopkCall, input_form
from flash_dma.backends.triton.merge import merge_partial  # the ring's, beside partial_forward
from flash_dma.backends.triton.ops import (
    attention_op,
    key_list,
    kvcache_forward,
    launch_forward,
    packed_bits,
    summary_lists,
    summary_state,
    topk_attention_op,
    topk_split_op,
    topk_state,
)
from flash_dma.backends.triton.topk.bits import topk_bit_mask
from flash_dma.bit_mask import BitMask
from flash_dma.block_mask import DEFAULT_BLOCK_SIZE
from flash_dma.key_intervals import KeyIntervals
from flash_dma.memo import DerivedTensors

SMALL_PROBLEM = 1 << 24  # B x H x Sq x Sk
# A decode reads every key's K and V to serve a few query rows, so below SMALL_PROBLEM scores it
# may still read far more than a key list costs (two launches, about 10 us on an H100): past this
# many bytes of K and V, a per-key mask over a cache is gathered through a key list.
KEY_LIST_CACHE_BYTES = 8 << 20
# What a dense mask becomes for the kernels (its bits, summary or key list), made once per version
# of the mask: every layer that shares a mask, forward and backward, reuses one read of it.
_DERIVED = DerivedTensors()


def _per_key(mask, num_heads: int, num_kv_heads: int) -> bool:
    """Whether one set of keys serves every query (and every query head of a GQA group)."""
    return mask.shape[2] == 1 and (mask.shape[1] in (1, num_kv_heads) or num_heads == num_kv_heads)


def walk_fields(state: torch.Tensor, block_size, kv_lists=None, q_lists=None) -> dict:
    """The walk fields of a :class:`Call` for a summary's block states ``[Bm, Hm, NQB, NKB]`` and
    lists (built here when not given). An axis of one summary block spans the whole axis
    (broadcast or short), which a block size of 0 says."""
    return dict(
        kv_lists=summary_lists(state, False) if kv_lists is None else kv_lists,
        q_lists=summary_lists(state, True) if q_lists is None else q_lists,
        list_block_q=block_size[0] if state.shape[2] > 1 else 0,
        list_block_k=block_size[1] if state.shape[3] > 1 else 0,
    )


def _call(problem) -> Call:
    """The :class:`~flash_dma.backends.triton.layout.Call` of a validated
    :class:`~flash_dma.inputs.AttentionProblem`, with the walk of its mask chosen (module doc)."""
    mask, summary, kind = problem.attn_mask, problem.block_mask, "elements"
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, _ = problem.entries
    if isinstance(mask, KeyIntervals):  # read by the kernels themselves, walked by their own summary
        mask, summary, kind = kernel_intervals(mask), mask.summary, "intervals"
    elif isinstance(mask, BitMask) and (mask.shape[2] == 1 or mask.shape[3] == 1):
        mask = mask.dense()  # per key or per row: as small as one row or column of bools
    elif isinstance(mask, BitMask):
        mask, summary, kind = mask.words, mask.summary, "bits"
    left, right = problem.window
    call = Call(
        problem.query, problem.key, problem.value, mask, problem.attn_bias, None, None, None,
        problem.cu_seqlens_q, problem.cu_seqlens_k, problem.descale, 0, 0, problem.softmax_scale, left, right,
        problem.softcap, problem.deterministic, problem.max_seqlen_q, problem.max_seqlen_k, kind,
    )
    if summary is not None:
        call = call._replace(**walk_fields(summary.state, summary.block_size, summary.kv_lists, summary.q_lists))
        if kind == "elements" and not summary.needs_mask:
            return call._replace(mask=None)  # without PARTIAL blocks the mask is never read
    large = batch * num_heads * seqlen_q * seqlen_k > SMALL_PROBLEM
    if mask is None or kind != "elements" or not large:
        return call
    if input_form(mask) == "pairs" and hopper_takes_bits(call):
        # The Hopper kernels read a per-pair mask as bits (1/8 of its bytes), walked by a summary.
        words, walk = _DERIVED.get(mask, "bits", lambda: _bits_and_walk(mask))
        return call._replace(mask=words, mask_kind="bits", **({} if summary is not None else walk))
    if summary is not None:
        return call
    if _per_key(mask, num_heads, num_kv_heads):
        keys = _DERIVED.get(mask, ("keys", seqlen_k), lambda: key_list(mask, seqlen_k))
        return call._replace(mask=None, key_list=keys)
    walk = _DERIVED.get(mask, "summary", lambda: walk_fields(summary_state(mask, *DEFAULT_BLOCK_SIZE), DEFAULT_BLOCK_SIZE))
    return call._replace(**walk)


def _bits_and_walk(mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A dense per-pair mask's BitMask words and the walk fields of their summary, in one read of the mask."""
    words, state = packed_bits(mask, *DEFAULT_BLOCK_SIZE)
    return words, walk_fields(state, DEFAULT_BLOCK_SIZE)


def attention(problem):
    """Backend entry point: ``(out, lse)`` for a validated :class:`~flash_dma.inputs.AttentionProblem`."""
    if torch.compiler.is_compiling():
        return attention_op(_call(problem))
    # A call that needs a kernel compiled first starts compiling all of its kernels (``launch.py``).
    token = AHEAD.set((dry_attention, (problem, torch.is_grad_enabled())))
    try:
        return attention_op(_call(problem))
    finally:
        AHEAD.reset(token)


def dry_attention(problem, grad_enabled: bool) -> None:
    """The host code of :func:`attention` on ``problem``, and of its backward where ``grad_enabled``
    and an input requires grad (its upstream gradient laid out as the output), for a dry run
    (``launch.dry_run``): each launch starts compiling its kernel, none runs."""
    call = _call(problem)
    out, lse = attention_forward(call)
    bias = problem.attn_bias
    if grad_enabled and any(t is not None and t.requires_grad for t in (problem.query, problem.key, problem.value, bias)):
        attention_backward(torch.empty_like(out), call, out, lse, bias is not None and bias.requires_grad)


def partial_forward(problem):
    """``(out, lse)`` without autograd: for callers that drive the backward themselves
    (context parallelism merges the results of several calls, then differentiates each)."""
    return launch_forward(*_call(problem))


def partial_backward(problem, dout, out, lse, bias_requires_grad: bool):
    """``(dq, dk, dv, dbias or None)`` of ``problem`` for a softmax normalised by ``lse``; dq, dk
    and dv in float32.

    ``out`` and ``lse`` ``[B, H, Sq]`` may be those of a larger attention that this problem is part
    of (its keys a subset of that one's): the gradients are then this part's share of its gradients.
    """
    # float32 gradients: the caller sums several calls' before rounding once.
    return attention_backward(dout, _call(problem), out, lse, bias_requires_grad, grad_dtype=torch.float32)


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


def topk_attention(problem):
    """Backend entry point of ``flash_dma_topk_func``: ``(out, lse)`` for a
    :class:`~flash_dma.topk.TopkProblem`, each pass walking the indices or the packed mask as
    :func:`~flash_dma.backends.triton.dispatch.topk_plan` chooses."""
    # Imported here: flash_dma.topk imports flash_dma.masks, which imports this package, and a
    # top-level import would make importing flash_dma.masks (or .summaries) first a cycle.
    from flash_dma.topk import as_mask_problem, plane_heads

    query, key, bias = problem.query, problem.key, problem.attn_bias
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, problem.value, bias))
    plan = topk_plan(
        query.shape[0], query.shape[1], key.shape[1], query.shape[2], key.shape[2], query.shape[3], problem.indices.shape[3],
        problem.window, plane_heads(problem), problem.deterministic, needs_grad,
    )
    if plan.forward == plan.backward == TOPK_PACKED:  # one BitMask, saved for the backward
        bits = topk_bit_mask(problem.indices, query.shape[1], key.shape[1], problem.window)
        return attention(as_mask_problem(problem, bits))
    left, right = problem.window
    call = TopkCall(
        query, key, problem.value, problem.indices, bias, problem.softmax_scale, left, right, problem.softcap,
        problem.deterministic,
    )
    if plan.forward == plan.backward:
        return topk_attention_op(call)
    return topk_split_op(call, plan.forward == TOPK_PACKED)
