"""KV-cache inputs of :func:`flash_dma.flash_dma_with_kvcache`: validation, appending, and reading back.

A cache is contiguous, ``[B_cache, S_cache, Hkv, D]`` (entry b uses row ``cache_batch_idx[b]``,
default b), or paged, ``[num_pages, page_size, Hkv, D]`` with ``block_table[b, i]`` the page that
holds entry b's keys ``i * page_size`` to ``(i + 1) * page_size - 1``. A per-key bias lives in
the same layout without the head dim: ``[B_cache, S_cache, 1|Hkv|H]`` or ``[num_pages,
page_size, 1|Hkv|H]``, so that a layer appends its keys' importance along with the keys.

Entry b holds ``cache_seqlens[b]`` keys; new keys are written at positions ``cache_seqlens[b]``
onwards, then attention sees positions ``[0, cache_seqlens[b] + S_new)``. Nothing else of the
cache is read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dma.bit_mask import BitMask
from flash_dma.inputs import AttentionProblem, _check_qkv, bias_dtypes, check_mask, normalize_settings
from flash_dma.key_intervals import KeyIntervals
from flash_dma.memo import CheckedValues
from flash_dma.packed import SEQLEN_DTYPES, values_checkable

_CHECKED = CheckedValues()


@dataclass(frozen=True)
class CachedProblem:
    """One validated ``flash_dma_with_kvcache`` call, the new keys already appended.

    ``problem`` holds q, the caches as K/V (a paged cache as one ``[1, pages * page_size, Hkv,
    D]`` pool), the mask, and the bias as ``[B_cache, Hm, 1, S_cache]`` (``[1, Hm, 1, pages *
    page_size]`` paged); its entries are ``(B, Sq, capacity, H, Hkv, D)``.
    """

    problem: AttentionProblem
    seqlens_k: torch.Tensor  # [B] int32: keys per entry, the new ones included
    cache_rows: torch.Tensor | None  # [B] int32 cache_batch_idx
    block_table: torch.Tensor | None  # [B, max_pages] int32
    page_size: int
    capacity: int  # key positions an entry can hold
    num_splits: int


def _check_index_tensor(name: str, t, dims: int, layout: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in SEQLEN_DTYPES:
        raise TypeError(f"{name}: expected dtype torch.int32 or torch.int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")


def _check_new(name: str, t, expected: tuple, q: torch.Tensor) -> None:
    """``expected``: per dimension, its size, what it is and whose it is, so that a mismatch names the
    dimension and the argument that disagrees."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() != len(expected):
        raise ValueError(f"{name}: expected a {len(expected)}-D tensor, got shape {tuple(t.shape)}")
    for size, (want, what, whose) in zip(t.shape, expected):
        if size != want:
            raise ValueError(f"{name}: expected {what} {want} (that of {whose}), got {size} (shape {tuple(t.shape)})")
    if t.device != q.device:
        raise ValueError(f"{name}: expected device {q.device} (the device of q), got {t.device}")


def _check_bias_cache(bias_cache, k_cache: torch.Tensor, q: torch.Tensor) -> None:
    slots, heads = k_cache.shape[:2], (1, k_cache.shape[2], q.shape[2])
    if not isinstance(bias_cache, torch.Tensor):
        raise TypeError(f"bias_cache: expected a torch.Tensor or None, got {type(bias_cache).__name__}")
    if bias_cache.dim() != 3 or tuple(bias_cache.shape[:2]) != tuple(slots) or bias_cache.shape[2] not in heads:
        raise ValueError(
            f"bias_cache: expected shape [{slots[0]}, {slots[1]}, 1|Hkv|H] (the cache's layout, one value "
            f"per key and head, heads in {sorted(set(heads))}), got {tuple(bias_cache.shape)}"
        )
    if bias_cache.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"bias_cache: expected dtype {bias_dtypes(q.dtype, 'q')}, got {bias_cache.dtype}")
    if bias_cache.device != q.device:
        raise ValueError(f"bias_cache: expected device {q.device} (the device of q), got {bias_cache.device}")


