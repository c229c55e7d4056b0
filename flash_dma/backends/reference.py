"""Exact attention in plain PyTorch: the oracle for every kernel, and the CPU backend.

It follows the contract of ``docs/api.md`` to the letter, computing in float32 (or in any
``compute_dtype``: the tests run it in float64 as the oracle and in the input dtype to measure
PyTorch's own rounding error). Queries are processed in chunks, and under autograd each chunk
is checkpointed, so memory stays O(chunk x Sk) in the forward and the backward pass.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from flash_dma.block_mask import BlockMask, effective_mask_rows
from flash_dma.inputs import FP8_DTYPE, FP8_OUT_DTYPE, dequantized
from flash_dma.kv_cache import cached_keys

# Scores materialised per chunk (elements): bounds the memory of one chunk.
_CHUNK_SCORES = 1 << 24
# Hopper's FP8 tensor cores add each group of products to their accumulator keeping about 14
# significant bits, not float32's 24 (DeepSeek-V3 technical report, section 3.3.2); the model keeps
# 13, truncated, after every 32 products (one e4m3 wgmma's reduction depth).
FP8_ACCUMULATOR_BITS, FP8_PRODUCTS_PER_STEP = 13, 32


def in_band(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int, window: tuple[int, int]) -> torch.Tensor:
    """bool, ``rows`` and ``cols`` broadcast: key ``cols`` is visible to query ``rows`` under the
    (bottom-right aligned) window, ``-1`` unbounded on its side."""
    left, right = window
    offset = cols - (rows + (seqlen_k - seqlen_q))  # key position minus the query's diagonal key
    visible = torch.ones(torch.broadcast_shapes(rows.shape, cols.shape), dtype=torch.bool, device=rows.device)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


def visible_positions(rows: torch.Tensor, seqlen_q: int, seqlen_k: int, window: tuple[int, int]) -> torch.Tensor:
    """``[len(rows), Sk]`` bool: key j is visible to query i under the (bottom-right aligned) window."""
    return in_band(rows[:, None], torch.arange(seqlen_k, device=rows.device)[None, :], seqlen_q, seqlen_k, window)


def valid_indices(indices: torch.Tensor, row_start: int, seqlen_q: int, seqlen_k: int, window) -> torch.Tensor:
    """bool like top-k ``indices`` ``[B, c, Hkv, W]`` of query rows ``row_start`` onwards: the entries
    that count, those in ``[0, Sk)`` and inside their query's causal/window band."""
    rows = torch.arange(row_start, row_start + indices.shape[1], device=indices.device)[None, :, None, None]
    return (indices >= 0) & (indices < seqlen_k) & in_band(rows, indices, seqlen_q, seqlen_k, window)


