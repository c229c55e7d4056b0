"""Dynamic masks: which keys each query attends to, chosen from a learned per-key bias.

Trainable dynamic-mask attention scores every key with a bias (in Doge, ``A * softplus(dt_proj(V))``)
and attends only to the keys with the largest scores. The selection itself is not differentiable and
is made under ``torch.no_grad``: the bias is also added to the attention scores, and that is where
its gradient comes from.

- :func:`create_mask`: a token-level boolean mask, with the arguments of the earlier Flash-DMA
  ``create_mask``. A per-key bias ``[B, H, 1, Sk]`` gives a per-key mask of the same shape.
- :func:`topk_block_mask`: whole key blocks, straight into the :class:`~flash_dma.BlockMask` that
  ``flash_dma_func(block_mask=...)`` takes; no element-wise mask exists at any point. This is the
  form in which the kernels skip the unselected blocks entirely.
- :func:`topk_indices`: each query's top keys from an indexer's scores, as the ``indices`` of
  ``flash_dma_topk_func`` (:func:`chunked_topk_indices` from scores made a chunk of rows at a
  time); :func:`topk_mask` packs them into the equivalent ``BitMask``.
- :func:`attended_fraction`: the fraction of (query, key) pairs that a mask lets through.

Every selection is deterministic: among equal scores the key with the lower index wins.
"""

from __future__ import annotations

import torch

from flash_dma.backends import unavailable_reason
from flash_dma.backends.reference import visible_positions
from flash_dma.backends.triton import causal_topk_end_rows, interval_state, topk_state
from flash_dma.bit_mask import BitMask, pack_words
from flash_dma.block_mask import DEFAULT_BLOCK_SIZE, EMPTY, FULL, PARTIAL, BlockMask, check_block_size, effective_mask_rows
from flash_dma.inputs import UNBOUNDED, _normalize_window, check_choice, check_int, sizes_allowed
from flash_dma.integers import cdiv
from flash_dma.key_intervals import KeyIntervals, causal_starts, causal_topk_ends, interval_states
from flash_dma.packed import packed_rows, values_checkable
from flash_dma.summaries import bit_mask_from_words, block_mask_from_state, check_bit_block_size

MASK_KINDS = ("topk", "relu")
BLOCK_REDUCTIONS = ("max", "mean")
# Mask elements expanded at a time by attended_fraction; bounds its temporary memory.
_COUNT_CHUNK_ELEMENTS = 1 << 24


def _sequence_rows(bias, mask, cu_seqlens_k, max_seqlen_k):
    """Packed per-key inputs as one row per sequence: ``(bias, mask, past_end)``, each ``[., ., 1, max_seqlen_k]``.

    The mask keeps only keys inside each sequence; ``past_end`` marks the positions past its end.
    """
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"attention_bias: expected a torch.Tensor, got {type(bias).__name__}")
    bias, cu = packed_rows("attention_bias", bias, cu_seqlens_k, max_seqlen_k, 0.0)
    inside = packed_rows("cu_seqlens_k", bias.new_ones(1, int(cu[-1]), dtype=torch.bool), cu, max_seqlen_k, False)[0]
    if mask is not None:
        mask = packed_rows("attention_mask", mask, cu, max_seqlen_k, False)[0]
        inside = inside & (mask if mask.dtype == torch.bool else mask != 0)
    return bias, inside, ~inside if mask is None else None


def _check_bias(attention_bias, expected: str) -> None:
    if not isinstance(attention_bias, torch.Tensor):
        raise TypeError(f"attention_bias: expected a torch.Tensor, got {type(attention_bias).__name__}")
    if not attention_bias.dtype.is_floating_point:
        raise TypeError(f"attention_bias: expected a floating-point tensor, got {attention_bias.dtype}")
    if attention_bias.dim() != 4:
        raise ValueError(f"attention_bias: expected a 4-D tensor {expected}, got shape {tuple(attention_bias.shape)}")


