"""Work counts behind the throughput columns: active (q, k) pairs, FLOPs and K/V bytes.

Throughput is *effective*: FLOPs are counted only over the (q, k) pairs that the causal rule
and the mask leave visible, so a method that skips masked blocks gets no credit for work it
avoided, and one that computes them anyway gets none for wasted work. Dense methods (no
mask) are credited with every causal pair.
"""

from __future__ import annotations

import torch

from flash_dma.backends.reference import valid_indices
from flash_dma.bit_mask import BitMask
from flash_dma.block_mask import BlockMask
from flash_dma.key_intervals import KeyIntervals
from flash_dma.masks import attended_fraction

FORWARD_FLOPS_PER_PAIR_PER_DIM = 4  # two matrix products (q k^T and p v), a multiply-add each
FWDBWD_FLOPS_RATIO = 3.5  # the backward's five matrix products cost 2.5x the forward's two
HBM_COPY_GBPS = 3000.0  # device-to-device copy ceiling measured on the H100 (GUIDE.md)
CAUSAL = (-1, 0)  # the window of the causal rule
_COUNT_CHUNK_ENTRIES = 1 << 26  # index entries checked at a time: bounds the temporaries
# FlashAttention-3's backward on sm90 at head dim 128 (causal): the query rows and keys of its
# tiles, to which its fp32 scratch is rounded, and the head dims its kernels are built for.
FA3_BACKWARD_TILE = (64, 128)
FA3_HEAD_DIMS = (64, 96, 128, 192, 256)