def _group_heads(t: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[b, 1|Hkv|H, r, c]`` -> ``[b, 1|Hkv, 1|G, r, c]`` so that it broadcasts against grouped scores."""
    heads = t.shape[1]
    if heads in (1, num_kv_heads):
        return t.unsqueeze(2)
    return t.reshape(t.shape[0], num_kv_heads, heads // num_kv_heads, *t.shape[2:])


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor):
    """``(probs, denom, lse)`` of ``scores`` ``[..., n]`` over its ``visible`` entries: the output is
    ``probs @ v / denom``. A row with no visible key (or only ``-inf`` scores) has ``probs = 0``,
    ``denom = 1`` and ``lse = -inf`` ``[...]``."""
    scores = scores.masked_fill(~visible, float("-inf"))
    # The max shift cancels out of the softmax; detaching it keeps autograd exact and cheap.
    if scores.shape[-1] == 0:
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    else:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    has_keys = denom > 0
    denom = torch.where(has_keys, denom, 1.0)  # rows with no visible key give 0
    # Differentiable (backward() needs d lse / d scores); log of 1, not 0, keeps empty rows' gradients finite.
    lse = torch.where(has_keys, row_max + torch.log(denom), float("-inf")).squeeze(-1)
    return probs, denom, lse


def _truncated(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` truncated to ``bits`` significant bits (toward zero)."""
    mantissa, exponent = torch.frexp(x)  # |mantissa| in [0.5, 1)
    return torch.ldexp(torch.trunc(mantissa * 2**bits) / 2**bits, exponent)


def _fp8_tensor_core_products(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q @ k^T`` summed as Hopper's FP8 tensor cores sum it (``FP8_ACCUMULATOR_BITS``): the scores,
    and with ``P`` and ``V^T`` the output, which the kernel accumulates over its key tiles in place."""
    acc = torch.zeros(*q.shape[:-1], k.shape[-2], dtype=q.dtype, device=q.device)
    for start in range(0, q.shape[-1], FP8_PRODUCTS_PER_STEP):
        chunk = slice(start, start + FP8_PRODUCTS_PER_STEP)
        acc = _truncated(acc + q[..., chunk] @ k[..., chunk].transpose(-1, -2), FP8_ACCUMULATOR_BITS)
    return acc


def _attend_chunk(q, k, v, mask, bias, *, row_start, seqlen_q, softmax_scale, window, softcap, fp8_tensor_cores=False):
    """Attention of one chunk of queries. q: [B, c, H, D]; k, v: [B, Hkv, 1, Sk, D]."""
    batch, rows, num_heads, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[3]
    q = q.reshape(batch, rows, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(0, 2, 3, 1, 4)
    products = _fp8_tensor_core_products(q, k) if fp8_tensor_cores else q @ k.transpose(-1, -2)  # [B, Hkv, G, c, Sk]
    scores = _capped(products * softmax_scale, softcap)
    if bias is not None:
        scores = scores + _group_heads(bias.to(scores.dtype), num_kv_heads)
    positions = torch.arange(row_start, row_start + rows, device=q.device)
    visible = visible_positions(positions, seqlen_q, seqlen_k, window)
    if mask is not None:
        visible = visible & mask
    probs, denom, lse = _masked_softmax(scores, visible)
    if fp8_tensor_cores:  # P in e4m3, as the Hopper FP8 forward's P V takes it
        out = _fp8_tensor_core_products(probs.to(FP8_DTYPE).to(denom.dtype), v.transpose(-1, -2)) / denom
    else:
        out = (probs @ v) / denom
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, rows, num_heads, head_dim)
    return out, lse.reshape(batch, num_heads, rows)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    block_mask: BlockMask | None = None,
    compute_dtype: torch.dtype = torch.float32,
    chunk_size: int | None = None,
    fp8_tensor_cores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention as the contract defines it, differentiable in every float input.

    Args:
        query: ``[B, Sq, H, D]``.
        key, value: ``[B, Sk, Hkv, D]``.
        attn_mask: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` bool or 0/1 integer, or None.
        attn_bias: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` float, or None.
        softmax_scale: defaults to ``D ** -0.5``.
        window: ``(left, right)``, -1 unbounded, bottom-right aligned; causal is ``(left, 0)``.
        softcap: ``cap * tanh(x / cap)`` on the scaled scores when > 0.
        block_mask: applied as described in ``_effective_mask_rows``.
        compute_dtype: arithmetic dtype (float32 by default).
        chunk_size: queries per chunk; by default about 16M scores per chunk.
        fp8_tensor_cores: model Hopper's FP8 tensor-core products (the baseline of the FP8
            forward's tests): the probabilities (``exp(s - rowmax)``, in [0, 1]) rounded to e4m3
            before ``P V``, and both products accumulated at their precision
            (``_fp8_tensor_core_products``).

    Returns:
        ``out`` ``[B, Sq, H, D]`` in ``query.dtype`` and ``lse`` ``[B, H, Sq]`` (natural log,
        ``-inf`` for rows with no visible key) in float32 or ``compute_dtype`` if wider; both
        differentiable.
    """
    batch, seqlen_q, num_heads, head_dim = query.shape
    seqlen_k = key.shape[1]
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_SCORES // max(1, batch * num_heads * seqlen_k))
    # [B, Sk, Hkv, D] -> [B, Hkv, 1, Sk, D]: broadcasts over the query heads of each group.
    k = key.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    v = value.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    attend = functools.partial(
        _attend_chunk, seqlen_q=seqlen_q, softmax_scale=softmax_scale, window=window, softcap=softcap, fp8_tensor_cores=fp8_tensor_cores
    )
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_bias)
    )
    outs, lses = [], []
    # At least one (possibly empty) chunk, so that empty problems keep their autograd graph.
    for start in range(0, max(seqlen_q, 1), chunk_size):
        stop = min(seqlen_q, start + chunk_size)
        q = query[:, start:stop].to(compute_dtype)
        mask = effective_mask_rows(attn_mask, block_mask, start, stop, seqlen_k)
        mask = None if mask is None else _group_heads(mask, key.shape[2])
        bias = None
        if attn_bias is not None:
            bias = attn_bias[:, :, start:stop] if attn_bias.shape[2] > 1 else attn_bias
        fn = functools.partial(attend, row_start=start)
        if needs_grad:
            out, lse = checkpoint(fn, q, k, v, mask, bias, use_reentrant=False)
        else:
            out, lse = fn(q, k, v, mask, bias)
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=2)
    return out.to(query.dtype), lse.to(torch.promote_types(compute_dtype, torch.float32))