def _as_bool(name: str, mask, device: torch.device, owner: str) -> torch.Tensor:
    """``mask``, a bool (True = keep) or 0/1 integer tensor on ``device`` (that of ``owner``), as bool."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name}: expected a bool (True = keep) or 0/1 integer tensor, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {owner}), got {mask.device}")
    return mask if mask.dtype == torch.bool else mask != 0


def _allowed_keys(
    attention_mask, key_len: int, query_len: int | None, batch_size: int | None, device: torch.device
) -> torch.Tensor | None:
    """The caller's mask as a 4-D bool tensor (True = the key may be selected), or None.

    A 2-D padding mask ``[B, L]`` is aligned to the key axis: ``L == key_len`` covers every key, and
    ``L == query_len < key_len`` covers the newest keys (the queries' own tokens), the earlier ones
    (a KV cache) counting as real tokens. A 4-D mask is returned as is (as bool). It must be on
    ``device`` (that of the bias).
    """
    if attention_mask is None:
        return None
    allowed = _as_bool("attention_mask", attention_mask, device, "attention_bias")
    if allowed.dim() == 4:
        if allowed.shape[-1] != key_len:
            raise ValueError(
                f"attention_mask: expected the last dimension to be key_len = {key_len}, got shape {tuple(allowed.shape)}"
            )
        return allowed
    if allowed.dim() != 2:
        raise ValueError(
            f"attention_mask: expected a 2-D padding mask [B, key_len] or a 4-D mask [1|B, 1|H, 1|Sq, key_len], "
            f"got shape {tuple(allowed.shape)}"
        )
    if batch_size is not None and allowed.shape[0] != batch_size:
        raise ValueError(f"attention_mask: expected batch size {batch_size}, got shape {tuple(allowed.shape)}")
    length = allowed.shape[1]
    if length == key_len:
        return allowed[:, None, None, :]
    if query_len is not None and length == query_len < key_len:
        cached = allowed.new_ones(allowed.shape[0], key_len - query_len)
        return torch.cat([cached, allowed], dim=1)[:, None, None, :]
    lengths = f"key_len = {key_len}" + ("" if query_len is None else f" or query_len = {query_len}")
    raise ValueError(f"attention_mask: a 2-D padding mask must have length {lengths}, got shape {tuple(allowed.shape)}")


def _broadcast(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return torch.broadcast_tensors(a, b)
    except RuntimeError:
        raise ValueError(
            f"{name}: shape {tuple(b.shape)} does not broadcast with attention_bias of shape {tuple(a.shape)}"
        ) from None


def _keep_largest(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Per row (last dimension), the ``k`` largest ``scores`` among the ``allowed`` entries.

    Args:
        scores: ``[..., N]`` float.
        allowed: bool, broadcastable to ``scores``; entries that are False are never kept, nor are NaN scores.
        k: entries to keep per row; rows with fewer allowed entries keep all of them.

    Returns:
        bool ``[..., N]`` (the broadcast shape). Ties at the k-th score are broken towards the lower
        index, so the result does not depend on the device or on ``torch.topk``'s internal order.
    """
    scores, allowed = torch.broadcast_tensors(scores, allowed)
    allowed = allowed & ~torch.isnan(scores)  # a new tensor of the broadcast shape
    if k >= scores.shape[-1]:
        return allowed
    if k == 0:
        return torch.zeros_like(allowed)
    ranked = scores.masked_fill(~allowed, float("-inf"))
    # The k-th largest value is the same whichever tied entries topk returns; only the indices vary.
    kth = ranked.topk(k, dim=-1).values[..., -1:]
    above = ranked > kth
    tied = allowed & (ranked == kth)
    room = k - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def _key_blocks(t: torch.Tensor, block: int, fill) -> torch.Tensor:
    """``[..., Sk]`` -> ``[..., ceil(Sk / block), block]``, the last block padded with ``fill``."""
    pad = cdiv(t.shape[-1], block) * block - t.shape[-1]
    padded = torch.nn.functional.pad(t, (0, pad), value=fill)
    return padded.view(*t.shape[:-1], -1, block)


def _key_block_lengths(key_len: int, block: int, device) -> torch.Tensor:
    """``[ceil(Sk / block)]`` int: the number of real keys in each key block (the last may be short)."""
    starts = torch.arange(0, key_len, block, device=device)
    return torch.clamp(key_len - starts, max=block)


def _majority_per_block(keep: torch.Tensor, block: int) -> torch.Tensor:
    """Each block of ``block`` keys kept whole if more than half of its keys are kept, else dropped."""
    key_len = keep.shape[-1]
    counts = _key_blocks(keep, block, False).sum(dim=-1)
    blocks_kept = 2 * counts > _key_block_lengths(key_len, block, keep.device)
    return blocks_kept.repeat_interleave(block, dim=-1)[..., :key_len]


def create_mask(
    attention_bias: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    batch_size: int | None = None,
    query_len: int | None = None,
    key_len: int | None = None,
    window_size: int | None = None,
    min_dtype: float | None = None,
    block_size: int | None = None,
    *,
    kind: str = "topk",
    packed: bool = False,
    is_causal: bool = False,
) -> torch.Tensor | BitMask | KeyIntervals:
    """A token-level dynamic mask: the keys with the largest bias, per row of the bias.

    The arguments are those of the earlier Flash-DMA ``create_mask``, except that its ``type`` is the
    keyword ``kind`` here (``type`` would hide the builtin). Unlike it, a window at least
    as long as the keys keeps every allowed key, ties are broken deterministically (towards the
    lower key index), masked keys are never selected (also after block smoothing), and the result
    has the broadcast shape of its inputs: a per-key bias gives a per-key mask, never ``[Sq, Sk]``.

    Args:
        attention_bias: ``[1|B, 1|Hkv|H, 1|Sq, Sk]`` float, the per-key (or per-pair) importance.
            It is read under ``torch.no_grad``; no gradient flows through the selection.
        attention_mask: None, a 2-D padding mask ``[B, Sk]`` (or ``[B, Sq]`` covering the newest
            ``Sq`` keys, the earlier ones being a cache of real tokens), or a 4-D mask broadcastable
            with the bias. Bool (True = may be selected) or 0/1 integer, on the bias's device.
        batch_size: B; by default the first dimension of ``attention_mask``, else of the bias.
        query_len: Sq; by default the bias's third dimension.
        key_len: Sk, the bias's last dimension (the default).
        window_size: with ``kind="topk"``, the number of keys kept per row, at least 1 (all allowed
            keys when ``window_size >= key_len``). Not used by ``kind="relu"``.
        min_dtype: if given, keys whose bias is ``<= min_dtype`` count as masked (for a bias that
            already carries an additive mask, such as ``torch.finfo(dtype).min``).
        block_size: if given, after selection every run of ``block_size`` keys (the last one may be
            shorter) is kept whole if more than half of it was selected and dropped otherwise, so that
            whole tiles can be skipped; masked keys stay unselected.
        kind: ``"topk"``: the ``window_size`` largest-bias keys per row; ``"relu"``: the keys whose
            bias is > 0.
        packed: return a :class:`~flash_dma.BitMask` (one bit per pair, with its block summary),
            selected and packed a chunk of query rows at a time, so that no ``[Sq, Sk]`` bool
            tensor exists at once: the form to pass for a per-pair bias's per-query selection.
        is_causal: each of the ``query_len`` queries selects among the keys it sees under the
            causal rule (key ``j <= i + key_len - query_len``, bottom-right as in
            ``flash_dma_func``), and the mask holds that rule. With a per-key bias, ``kind="topk"``,
            no ``block_size`` and a per-key (or padding) ``attention_mask``, the result is that
            selection as :class:`~flash_dma.KeyIntervals` (one run of queries per key, made by
            :func:`causal_topk_intervals`: nothing ``[Sq, Sk]``, whatever ``packed`` says); with
            other inputs, the per-query bool mask (a ``BitMask`` with ``packed``).

    Returns:
        bool, the broadcast shape of ``attention_bias`` and the (aligned) ``attention_mask`` (with
        ``is_causal``, ``query_len`` rows); True = attend (with ``packed``, that mask as a
        ``BitMask``; see ``is_causal`` for ``KeyIntervals``). Pass it as
        ``flash_dma_func(attn_mask=...)`` together with the bias.
    """
    _check_bias(attention_bias, "[1|B, 1|Hkv|H, 1|Sq, Sk]")
    # What is not given is inferred from the inputs, as the earlier Flash-DMA did.
    if batch_size is None:
        batch_size = (attention_mask if isinstance(attention_mask, torch.Tensor) else attention_bias).shape[0]
    query_len = attention_bias.shape[2] if query_len is None else query_len
    key_len = attention_bias.shape[3] if key_len is None else key_len
    for name, value, minimum in (("batch_size", batch_size, 1), ("query_len", query_len, 1), ("key_len", key_len, 0)):
        check_int(name, value, minimum)
    check_choice("kind", kind, MASK_KINDS)
    bias_batch, _, bias_rows, bias_keys = attention_bias.shape
    if bias_batch not in (1, batch_size) or bias_rows not in (1, query_len) or bias_keys != key_len:
        raise ValueError(
            f"attention_bias: expected shape [{sizes_allowed(1, batch_size)}, heads, {sizes_allowed(1, query_len)}, {key_len}] for "
            f"batch_size={batch_size}, query_len={query_len}, key_len={key_len}, got {tuple(attention_bias.shape)}"
        )
    if kind == "topk":
        check_int("window_size", window_size, 1)  # 0 would select no key: every output 0
    if min_dtype is not None and (isinstance(min_dtype, bool) or not isinstance(min_dtype, (int, float))):
        raise TypeError(f"min_dtype: expected a float or None, got {type(min_dtype).__name__} {min_dtype!r}")
    if block_size is not None:
        check_int("block_size", block_size, 1)
    for name, flag in (("packed", packed), ("is_causal", is_causal)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
    allowed = _allowed_keys(attention_mask, key_len, query_len, batch_size, attention_bias.device)

    with torch.no_grad():
        bias = attention_bias.detach()
        masked = allowed is not None or min_dtype is not None
        if allowed is None:
            allowed = torch.ones((), dtype=torch.bool, device=bias.device)
        bias, allowed = _broadcast("attention_mask", bias, allowed)  # views: nothing is copied
        if is_causal and kind == "topk" and block_size is None and bias.shape[2] == 1:
            # A per-key selection under the causal rule: one run of queries per key.
            keys = allowed[:, :, 0] if min_dtype is None else allowed[:, :, 0] & (bias[:, :, 0] > min_dtype)
            return causal_topk_intervals(bias[:, :, 0], window_size, keys if masked else None, query_len=query_len)
        if is_causal:  # each row its own visible keys
            bias, allowed = (t.expand(*t.shape[:2], query_len, key_len) for t in (bias, allowed))

        def select(start: int, stop: int) -> torch.Tensor:
            """The selection of rows ``[start, stop)`` (the one row, if the inputs broadcast over rows)."""
            rows_bias, rows_allowed = (t[:, :, start:stop] if t.shape[2] > 1 else t for t in (bias, allowed))
            if is_causal:
                rows = torch.arange(start, stop, device=bias.device)
                rows_allowed = rows_allowed & visible_positions(rows, query_len, key_len, (UNBOUNDED, 0))
            if min_dtype is not None:
                rows_allowed = rows_allowed & (rows_bias > min_dtype)
            if kind == "topk":
                keep = _keep_largest(rows_bias, rows_allowed, window_size)
            else:
                keep = rows_allowed & (rows_bias > 0)
            if block_size is not None and block_size > 1:
                keep = _majority_per_block(keep, block_size) & rows_allowed
            return keep

        rows = bias.shape[2]
        if not packed:
            return select(0, rows)
        shape = (*bias.shape[:2], rows, key_len)
        return bit_mask_from_words(pack_words(select, shape, bias.device), shape)


def _check_rows(name: str, t, expected: str) -> None:
    """``t`` must be an int32 ``[Bm, Hm, Sk]`` tensor of interval rows."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D tensor {expected}, got shape {tuple(t.shape)}")


def _intervals(start: torch.Tensor | None, end: torch.Tensor, query_len: int, block_size) -> KeyIntervals:
    """The :class:`KeyIntervals` of checked ``start``/``end`` ``[Bm, Hm, Sk]`` over ``query_len`` rows,
    with its summary (on CUDA, and under the interpreter, from the kernels of
    ``backends/triton/key_intervals.py``)."""
    shape = (end.shape[0], end.shape[1], query_len, end.shape[2])
    if unavailable_reason("triton", end.device) is None:
        state = interval_state(start, end, query_len, *block_size)
    else:
        state = interval_states(start, end, query_len, block_size)
    return KeyIntervals(start, end, shape, block_mask_from_state(state, shape, block_size, needs_mask=True))


def interval_mask(
    end: torch.Tensor,
    start: torch.Tensor | None = None,
    *,
    query_len: int,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> KeyIntervals:
    """The mask that keeps key ``j`` for the query rows ``[start_j, end_j)``, as :class:`KeyIntervals`.

    Args:
        end: ``[Bm, Hm, Sk]`` int32, one past the last query row of each key (``Bm`` 1 or B, ``Hm``
            1, Hkv or H, as for any mask); rows past ``query_len`` and below 0 are simply absent.
        start: ``[Bm, Hm, Sk]`` int32, each key's first query row, or None for 0 (every key from the
            first query on; a causal rule then comes from ``flash_dma_func(is_causal=True)``).
        query_len: Sq, the rows of the mask.
        block_size: ``(block_q, block_k)`` of its summary (``block_mask.SUPPORTED_BLOCK_SIZES``).

    Returns:
        A :class:`KeyIntervals` of shape ``(Bm, Hm, query_len, Sk)`` on ``end``'s device; its
        summary is exact and no ``[Sq, Sk]`` tensor is made (O(Sk) work per query block).
    """
    _check_rows("end", end, "[Bm, Hm, Sk]")
    if start is not None:
        _check_rows("start", start, "[Bm, Hm, Sk]")
        if start.shape != end.shape:
            raise ValueError(f"start: expected the shape of end, {tuple(end.shape)}, got {tuple(start.shape)}")
        if start.device != end.device:
            raise ValueError(f"start: expected the device of end, {end.device}, got {start.device}")
    check_int("query_len", query_len, 1)
    if end.shape[2] < 1:
        raise ValueError(f"end: expected at least one key, got shape {tuple(end.shape)}")
    check_block_size(block_size)
    return _intervals(start, end, query_len, block_size)


def _key_mask(key_mask, scores: torch.Tensor) -> torch.Tensor | None:
    """A causal top-k's ``key_mask`` as bool ``[B, H, Sk]`` broadcasting with ``scores`` (True = may be kept), or None."""
    if key_mask is None:
        return None
    mask = _as_bool("key_mask", key_mask, scores.device, "scores")
    mask = mask[:, None, :] if mask.dim() == 2 else mask
    fits = mask.dim() == 3 and mask.shape[2] == scores.shape[2]
    if not fits or any(m != s and 1 not in (m, s) for m, s in zip(mask.shape[:2], scores.shape[:2])):
        raise ValueError(
            f"key_mask: expected a padding mask [B, Sk] or a mask [B, H, Sk] that broadcasts with scores of shape "
            f"{tuple(scores.shape)}, got shape {tuple(key_mask.shape)}"
        )
    return mask


def causal_topk_intervals(
    scores: torch.Tensor,
    keep: int,
    key_mask: torch.Tensor | None = None,
    *,
    query_len: int,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> KeyIntervals:
    """Each query's ``keep`` best keys among those it sees under the causal rule, as key intervals.

    Query row ``i`` sees keys ``j <= i + Sk - Sq`` (bottom-right, as ``flash_dma_func(is_causal=True)``)
    that ``key_mask`` allows, and keeps the ``keep`` of them with the highest ``scores`` (all, if it
    sees fewer); among equal scores the lower key index wins, and a NaN score is never kept. This
    is ``create_mask`` over a per-key bias with a causal mask, and Doge's selection. Visible keys
    only accumulate from one query to the next, so each key is kept by one run of queries: from
    the first that sees it to the first that sees ``keep`` keys outranking it. One kernel launch
    per call on CUDA computes those runs; nothing of size ``[Sq, Sk]`` is made, nor sorted.

    Args:
        scores: ``[B, H, Sk]`` float, a score per key (Doge's ``dt_states``), compared in its own
            dtype. Read under ``torch.no_grad``; the selection carries no gradient.
        keep: keys kept per query, at least 0.
        key_mask: None, a padding mask ``[B, Sk]``, or ``[B, H, Sk]``, either broadcasting with the
            scores (size-1 axes on either side): bool (True = may be kept) or 0/1 integer, on the
            scores' device.
        query_len: Sq; the queries are the last ``Sq`` positions of the keys (a KV cache holds the
            earlier ones), or, with ``Sq > Sk``, the first ``Sq - Sk`` queries see no key.
        block_size: of the summary, as for :func:`interval_mask`.

    Returns:
        :class:`KeyIntervals` ``(B, H, Sq, Sk)`` (the broadcast batch and heads of ``scores`` and
        ``key_mask``) holding the causal rule too (``start`` is each
        key's first visible row), so that it attends the same with or without ``is_causal``.
    """
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores: expected a torch.Tensor, got {type(scores).__name__}")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"scores: expected a floating-point tensor, got {scores.dtype}")
    if scores.dim() != 3 or scores.shape[2] < 1:
        raise ValueError(f"scores: expected a 3-D tensor [Bm, Hm, Sk] with Sk >= 1, got shape {tuple(scores.shape)}")
    check_int("keep", keep, 0)
    check_int("query_len", query_len, 1)
    check_block_size(block_size)
    allowed = _key_mask(key_mask, scores)
    with torch.no_grad():
        scores = scores.detach()
        if allowed is not None:
            scores, allowed = torch.broadcast_tensors(scores, allowed)  # views: nothing is copied
        if unavailable_reason("triton", scores.device) is None:
            end = causal_topk_end_rows(scores, allowed, keep, query_len)
        else:
            end = causal_topk_ends(scores, allowed, keep, query_len)
        start = causal_starts(query_len, scores.shape[2], scores.device).expand(end.shape)
        return _intervals(start, end, query_len, block_size)


def indices_to_mask(
    indices: torch.Tensor, key_len: int, *, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> BitMask:
    """The :class:`~flash_dma.BitMask` of keys chosen per query: for callers who select keys themselves.

    Args:
        indices: ``[B, H, Sq, W]`` integer, the keys each query attends (``H`` is 1, Hkv or H, as
            for a mask); entries < 0 mean none (``-1`` pads rows that choose fewer than W keys).
            Repeated entries count once. Every entry must be < ``key_len``.
        key_len: Sk.
        block_size: ``(block_q, block_k)`` of the summary; ``block_k >= 32``.

    Returns:
        A :class:`~flash_dma.BitMask` of shape ``[B, H, Sq, key_len]``, built a chunk of query rows at
        a time (no ``[Sq, Sk]`` tensor at once). The values are checked on the host (one
        synchronisation), except inside a CUDA graph capture or ``torch.compile``.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"indices: expected an integer tensor, got {indices.dtype}")
    if indices.dim() != 4:
        raise ValueError(f"indices: expected a 4-D tensor [B, H, Sq, W], got shape {tuple(indices.shape)}")
    check_int("key_len", key_len, 1)
    check_bit_block_size(block_size)
    if values_checkable(indices) and indices.numel() and int(indices.max()) >= key_len:
        raise ValueError(f"indices: every entry must be < key_len = {key_len}, got {int(indices.max())}")
    return listed_bit_mask(indices, key_len, block_size)


def listed_bit_mask(indices: torch.Tensor, key_len: int, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> BitMask:
    """:func:`indices_to_mask` without its checks, so without a host synchronisation: ``indices``
    ``[B, H, Sq, W]`` integer must hold only entries < ``key_len`` (those < 0 mean none)."""
    batch, heads, rows, _ = indices.shape

    def select(start: int, stop: int) -> torch.Tensor:
        chosen = indices[:, :, start:stop].long()
        # Entries < 0 go to a spare column past the keys, cut off after: every write is True.
        chosen = torch.where(chosen < 0, key_len, chosen)
        keep = torch.zeros(batch, heads, stop - start, key_len + 1, dtype=torch.bool, device=indices.device)
        return keep.scatter_(-1, chosen, True)[..., :key_len]

    shape = (batch, heads, rows, key_len)
    return bit_mask_from_words(pack_words(select, shape, indices.device), shape, block_size)


def topk_indices(
    scores: torch.Tensor,
    width: int,
    *,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
) -> torch.Tensor:
    """Each query's ``width`` highest-scoring visible keys, as the ``indices`` of :func:`flash_dma.flash_dma_topk_func`.

    Args:
        scores: ``[B, Hkv, Sq, Sk]`` float, an indexer's score per (query, key) and key/value head
            (DSA's lightning indexer); read under ``torch.no_grad``. NaN scores are never chosen.
        width: W, keys per query, at least 1.
        is_causal, window_size: only keys that ``flash_dma_func`` would show the query (bottom-right
            aligned) are chosen.

    Returns:
        ``[B, Sq, Hkv, W]`` int32: the chosen keys in ascending order, then ``-1`` where a query sees
        fewer than W keys. Ties go to the lower key index. Rows are selected a chunk at a time, so
        that no tensor of ``[Sq, Sk]`` per head exists beyond ``scores`` itself
        (:func:`chunked_topk_indices` makes none at all).
    """
    if not isinstance(scores, torch.Tensor) or not scores.dtype.is_floating_point:
        raise TypeError(f"scores: expected a floating-point torch.Tensor, got {getattr(scores, 'dtype', type(scores).__name__)}")
    if scores.dim() != 4:
        raise ValueError(f"scores: expected a 4-D tensor [B, Hkv, Sq, Sk], got shape {tuple(scores.shape)}")
    return chunked_topk_indices(
        lambda start, stop: scores[:, :, start:stop], tuple(scores.shape), width, is_causal=is_causal,
        window_size=window_size, device=scores.device,
    )


def chunked_topk_indices(
    score_rows,
    shape: tuple[int, int, int, int],
    width: int,
    *,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    device: torch.device | str,
) -> torch.Tensor:
    """:func:`topk_indices` of scores made a chunk of query rows at a time, so that no ``[Sq, Sk]``
    tensor exists at all: for an indexer that scores its queries chunk by chunk.

    Args:
        score_rows: ``score_rows(start, stop)`` -> float ``[B, Hkv, stop - start, Sk]``, the scores
            of query rows ``[start, stop)``; called under ``torch.no_grad``, once per chunk of
            about ``2**24 / (B * Hkv * Sk)`` rows. NaN scores are never chosen.
        shape: ``(B, Hkv, Sq, Sk)`` of the whole score matrix.
        width, is_causal, window_size: as for :func:`topk_indices`.
        device: the device of the scores, where the indices are made.

    Returns:
        ``[B, Sq, Hkv, W]`` int32, as :func:`topk_indices`.
    """
    check_int("width", width, 1)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__} {is_causal!r}")
    if not (isinstance(shape, (tuple, list)) and len(shape) == 4):
        raise ValueError(f"shape: expected (B, Hkv, Sq, Sk), got {shape!r}")
    for name, size in zip(("B", "Hkv", "Sq", "Sk"), shape):
        check_int(f"shape {name}", size, 0)
    window = _normalize_window(window_size, is_causal)
    batch, heads, query_len, key_len = shape
    indices = torch.full((batch, query_len, heads, width), -1, dtype=torch.int32, device=device)
    rows_per_chunk = max(1, _COUNT_CHUNK_ELEMENTS // max(1, batch * heads * key_len))
    with torch.no_grad():
        for start in range(0, query_len, rows_per_chunk):
            stop = min(query_len, start + rows_per_chunk)
            scores = score_rows(start, stop)
            if tuple(scores.shape) != (batch, heads, stop - start, key_len):
                raise ValueError(
                    f"score_rows: expected rows {start}:{stop} of shape {(batch, heads, stop - start, key_len)}, "
                    f"got {tuple(scores.shape)}"
                )
            visible = visible_positions(torch.arange(start, stop, device=indices.device), query_len, key_len, window)
            keep = _keep_largest(scores, visible, width)  # [B, Hkv, c, Sk]
            # Kept keys first, in ascending order (a stable sort of the kept flags), then the rest.
            chosen = torch.sort(keep.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
            taken = keep.sum(dim=-1, keepdim=True) > torch.arange(chosen.shape[-1], device=indices.device)
            indices[:, start:stop, :, : chosen.shape[-1]] = torch.where(taken, chosen, -1).to(torch.int32).transpose(1, 2)
    return indices


def topk_mask(indices: torch.Tensor, key_len: int, *, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> BitMask:
    """The :class:`~flash_dma.BitMask` ``[B, Hkv, Sq, key_len]`` of top-k ``indices`` ``[B, Sq, Hkv, W]``
    (those of :func:`flash_dma.flash_dma_topk_func`): for short sequences, where the dense per-query
    path is faster. ``flash_dma_func(q, k, v, topk_mask(indices, Sk), bias, is_causal=...)`` then
    attends what ``flash_dma_topk_func`` attends when no key is listed twice (a mask holds a key
    once). Entries < 0 mean none; an entry ``>= key_len`` is a ``ValueError`` (as in :func:`indices_to_mask`)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dim() != 4:
        raise ValueError(f"indices: expected a 4-D tensor [B, Sq, Hkv, W], got shape {tuple(indices.shape)}")
    return indices_to_mask(indices.transpose(1, 2), key_len, block_size=block_size)


def _query_block_layout(
    query_len: int, key_len: int, block_size: tuple[int, int], is_causal: bool, local_blocks: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(visible, local)``, each ``[NQB, NKB]`` bool, for blocks of ``block_size``.

    ``visible``: some query of the query block may see some key of the key block (always true
    without ``is_causal``). ``local``: the key block holding the query block's diagonal (the key
    aligned with its queries, bottom-right as in ``flash_dma_func``) and the ``local_blocks - 1``
    key blocks before it; empty when ``local_blocks == 0``.
    """
    block_q, block_k = block_size
    first_row = torch.arange(0, query_len, block_q, device=device)
    last_row = torch.clamp(first_row + block_q, max=query_len) - 1
    # The diagonal key of query i is i + Sk - Sq; it may lie before key 0 when Sq > Sk.
    diagonal_first = first_row + (key_len - query_len)
    diagonal_last = last_row + (key_len - query_len)
    key_block = torch.arange(cdiv(key_len, block_k), device=device)
    if is_causal:
        visible = key_block[None, :] * block_k <= diagonal_last[:, None]
    else:
        visible = torch.ones(len(first_row), len(key_block), dtype=torch.bool, device=device)
    lowest = torch.div(diagonal_first, block_k, rounding_mode="floor") - (local_blocks - 1)
    highest = torch.div(diagonal_last, block_k, rounding_mode="floor")
    local = (key_block[None, :] >= lowest[:, None]) & (key_block[None, :] <= highest[:, None])
    # With no local blocks the range above is still non-empty when a query block spans several key blocks.
    return visible, local & (local_blocks > 0)


def topk_block_mask(
    attention_bias: torch.Tensor,
    window_size: int,
    attention_mask: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    reduce: str = "max",
    query_len: int | None = None,
    is_causal: bool = False,
    sink_blocks: int = 0,
    local_blocks: int = 0,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> BlockMask:
    """Select whole key blocks by their aggregated bias, straight into a :class:`BlockMask`.

    Keys are cut into blocks of ``block_size[1]``; each block is scored by the maximum (or mean) of
    the bias over its allowed keys, and the ``ceil(window_size / block_k)`` best-scoring blocks are
    kept, ties going to the lower block index. Blocks with no allowed key are never selected. The
    result goes to ``flash_dma_func(q, k, v, attn_bias=..., block_mask=...)``; causal and window
    limits are applied there, analytically, as always.

    Two layouts, a documented trade-off:

    - ``query_len=None`` (per key): one selection per (batch, head), shared by all queries. The state
      is ``[Bm, Hm, 1, NKB]``: O(Sk / block_k) memory. Under causal attention a query sees only the
      kept blocks at or before its position, so early queries may see few blocks, or none (their
      output is then 0); ``sink_blocks`` guarantees every query the first blocks.
    - ``query_len=Sq`` (per query block): each block of ``block_q`` queries picks its own blocks among
      those it can see (``is_causal``), plus its ``local_blocks`` diagonal blocks. The state is
      ``[Bm, Hm, NQB, NKB]``: O((Sq / block_q) * (Sk / block_k)) bytes, still no element mask.
      Every query gets its full budget and its local neighbourhood.

    ``reduce="max"`` (the default) keeps a block if any one of its keys matters, which suits sparse
    important tokens (a single key among filler); ``"mean"`` favours blocks whose keys all matter.

    Args:
        attention_bias: ``[1|B, 1|Hkv|H, 1, Sk]`` float, a per-key bias. Read under ``torch.no_grad``.
        window_size: keys to keep per query by bias, rounded up to whole blocks; at least 1, or 0
            to keep only the sink and local blocks (with ``sink_blocks`` or ``local_blocks`` > 0).
        attention_mask: None, a 2-D padding mask ``[B, Sk]`` or a 4-D ``[1|B, 1|H, 1, Sk]`` mask,
            bool (True = real key) or 0/1 integer. A kept block that holds masked keys is PARTIAL,
            so with a mask ``result.needs_mask`` is True and the mask, as 4-D, must go to
            ``flash_dma_func`` as ``attn_mask``. Blocks of only masked keys are never kept.
        block_size: ``(block_q, block_k)``, powers of two from 16 to 256.
        reduce: ``"max"`` or ``"mean"`` of the bias over each block's allowed keys.
        query_len: None for the per-key layout, or Sq for the per-query-block layout.
        is_causal: per-query-block layout only: a query block chooses among the key blocks it can
            see under causal attention (bottom-right aligned).
        sink_blocks: the first ``sink_blocks`` key blocks are always kept, on top of the window.
        local_blocks: per-query-block layout only: the key block holding each query block's diagonal
            and the ``local_blocks - 1`` before it are always kept, on top of the window.
        cu_seqlens_k, max_seqlen_k: packed sequences (``flash_dma_varlen_func``): then
            ``attention_bias`` (and ``attention_mask``, if any) is a packed ``[1|Hkv|H, total_k]``
            or per-sequence ``[1|N, 1|Hkv|H, 1|max_seqlen_k]`` tensor, each sequence selects its
            own blocks, and the result has one entry per sequence, ``mask_shape = (N, Hm, 1,
            max_seqlen_k)``. Per-key layout only. A block cut by a sequence's end is FULL: the
            kernels never read past the end.

    Returns:
        A :class:`BlockMask` of EMPTY/FULL blocks (and PARTIAL ones where padding cuts a kept block),
        with ``mask_shape = (Bm, Hm, 1, Sk)`` per key or ``(Bm, Hm, Sq, Sk)`` per query block.
    """
    # Only a padding mask makes kept blocks PARTIAL (a sequence's end does not): deciding whether
    # one is would wait on the GPU.
    needs_mask = attention_mask is not None
    past_end = None
    if cu_seqlens_k is not None:
        if query_len is not None:
            raise ValueError(
                f"query_len: packed sequences (cu_seqlens_k) use the per-key layout only; pass query_len=None, got {query_len!r}"
            )
        attention_bias, attention_mask, past_end = _sequence_rows(attention_bias, attention_mask, cu_seqlens_k, max_seqlen_k)
    _check_bias(attention_bias, "[1|B, 1|Hkv|H, 1, Sk]")
    if attention_bias.shape[2] != 1:
        raise ValueError(
            f"attention_bias: expected a per-key bias [1|B, 1|Hkv|H, 1, Sk] (query dimension 1), got shape "
            f"{tuple(attention_bias.shape)}; select per-query keys with create_mask and build_block_mask"
        )
    check_block_size(block_size)
    check_choice("reduce", reduce, BLOCK_REDUCTIONS)
    check_int("sink_blocks", sink_blocks, 0)
    check_int("local_blocks", local_blocks, 0)
    # A window of 0 keeps only the forced blocks; without any, it would select nothing (every output 0).
    check_int("window_size", window_size, 0 if sink_blocks or local_blocks else 1)
    if query_len is None:
        for name, value in (("is_causal", is_causal), ("local_blocks", local_blocks)):
            if value:
                raise ValueError(
                    f"{name}: only the per-query-block layout uses it; pass query_len, or (for is_causal) "
                    f"give is_causal to flash_dma_func, which applies it to a per-key selection, got {value!r}"
                )
    else:
        check_int("query_len", query_len, 1)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__} {is_causal!r}")
    key_len = attention_bias.shape[-1]
    block_k = block_size[1]
    allowed = _allowed_keys(attention_mask, key_len, query_len, None, attention_bias.device)
    if allowed is not None and allowed.shape[2] != 1:
        raise ValueError(
            f"attention_mask: expected a per-key mask [1|B, 1|H, 1, Sk] (query dimension 1), got shape {tuple(allowed.shape)}"
        )

    with torch.no_grad():
        bias = attention_bias.detach()
        if allowed is not None:
            bias, allowed = _broadcast("attention_mask", bias, allowed)
        if query_len is None and unavailable_reason("triton", bias.device) is None:
            # One launch (backends/triton/block_topk.py) for what the torch code below does in about 25.
            if past_end is not None:
                past_end = past_end.expand(bias.shape[0], -1, -1, -1)
            state = topk_state(bias, allowed, past_end, block_k, cdiv(window_size, block_k), sink_blocks, reduce == "mean")
            return block_mask_from_state(state, (*bias.shape[:2], 1, key_len), block_size, needs_mask=needs_mask)
        bias = bias.float()
        if allowed is None:
            allowed = torch.ones((), dtype=torch.bool, device=bias.device).expand(bias.shape)
        block_bias = _key_blocks(bias, block_k, 0.0)  # [Bm, Hm, 1, NKB, block_k]
        block_allowed = _key_blocks(allowed, block_k, False)
        allowed_count = block_allowed.sum(dim=-1)  # [Bm, Hm, 1, NKB]
        if reduce == "max":
            score = block_bias.masked_fill(~block_allowed, float("-inf")).amax(dim=-1)
        else:
            score = torch.where(block_allowed, block_bias, 0.0).sum(dim=-1) / allowed_count.clamp(min=1)
        eligible = allowed_count > 0
        if past_end is not None:  # keys past a sequence's end do not exist: they do not make a block partial
            allowed_count = allowed_count + _key_blocks(past_end, block_k, False).sum(dim=-1)
        fully_allowed = allowed_count == _key_block_lengths(key_len, block_k, bias.device)
        key_block = torch.arange(eligible.shape[-1], device=bias.device)
        forced = key_block < sink_blocks
        if query_len is None:
            mask_shape = (*bias.shape[:2], 1, key_len)
        else:
            visible, local = _query_block_layout(query_len, key_len, block_size, is_causal, local_blocks, bias.device)
            eligible = eligible & visible  # [Bm, Hm, NQB, NKB]
            forced = forced | local
            mask_shape = (*bias.shape[:2], query_len, key_len)
        forced = forced & eligible
        selected = forced | _keep_largest(score, eligible & ~forced, cdiv(window_size, block_k))
        state = torch.where(selected, torch.where(fully_allowed, FULL, PARTIAL), EMPTY).to(torch.int8)
    return block_mask_from_state(state, mask_shape, block_size, needs_mask=needs_mask)


def attended_fraction(
    seqlen_q: int,
    seqlen_k: int,
    attn_mask: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    *,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
) -> float:
    """The fraction of (query, key) pairs that ``flash_dma_func`` attends with these masks.

    It counts the pairs that the masks let through and that the causal/window limits leave
    visible, over the pairs that those limits leave visible on their own, averaged over the batch
    and heads of the masks. Query rows are expanded a chunk at a time, so memory stays bounded.

    Args:
        seqlen_q, seqlen_k: Sq and Sk of the attention call.
        attn_mask: ``[1|B, 1|H, 1|Sq, Sk]`` bool or 0/1 integer, or None.
        block_mask: a :class:`BlockMask`, or None.
        is_causal, window_size: as given to ``flash_dma_func``.

    Returns:
        A float in [0, 1]; 0 when no pair is visible at all.
    """
    check_int("seqlen_q", seqlen_q, 1)
    check_int("seqlen_k", seqlen_k, 1)
    if attn_mask is not None and (attn_mask.dim() != 4 or attn_mask.shape[-1] != seqlen_k):
        raise ValueError(
            f"attn_mask: expected a 4-D mask [1|B, 1|H, 1|Sq, {seqlen_k}], got shape {tuple(attn_mask.shape)}"
        )
    if block_mask is not None and block_mask.needs_mask and attn_mask is None:
        raise ValueError("block_mask: it may hold partial blocks, so its element-wise mask must be given as attn_mask")
    window = (window_size[0], 0) if is_causal else tuple(window_size)
    masks = [m for m in (attn_mask, None if block_mask is None else block_mask.state) if m is not None]
    device = masks[0].device if masks else torch.device("cpu")
    head_entries = max((m.shape[0] * m.shape[1] for m in masks), default=1)
    rows_per_chunk = max(1, _COUNT_CHUNK_ELEMENTS // (head_entries * seqlen_k))
    attended = visible_pairs = 0
    for start in range(0, seqlen_q, rows_per_chunk):
        stop = min(seqlen_q, start + rows_per_chunk)
        visible = visible_positions(torch.arange(start, stop, device=device), seqlen_q, seqlen_k, window)
        through = effective_mask_rows(attn_mask, block_mask, start, stop, seqlen_k)
        if through is None:
            attended += int(visible.sum())
        else:
            # Mean over the masks' (batch, head) entries of the pairs each lets through.
            attended += float((through & visible).sum(dim=(2, 3)).double().mean())
        visible_pairs += int(visible.sum())
    return attended / visible_pairs if visible_pairs else 0.0