def active_pairs(seqlen_q: int, seqlen_k: int, batch: int, num_heads: int, mask: torch.Tensor | None = None) -> int:
    """Visible (query, key) pairs, summed over the batch and the query heads.

    Key j is visible to query i iff ``i >= j + Sq - Sk`` (causal, aligned bottom-right) and the
    mask keeps j; so j is visible to ``min(Sq, Sk - j)`` queries.

    Args:
        mask: ``[1|B, 1|Hkv|H, 1, Sk]`` bool, per key; a head dimension of Hkv is shared by the
            ``H / Hkv`` query heads of each group. None: every key.
    """
    rows_per_key = (seqlen_k - torch.arange(seqlen_k, dtype=torch.int64)).clamp(max=seqlen_q)
    if mask is None:
        return batch * num_heads * int(rows_per_key.sum())
    if mask.dim() != 4 or mask.shape[2] != 1 or mask.shape[3] != seqlen_k:
        raise ValueError(f"mask: expected a per-key mask [1|B, 1|Hkv|H, 1, {seqlen_k}], got {tuple(mask.shape)}")
    pairs_per_mask_row = int((mask[:, :, 0, :].cpu().to(torch.int64) * rows_per_key).sum())
    return pairs_per_mask_row * (batch // mask.shape[0]) * (num_heads // mask.shape[1])


def document_active_pairs(documents: tuple[int, ...], num_heads: int, mask: torch.Tensor | None = None) -> int:
    """Visible (query, key) pairs of packed documents, summed over the documents and query heads.

    Each document attends causally to itself only: its local key j is visible to ``n - j`` of its
    ``n`` queries, if the mask keeps it.

    Args:
        mask: per-key packed ``[1, 1|Hkv|H, 1, total]`` bool, or None (every key).
    """
    rows_per_key = torch.cat([n - torch.arange(n, dtype=torch.int64) for n in documents])
    if mask is None:
        return num_heads * int(rows_per_key.sum())
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[2] != 1 or mask.shape[3] != rows_per_key.numel():
        raise ValueError(
            f"mask: expected a packed per-key mask [1, Hm, 1, {rows_per_key.numel()}], got {tuple(mask.shape)}"
        )
    pairs_per_mask_row = int((mask[0, :, 0, :].cpu().to(torch.int64) * rows_per_key).sum())
    return pairs_per_mask_row * (num_heads // mask.shape[1])


def block_active_pairs(block_mask: BlockMask, seqlen_q: int, seqlen_k: int, batch: int, num_heads: int) -> int:
    """Visible (query, key) pairs under a block mask with no partial blocks (a per-query-block
    top-k), summed over the batch and the query heads.

    flash-dma's own count of what the blocks and the causal rule let through
    (``attended_fraction``: the mean over the mask's heads), times the causal pairs of every
    (batch, query head); each mask head stands for ``H / Hm`` query heads.
    """
    fraction = attended_fraction(seqlen_q, seqlen_k, block_mask=block_mask, is_causal=True)
    return round(fraction * active_pairs(seqlen_q, seqlen_k, batch, num_heads))


def selection_active_pairs(mask: BitMask | KeyIntervals, seqlen_q: int, seqlen_k: int, batch: int, num_heads: int) -> int:
    """Visible (query, key) pairs under a per-query :class:`BitMask` or :class:`KeyIntervals` and the
    bottom-right causal rule, counted from its rows a chunk at a time (``attended_fraction``: the
    mean over the mask's heads), times the causal pairs of every (batch, query head)."""
    fraction = attended_fraction(seqlen_q, seqlen_k, mask, is_causal=True)
    return round(fraction * active_pairs(seqlen_q, seqlen_k, batch, num_heads))


def index_active_pairs(indices: torch.Tensor, seqlen_q: int, seqlen_k: int, num_heads: int) -> int:
    """Visible (query, key) pairs listed by top-k ``indices`` ``[B, Sq, Hkv, W]``, summed over the
    batch and the query heads: the entries that count under the bottom-right causal rule, each
    attended by the ``H / Hkv`` query heads of its group. Counted from the indices (4 bytes an
    entry), not from their ``BitMask`` (``Sk / 8`` bytes a query), a chunk of query rows at a time."""
    batch, _, kv_heads, width = indices.shape
    rows_per_chunk = max(1, _COUNT_CHUNK_ENTRIES // max(1, batch * kv_heads * width))
    counted = 0
    for start in range(0, seqlen_q, rows_per_chunk):
        chunk = indices[:, start : start + rows_per_chunk]
        counted += int(valid_indices(chunk, start, seqlen_q, seqlen_k, CAUSAL).sum())
    return counted * (num_heads // kv_heads)


def kv_bytes(
    seqlen_k: int, batch: int, kv_heads: int, head_dim: int, itemsize: int, mask: torch.Tensor | None = None
) -> int:
    """Bytes of K and V a method must read: every kept key of every (batch, K/V head), twice (K and V).

    Under the bottom-right causal rule every key is visible to the last query, so a kept key is
    always read. ``mask``: ``[1|B, 1|Hkv, 1, Sk]`` bool, or None (every key).
    """
    if mask is None:
        kept_keys = batch * kv_heads * seqlen_k
    else:
        kept_keys = int(mask.sum()) * (batch // mask.shape[0]) * (kv_heads // mask.shape[1])
    return kept_keys * head_dim * 2 * itemsize


def kvcache_bytes(mask: torch.Tensor, kv_heads: int, head_dim: int, itemsize: int, bias_heads: int,
                  bias_itemsize: int) -> int:
    """Bytes a decode over a KV cache must read: K and V of the kept keys only, plus the bias of
    every key and the mask (one byte a key per mask head). The query and the output are left out.

    Args:
        mask: ``[B, 1|Hkv, 1, S]`` bool over the cached keys of each entry.
        bias_heads: heads of the cached bias (a value per key and head).
    """
    batch, mask_heads, _, capacity = mask.shape
    if kv_heads % mask_heads:
        raise ValueError(f"mask: expected 1 or {kv_heads} heads, got {mask_heads}")
    kept_keys = int(mask.sum()) * (kv_heads // mask_heads)
    return (kept_keys * head_dim * 2 * itemsize + batch * capacity * bias_heads * bias_itemsize
            + mask.numel() * mask.element_size())


def attention_flops(pairs: int, head_dim: int, mode: str) -> float:
    """FLOPs of one call over ``pairs`` visible (q, k) pairs; ``mode`` is "fwd" or "fwdbwd"."""
    forward = FORWARD_FLOPS_PER_PAIR_PER_DIM * head_dim * pairs
    if mode == "fwd":
        return float(forward)
    if mode == "fwdbwd":
        return FWDBWD_FLOPS_RATIO * forward
    raise ValueError(f"mode: expected 'fwd' or 'fwdbwd', got {mode!r}")


def fa3_fwdbwd_bytes(
    batch: int, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int, head_dim: int, itemsize: int = 2,
) -> int:
    """Bytes one FlashAttention-3 forward and backward allocate beyond their inputs and dO, as its
    ``mha_fwd`` and ``mha_bwd`` (``hopper/flash_api.cpp``) size them: what a peak-memory target is
    held against where FlashAttention-3 is not installed. The forward keeps ``out`` and the LSE
    ``[B, H, Sq]``; the backward adds dQ, dK and dV in the inputs' dtype and fp32 scratch: the LSE
    in log2 units and each row's dO.O (``[B, H, Sq rounded]``), the dQ accumulator (``[B, H, Sq
    rounded x D rounded]``) and, where query heads share a K/V head, dK and dV accumulators (``[B,
    Hkv, Sk rounded x D rounded]``). Its semaphores (a few KB) are left out."""
    rows, keys = FA3_BACKWARD_TILE
    rows_rounded, keys_rounded = -(-seqlen_q // rows) * rows, -(-seqlen_k // keys) * keys
    dim = next(d for d in FA3_HEAD_DIMS if d >= head_dim)
    out_and_grads = itemsize * head_dim * (2 * batch * seqlen_q * heads + 2 * batch * seqlen_k * kv_heads)
    lse = 4 * batch * heads * seqlen_q
    scratch = 4 * batch * heads * rows_rounded * (2 + dim)
    if heads != kv_heads:
        scratch += 4 * 2 * batch * kv_heads * keys_rounded * dim
    return out_and_grads + lse + scratch


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6