def _topk_bias(bias: torch.Tensor | None, keys: torch.Tensor, num_heads: int) -> torch.Tensor | None:
    """The bias of the chosen pairs, ``[1|B, c, Hkv|1, G|1, W]``, from a per-pair bias's chunk of rows
    ``[1|B, c, 1|Hkv|H, W]`` or a per-key bias ``[1|B, 1|Hkv|H, Sk]`` gathered at ``keys`` ``[B, c, Hkv, W]``."""
    if bias is None:
        return None
    batch, rows, num_kv_heads, width = keys.shape
    heads = bias.shape[-2] if bias.dim() == 4 else bias.shape[1]
    per_head = heads == num_heads and num_heads != num_kv_heads
    group = num_heads // num_kv_heads if per_head else 1
    if bias.dim() == 4:
        return bias.reshape(bias.shape[0], rows, heads // group, group, width)
    table = bias.reshape(bias.shape[0], 1, heads // group, group, bias.shape[2])
    table = table.expand(batch, rows, num_kv_heads, group, bias.shape[2])
    return table.gather(-1, keys[:, :, :, None, :].expand(batch, rows, num_kv_heads, group, width))


def _attend_topk_chunk(q, key, value, indices, bias, *, row_start, seqlen_q, softmax_scale, window, softcap):
    """Top-k attention of one chunk of queries. q: [B, c, H, D]; key, value: [B, Sk, Hkv, D];
    indices: [B, c, Hkv, W]; bias: that of ``_topk_bias``'s arguments."""
    batch, rows, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = key.shape[1], key.shape[2]
    valid = valid_indices(indices, row_start, seqlen_q, seqlen_k, window)  # [B, c, Hkv, W]
    keys = torch.where(valid, indices, 0).long()
    batch_idx = torch.arange(batch, device=q.device)[:, None, None, None]
    head_idx = torch.arange(num_kv_heads, device=q.device)[None, None, :, None]
    k, v = key[batch_idx, keys, head_idx], value[batch_idx, keys, head_idx]  # [B, c, Hkv, W, D]
    q = q.reshape(batch, rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = _capped(torch.einsum("bchgd,bchwd->bchgw", q, k) * softmax_scale, softcap)  # [B, c, Hkv, G, W]
    pair_bias = _topk_bias(bias, keys, num_heads)
    if pair_bias is not None:
        scores = scores + pair_bias.to(scores.dtype)
    probs, denom, lse = _masked_softmax(scores, valid[:, :, :, None, :])
    out = torch.einsum("bchgw,bchwd->bchgd", probs, v) / denom
    return out.reshape(batch, rows, num_heads, head_dim), lse.reshape(batch, rows, num_heads).transpose(1, 2)


def reference_topk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    indices: torch.Tensor,
    attn_bias: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    compute_dtype: torch.dtype = torch.float32,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k index attention as the contract defines it, by gathering the listed keys; differentiable
    in every float input.

    Args:
        query: ``[B, Sq, H, D]``.
        key, value: ``[B, Sk, Hkv, D]``.
        indices: ``[B, Sq, Hkv, W]`` integer; an entry counts when it is in ``[0, Sk)`` and inside
            its query's window; each counting entry is one attended pair (duplicates count twice).
        attn_bias: per pair ``[1|B, Sq, 1|Hkv|H, W]``, per key ``[1|B, 1|Hkv|H, Sk]``, or None.
        softmax_scale, window, softcap, compute_dtype: as for :func:`reference_attention`.
        chunk_size: queries per chunk; by default about 16M gathered elements per chunk.

    Returns:
        ``out`` ``[B, Sq, H, D]`` in ``query.dtype`` and ``lse`` ``[B, H, Sq]`` in float32 or
        ``compute_dtype`` if wider; both differentiable.
    """
    batch, seqlen_q, num_heads, head_dim = query.shape
    num_kv_heads, width = key.shape[2], indices.shape[3]
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_SCORES // max(1, batch * num_kv_heads * width * max(head_dim, num_heads)))
    attend = functools.partial(
        _attend_topk_chunk, seqlen_q=seqlen_q, softmax_scale=softmax_scale, window=window, softcap=softcap
    )
    key, value = key.to(compute_dtype), value.to(compute_dtype)
    if key.shape[1] == 0:  # no key to gather: every entry is out of range
        indices = indices[..., :0]
        attn_bias = attn_bias[..., :0] if attn_bias is not None and attn_bias.dim() == 4 else attn_bias
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_bias)
    )
    outs, lses = [], []
    for start in range(0, max(seqlen_q, 1), chunk_size):
        stop = min(seqlen_q, start + chunk_size)
        bias = attn_bias[:, start:stop] if attn_bias is not None and attn_bias.dim() == 4 else attn_bias
        args = (query[:, start:stop].to(compute_dtype), key, value, indices[:, start:stop], bias)
        fn = functools.partial(attend, row_start=start)
        out, lse = checkpoint(fn, *args, use_reentrant=False) if needs_grad else fn(*args)
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=2)
    return out.to(query.dtype), lse.to(torch.promote_types(compute_dtype, torch.float32))


def topk_attention(problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry point of ``flash_dma_topk_func``: ``(out, lse)`` for a
    :class:`~flash_dma.topk.TopkProblem`."""
    out, lse = reference_topk_attention(
        problem.query, problem.key, problem.value, problem.indices, problem.attn_bias,
        softmax_scale=problem.softmax_scale, window=problem.window, softcap=problem.softcap,
    )
    return out, lse.detach()


def _entry_rows(t: torch.Tensor | None, entry: int, rows: int, keys: int) -> torch.Tensor | None:
    """Entry ``entry`` of a per-entry ``[1|N, ., 1|Sq, 1|Sk]`` tensor, cut to ``rows`` x ``keys``."""
    if t is None:
        return None
    t = t[entry if t.shape[0] > 1 else 0][None]
    t = t[:, :, :rows] if t.shape[2] > 1 else t
    return t[..., :keys] if t.shape[3] > 1 else t


def _joined(problem, outs: list, lses: list, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry-by-entry results joined along the token (``dim=1``) or batch (``dim=0``) axis of the
    query; with no entry at all, the empty ``(out, lse)`` of the query's shape."""
    if not outs:
        query = problem.query
        return query.new_zeros(query.shape), query.new_zeros(query.shape[0], query.shape[2], query.shape[1]).float()
    return torch.cat(outs, dim=dim), torch.cat(lses, dim=2 if dim == 1 else 0)


def packed_attention(problem, compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [1, total_q, H, D], lse [1, H, total_q])`` of packed sequences, one sequence at a time:
    each is an attention problem of its own, which is what the contract says."""
    starts_q, starts_k = problem.cu_seqlens_q.tolist(), problem.cu_seqlens_k.tolist()
    block_mask = problem.block_mask
    rows = problem.max_seqlen_q if block_mask is not None and block_mask.state.shape[2] > 1 else 1
    mask = effective_mask_rows(problem.attn_mask, block_mask, 0, rows, problem.max_seqlen_k)
    outs, lses = [], []
    for entry, (q0, q1, k0, k1) in enumerate(zip(starts_q, starts_q[1:], starts_k, starts_k[1:])):
        out, lse = reference_attention(
            problem.query[:, q0:q1],
            problem.key[:, k0:k1],
            problem.value[:, k0:k1],
            _entry_rows(mask, entry, q1 - q0, k1 - k0),
            _entry_rows(problem.attn_bias, entry, q1 - q0, k1 - k0),
            softmax_scale=problem.softmax_scale,
            window=problem.window,
            softcap=problem.softcap,
            compute_dtype=compute_dtype,
        )
        outs.append(out)
        lses.append(lse)
    return _joined(problem, outs, lses, dim=1)


def attention_with_cache(cached) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry point of :func:`flash_dma.flash_dma_with_kvcache`: ``(out [B, Sq, H, D], lse
    [B, H, Sq])`` for a :class:`~flash_dma.kv_cache.CachedProblem`, entry by entry over its
    gathered keys."""
    problem = cached.problem
    seqlen_q = problem.query.shape[1]
    outs, lses = [], []
    for entry, length in enumerate(cached.seqlens_k.tolist()):
        key, value, bias = cached_keys(cached, entry, length)
        out, lse = reference_attention(
            problem.query[entry : entry + 1],
            key,
            value,
            _entry_rows(problem.attn_mask, entry, seqlen_q, length),
            bias,
            softmax_scale=problem.softmax_scale,
            window=problem.window,
            softcap=problem.softcap,
        )
        outs.append(out)
        lses.append(lse)
    return _joined(problem, outs, lses, dim=0)


def _attention(problem, query, key, value, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (not packed) ``problem`` on these tensors: its own, or leaves of a graph of their own."""
    return reference_attention(
        query,
        key,
        value,
        problem.attn_mask,
        bias,
        softmax_scale=problem.softmax_scale,
        window=problem.window,
        softcap=problem.softcap,
        block_mask=problem.block_mask,
    )


def attention(problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry point: ``(out, lse)`` for a validated :class:`~flash_dma.inputs.AttentionProblem`
    (FP8 inputs dequantized to float32 first)."""
    if problem.descale is not None:
        out, lse = attention(dequantized(problem))
        return out.to(FP8_OUT_DTYPE), lse
    if problem.cu_seqlens_q is not None:
        out, lse = packed_attention(problem)
    else:
        out, lse = _attention(problem, problem.query, problem.key, problem.value, problem.attn_bias)
    return out, lse.detach()  # the contract's lse is not differentiable, whatever the backend


def partial_forward(problem) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` without autograd: for callers that drive the backward themselves."""
    with torch.no_grad():
        return attention(problem)


def merge_partial(running, lse, part_out, part_lse, dest) -> None:
    """Fold one call's ``(part_out, part_lse)`` into the running ``(running, lse)``, in place, with
    the arguments of the Triton backend's ``merge_partial``: ``dest`` ``[B, R, H, D]`` gets the
    merged output, ``lse`` ``[B, H, R]`` the merged log-sum-exp (rows that saw no key: 0, -inf)."""
    top = torch.maximum(lse, part_lse)
    empty = torch.isinf(top)  # no key seen yet: both weights are exp(-inf) = 0
    shift = torch.where(empty, 0.0, top)
    keep, take = torch.exp(lse - shift), torch.exp(part_lse - shift)
    total = torch.where(empty, 1.0, keep + take)  # else >= 1: one of the two is exp(0)
    weights = [(w / total).transpose(1, 2).unsqueeze(-1) for w in (keep, take)]  # [B, R, H, 1]
    dest.copy_(running.float() * weights[0] + part_out.float() * weights[1])
    lse.copy_(torch.where(empty, float("-inf"), shift + torch.log(total)))


def partial_backward(problem, dout, out, lse, bias_requires_grad: bool):
    """``(dq, dk, dv, dbias or None)`` of ``problem`` for a softmax normalised by ``lse``, with the
    arguments of the Triton backend's ``partial_backward``.

    With ``P = exp(s - lse)`` and ``delta = rowsum(dout * out)``, the gradient of the scores is
    ``P * (dout @ v^T - delta)``. Autograd finds it from a surrogate whose score gradient is exactly
    that: ``sum(w * (dout . out_part - delta))``, where ``w = exp(lse_part - lse)`` is the weight of
    this part's own ``(out_part, lse_part)`` in the whole.
    """
    inputs = [problem.query, problem.key, problem.value]
    if bias_requires_grad:
        inputs.append(problem.attn_bias)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        bias = leaves[3] if bias_requires_grad else problem.attn_bias
        part_out, part_lse = _attention(problem, *leaves[:3], bias)
        # A row with lse = -inf has part_lse = -inf too: shifting by 0 there gives w = 0 with a finite gradient.
        lse = torch.where(torch.isinf(lse), 0.0, lse.float())
        weight = torch.exp(part_lse.float() - lse)  # [B, H, Sq]
        dout = dout.float()
        delta = (dout * out.float()).sum(-1).transpose(1, 2)
        surrogate = (weight * ((dout * part_out.float()).sum(-1).transpose(1, 2) - delta)).sum()
        grads = torch.autograd.grad(surrogate, leaves)
    return (*grads[:3], grads[3] if bias_requires_grad else None)