def _check_values(seqlens, new: int, capacity: int, cache_rows, block_table, page_size: int, blocks: int):
    """The value checks that need the host to read device tensors (skipped inside graphs and
    traces, and for tensors that passed them unchanged: ``_CHECKED``).

    ``blocks`` is the cache's first dimension: its rows, or with a block table its pages.
    """
    lengths = seqlens.tolist()
    if min(lengths) < 0:
        raise ValueError(f"cache_seqlens: expected values >= 0, got {lengths}")
    if max(lengths) + new > capacity:
        raise ValueError(
            f"cache_seqlens: an entry holds {max(lengths)} keys, and {new} new ones do not fit in its "
            f"{capacity} slots (cache_seqlens + new keys must be <= {capacity})"
        )
    if cache_rows is not None and not all(0 <= r < blocks for r in cache_rows.tolist()):
        raise ValueError(f"cache_batch_idx: expected rows in [0, {blocks}), got {cache_rows.tolist()}")
    if block_table is not None:
        used = [(n + new + page_size - 1) // page_size for n in lengths]
        table = block_table.tolist()
        for b, (row, count) in enumerate(zip(table, used)):
            bad = [p for p in row[:count] if not 0 <= p < blocks]
            if bad:
                raise ValueError(
                    f"block_table: entry {b} uses pages {row[:count]}, of which {bad} are not in [0, {blocks})"
                )


def append_keys(k_cache, v_cache, bias_cache, k, v, bias, seqlens, cache_rows, block_table, page_size, capacity):
    """Write the new keys, values and bias at positions ``seqlens[b]`` onwards of each entry.

    Indices are clamped into the cache, so that unchecked values (inside a CUDA graph) can at
    worst overwrite a slot of their own entry, never memory outside the cache.
    """
    batch, new = k.shape[:2]
    positions = (seqlens[:, None].long() + torch.arange(new, device=k.device)).clamp(max=capacity - 1)  # [B, S_new]
    if block_table is None:
        rows = torch.arange(batch, device=k.device) if cache_rows is None else cache_rows.long()
        index = (rows.clamp(0, k_cache.shape[0] - 1)[:, None].expand(batch, new), positions)
    else:
        pages = block_table.long().gather(1, positions // page_size).clamp(0, k_cache.shape[0] - 1)
        index = (pages, positions % page_size)
    k_cache[index] = k
    v_cache[index] = v
    if bias is not None:
        bias_cache[index] = bias.to(bias_cache.dtype)


def normalize_kvcache_inputs(
    q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, attn_mask, bias_cache, bias,
    num_splits, **settings,
) -> CachedProblem:
    """Validate the arguments of :func:`flash_dma.flash_dma_with_kvcache`, then append the new keys."""
    _check_qkv(q, k_cache, v_cache, same_batch=False, names=("q", "k_cache", "v_cache"))
    batch, seqlen_q = q.shape[0], q.shape[1]
    paged = block_table is not None
    if paged:
        _check_index_tensor("block_table", block_table, 2, "[B, max_pages]", q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table: expected {batch} rows (the batch of q), got shape {tuple(block_table.shape)}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: a paged cache finds each entry's pages in block_table; pass None")
        page_size = k_cache.shape[1]
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(0) != page_size * t.stride(1):
                raise ValueError(f"{name}: a paged cache's pages must be contiguous runs of slots, got strides {t.stride()}")
        capacity = block_table.shape[1] * page_size
        # The pool of pages as one batch row: the table gives every key's row in it.
        k_view, v_view = k_cache.flatten(0, 1)[None], v_cache.flatten(0, 1)[None]
    else:
        page_size, capacity = 0, k_cache.shape[1]
        k_view, v_view = k_cache, v_cache
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: expected {batch} rows (the batch of q) without cache_batch_idx, got {k_cache.shape[0]}")
        if cache_batch_idx is not None:
            _check_index_tensor("cache_batch_idx", cache_batch_idx, 1, "[B]", q.device)
            if cache_batch_idx.shape[0] != batch:
                raise ValueError(f"cache_batch_idx: expected {batch} entries (the batch of q), got {cache_batch_idx.shape[0]}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dimension must be contiguous (stride 1), got strides {t.stride()}")

    new = 0
    if (k is None) != (v is None):
        raise ValueError(f"k, v: pass both new keys and new values or neither, got k={type(k).__name__}, v={type(v).__name__}")
    if k is not None:
        new = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
        expected = ((batch, "batch size", "q"), (new, "number of new keys", "k"),
                    (k_cache.shape[2], "number of heads", "k_cache"), (k_cache.shape[3], "head dim", "k_cache"))
        for name, t in (("k", k), ("v", v)):
            _check_new(name, t, expected, q)
            if t.dtype != k_cache.dtype:
                raise TypeError(f"{name}: expected dtype {k_cache.dtype} (that of the cache), got {t.dtype}")
    if bias_cache is not None:
        _check_bias_cache(bias_cache, k_cache, q)
    if bias is not None:
        if bias_cache is None or k is None:
            raise ValueError("bias: new bias values are appended to bias_cache along with new keys k; pass all three")
        _check_new("bias", bias, ((batch, "batch size", "q"), (new, "number of new keys", "k"),
                                  (bias_cache.shape[2], "number of heads", "bias_cache")), q)

    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor, type(None))):
        raise TypeError(f"cache_seqlens: expected an int, a [B] int32 tensor or None, got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index_tensor("cache_seqlens", cache_seqlens, 1, "[B]", q.device)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens: expected {batch} entries (the batch of q), got {cache_seqlens.shape[0]}")
        seqlens = cache_seqlens.to(torch.int32)
    else:
        # None: the cache is full once the new keys are in (FlashAttention's convention).
        filled = capacity - new if cache_seqlens is None else cache_seqlens
        seqlens = torch.full((batch,), filled, dtype=torch.int32, device=q.device)
    cache_rows = None if cache_batch_idx is None else cache_batch_idx.to(torch.int32)
    block_table_given, block_table = block_table, None if block_table is None else block_table.to(torch.int32)
    # The tensors as given (a cast makes a new tensor on every call) and what else the checks read.
    given = (cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None, cache_batch_idx, block_table_given)
    context = (None if given[0] is not None else cache_seqlens, new, capacity, page_size, k_cache.shape[0])
    if batch > 0 and values_checkable(seqlens) and not _CHECKED.passed(given, context):
        _check_values(seqlens, new, capacity, cache_rows, block_table, page_size, k_cache.shape[0])
        _CHECKED.remember(given, context)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 chooses), got {num_splits!r}")

    entries = (batch, seqlen_q, capacity, q.shape[2], k_cache.shape[2], q.shape[3])
    if attn_mask is not None:
        check_mask(attn_mask, q, entries)
        if isinstance(attn_mask, (BitMask, KeyIntervals)):
            attn_mask = attn_mask.dense()  # a decode step's mask is a few rows: the kernels read it as bytes
    if k is not None:
        append_keys(k_cache, v_cache, bias_cache, k, v, bias, seqlens, cache_rows, block_table, page_size, capacity)
    bias_view = None
    if bias_cache is not None:  # as the kernels read a per-key bias: [rows, Hm, 1, slots]
        bias_view = (bias_cache.flatten(0, 1)[None] if paged else bias_cache).permute(0, 2, 1).unsqueeze(2)
    problem = AttentionProblem(
        query=q if q.stride(-1) == 1 else q.contiguous(),
        key=k_view,
        value=v_view,
        attn_mask=attn_mask,
        attn_bias=bias_view,
        block_mask=None,
        **normalize_settings(q, **settings),
    )
    return CachedProblem(problem, seqlens + new, cache_rows, block_table, page_size, capacity, num_splits)


def cached_keys(cached: CachedProblem, entry: int, length: int):
    """``(k, v, bias)`` of one entry's first ``length`` keys, gathered: ``[1, length, Hkv, D]`` and
    ``[1, Hm, 1, length]`` (or None). For the reference backend."""
    problem = cached.problem
    if cached.block_table is None:
        row = entry if cached.cache_rows is None else int(cached.cache_rows[entry])
        index = torch.arange(length, device=problem.key.device)
    else:
        row, slots = 0, torch.arange(length, device=problem.key.device)
        index = cached.block_table[entry].long()[slots // cached.page_size] * cached.page_size + slots % cached.page_size
    bias = None if problem.attn_bias is None else problem.attn_bias[row][..., index][None]
    return problem.key[row, index][None], problem.value[row, index][None], bias
