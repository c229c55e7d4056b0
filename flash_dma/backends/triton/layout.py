"""The record of one attention call as the kernels take it, and the launch arguments every
Triton kernel shares, built in one place for the forward and the backward.

:class:`Call` is what the backend's entry points fill once per call and every launcher reads:
the inputs, the walks of the mask and the settings. It is flattened only at the custom-op
boundary (``ops.py``), where ``torch.library`` wants positional tensors.

The three Triton attention kernels (forward, dK/dV, dQ) begin with the same parameters, in this order:

- runtime: ``Q, K, V, Mask, Bias, Walk, SeqQ, SeqK`` and their strides, the sizes, the head divisors of the
  broadcast inputs, the summary's block sizes, the band and the scales;
- constexpr: ``HAS_MASK, HAS_BIAS, WALK, MASK_PER_KEY, BIAS_PER_KEY, SOFTCAP, DOT_PRECISION, SEQ, MASK_KIND``.

Each kernel adds its own parameters after each group (outputs, gradients, split and GQA flags),
then ``BLOCK_D`` and the tile sizes. :func:`common_arguments` returns both groups, so that the
passes cannot disagree on how an input is read. The Hopper kernels share theirs through
``hopper/common.py``'s ``hopper_arguments``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flash_dma.backends.triton import configs, tiles

WALK_DENSE, WALK_BLOCKS, WALK_KEYS = (w.value for w in (tiles.WALK_DENSE, tiles.WALK_BLOCKS, tiles.WALK_KEYS))
SEQ_FIXED, SEQ_PACKED, SEQ_CACHE = (s.value for s in (tiles.SEQ_FIXED, tiles.SEQ_PACKED, tiles.SEQ_CACHE))
# How a call's mask stores its values (``Call.mask_kind``), as the Triton kernels' MASK_KIND says it.
MASK_KINDS = {
    "elements": tiles.MASK_ELEMENTS.value, "bits": tiles.MASK_WORDS.value, "intervals": tiles.MASK_INTERVALS.value,
}
# Shared int parameters that Triton may specialise: strides and sizes in the address and bounds
# arithmetic of row and mask/bias loads (a stride of 1 makes a per-key bias a contiguous load,
# multiples of 16 let whole rows load as 16-byte vectors). The others never change the kernel.
SPECIALIZED = (
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
    "stride_mb", "stride_mh", "stride_mq", "stride_mk", "stride_bb", "stride_bh", "stride_bq", "stride_bk",
    "seqlen_q", "seqlen_k", "head_dim",
)
# The shared int parameters that never change the kernel (the walk's strides and width, head counts
# and divisors, the lists' block sizes, the band): each Triton kernel's ``do_not_specialize`` starts with them.
NOT_SPECIALIZED = (
    "stride_wb", "stride_wh", "stride_wr", "walk_width", "num_heads", "num_kv_heads",
    "mask_head_div", "bias_head_div", "walk_head_div", "list_block_q", "list_block_k", "band_lo", "band_hi",
)


@functools.lru_cache(maxsize=None)
def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor standing in for an absent kernel input (never read).

    Empty, so that it owns no memory: caching it is then safe even when its first use is inside
    a CUDA graph capture, whose pool must hold nothing but the graph's own tensors.
    """
    return torch.empty(0, dtype=dtype, device=device)


def broadcast_strides(t: torch.Tensor | None) -> tuple[int, ...]:
    """Strides of a tensor with 0 on every size-1 (broadcast) dimension; four zeros for None."""
    if t is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def head_divisor(t: torch.Tensor | None, num_heads: int) -> int:
    """Query head h reads head ``h // divisor`` of a ``[., 1|Hkv|H, ...]`` tensor."""
    if t is None or t.shape[1] in (1, num_heads):
        return 1
    return num_heads // t.shape[1]


def walks_per_group(walk: torch.Tensor | None, num_heads: int, num_kv_heads: int) -> int:
    """How many block-summary walks the query heads of one key/value group take: one each where
    ``walk`` ``[Bm, 1|Hkv|H, ...]`` holds a summary per query head (a real one, not broadcast),
    else one that the group shares."""
    if walk is None or walk.shape[1] != num_heads or walk.stride(1) == 0:
        return 1
    return num_heads // num_kv_heads


def kernel_view(t: torch.Tensor | None) -> torch.Tensor | None:
    # Triton reads bool tensors as bytes.
    return t.view(torch.uint8) if t is not None and t.dtype == torch.bool else t


def band(window_left: int, window_right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Visible offsets ``j - i - (Sk - Sq)`` as a closed range; unbounded sides become out-of-reach values."""
    reach = seqlen_q + seqlen_k + 1
    return (-reach if window_left < 0 else -window_left), (reach if window_right < 0 else window_right)


def diagonal_band(window_left: int, window_right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Visible offsets ``j - i`` (key position minus query position): :func:`band` moved onto the
    bottom-right diagonal, so that the Hopper kernels get it as launch constants (the Triton
    kernels shift in the kernel: packed sequences each have lengths of their own)."""
    band_lo, band_hi = band(window_left, window_right, seqlen_q, seqlen_k)
    return band_lo + seqlen_k - seqlen_q, band_hi + seqlen_k - seqlen_q


# Kinds of bias gradient the dK/dV kernels make: none, column sums of dS (a bias per key), or dS
# itself (a bias per pair); ``backward.bias_gradient`` chooses.
DBIAS_NONE, DBIAS_PER_KEY, DBIAS_FULL = 0, 1, 2

TMA_MIN_BLOCK_D = 128
TMA_MIN_KEYS = 16384


def copy_engine_reads(block_d: int, seqlen_k: int, *tensors: torch.Tensor) -> bool:
    """Whether the kernels may read row tiles of ``tensors`` through TMA descriptors (``tiles.row_source``).

    Hopper's copy engine needs 16-byte aligned addresses and row strides; ``FLASH_DMA_TMA=0``
    turns it off. The interpreter runs the descriptor path too, so the CPU tests cover it.
    Only where it measured faster (measured on an H100, bf16, llm shape, keep 1/8): head-dim
    blocks of 128 and more (at 16K the D = 128 forward went from 0.516 to 0.478 ms and D = 256
    stayed even, but D = 64 went from 0.373 to 0.443), and 16K keys or more (at 4K the D = 128
    forward went from 0.073 to 0.159 ms; docs/design-notes.md, "TMA loads").
    """
    if block_d < TMA_MIN_BLOCK_D or seqlen_k < TMA_MIN_KEYS or not configs.tma_enabled(tensors[0].device):
        return False
    return tma_aligned(*tensors)


def tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether TMA can copy row tiles of ``tensors`` (last dimension contiguous): 16-byte aligned
    addresses and row strides."""
    return all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def walk_kind(walk: torch.Tensor | None, key_list: torch.Tensor | None) -> int:
    if key_list is not None:
        return WALK_KEYS
    return WALK_DENSE if walk is None else WALK_BLOCKS


def input_form(t: torch.Tensor | None, kind: str = "elements") -> str:
    """How a ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` mask or bias varies: ``"none"``, ``"keys"`` (``[., ., 1,
    Sk|1]``), ``"rows"`` (``[., ., Sq, 1]``), ``"pairs"`` (``[., ., Sq, Sk]``), or for a mask stored
    otherwise (``Call.mask_kind``) its kind: ``"bits"`` or ``"intervals"``. The routing table
    (``dispatch.Form``) and the kernels' flags read it."""
    if t is None:
        return "none"
    if kind != "elements":
        return kind
    if t.shape[2] == 1:
        return "keys"
    return "rows" if t.shape[3] == 1 else "pairs"


def tensor_layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype)


class Call(NamedTuple):
    """One attention call: inputs, the walks of its mask, and settings. The tensors come first
    (:data:`CALL_TENSORS` of them), so that ``ops.py`` can save them for the backward.

    ``mask``: as ``mask_kind`` says (:data:`MASK_KINDS`): ``"elements"``, ``[1|B, 1|Hkv|H, 1|Sq,
    1|Sk]`` bool or 0/1 integer; ``"bits"``, the int32 words of a ``BitMask`` (``bit_mask.py``)
    ``[Bm, Hm, Sq, W]``, per query and key; ``"intervals"``, key intervals' rows int32 ``[Bm, Hm,
    1, 2 Sk]``, each key's first row then one past its last, contiguous (``kernel_intervals``);
    with a key list, None. ``kv_lists``/``q_lists``: a block summary's lists (``block_mask.py``);
    ``key_list``: a per-key mask's kept keys (``key_list.py``); ``cu_seqlens_q``/``cu_seqlens_k``
    and the two longest lengths: packed sequences (varlen), else None and 0; ``descale``: FP8
    inputs' descale factors ``[B, Hkv, 3]`` float32 (q, k, v), else None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    kv_lists: torch.Tensor | None
    q_lists: torch.Tensor | None
    key_list: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    descale: torch.Tensor | None
    list_block_q: int
    list_block_k: int
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    deterministic: bool
    max_seqlen_q: int
    max_seqlen_k: int
    mask_kind: str


CALL_TENSORS = Call._fields.index("list_block_q")
BIAS_FIELD = Call._fields.index("bias")


class TopkCall(NamedTuple):
    """One top-k index attention call (``flash_dma_topk_func``): inputs and settings, tensors first.

    ``indices`` ``[B, Sq, Hkv, W]`` int32; ``bias`` per pair ``[1|B, Sq, 1|Hkv|H, W]``, per key
    ``[1|B, 1|Hkv|H, Sk]`` (told apart by their number of dimensions), or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    indices: torch.Tensor
    bias: torch.Tensor | None
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    deterministic: bool


TOPK_TENSORS = TopkCall._fields.index("softmax_scale")
TOPK_BIAS_FIELD = TopkCall._fields.index("bias")


class Sequences(NamedTuple):
    """Where the batch entries lie in the token tensors, when not one per batch row (``tiles.sequence_span``).

    ``SEQ_PACKED``: ``seq_q``/``seq_k`` are ``cu_seqlens_q``/``cu_seqlens_k`` ``[N + 1]`` int32 over
    ``[1, total, heads, D]`` tensors, and ``batch`` = N entries of at most ``max_seqlen_q`` queries
    and ``max_seqlen_k`` keys. ``SEQ_CACHE``: ``seq_k`` ``[B]`` int32 holds each entry's number of
    keys in a cache of ``max_seqlen_k`` slots; ``seq_q`` is None.
    """

    kind: int
    seq_q: torch.Tensor | None
    seq_k: torch.Tensor
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int


class CachePages(NamedTuple):
    """How cached entries find their keys (``flash_dma_with_kvcache``).

    ``rows``: ``[B]`` int32 cache row of each entry (``cache_batch_idx``), or None for row b.
    ``block_table``: ``[B, max_pages]`` int32 page of each entry's ``page_size`` consecutive keys,
    with K and V then a pool ``[1, pages * page_size, Hkv, D]``; or None for a contiguous cache.
    """

    rows: torch.Tensor | None
    block_table: torch.Tensor | None
    page_size: int


def cache_tables(cache: CachePages | None, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(rows, block_table, page_size, last)`` as the forward kernels take a cache's entries: the
    tables (int32 placeholders where absent), the page size (1 unpaged) and the last cache row, or
    page, of ``k`` (the cache, or its pool of pages), to which the kernels clamp indices."""
    none = placeholder(k.device, torch.int32)
    rows = none if cache is None or cache.rows is None else cache.rows
    paged = cache is not None and cache.block_table is not None
    page_size = cache.page_size if paged else 1
    return rows, cache.block_table if paged else none, page_size, (k.shape[1] // page_size if paged else k.shape[0]) - 1


def grid_sizes(q: torch.Tensor, k: torch.Tensor, sequences: Sequences | None) -> tuple[int, int, int]:
    """``(entries, queries, keys)`` that the grids span: the tensors' own, or at most one entry's."""
    if sequences is None:
        return q.shape[0], q.shape[1], k.shape[1]
    return sequences.batch, sequences.max_seqlen_q, sequences.max_seqlen_k


def common_tensors(call: Call, walked, sequences: Sequences | None = None) -> list:
    """The eight pointer arguments the kernels share: q, k, v, mask, bias, the walked lists and
    the two sequence tables."""
    q, k, v, mask, bias = call[:5]
    device = q.device
    none = placeholder(device, torch.int32)
    seq_q = none if sequences is None or sequences.seq_q is None else sequences.seq_q
    return [
        q, k, v,
        placeholder(device, torch.uint8) if mask is None else kernel_view(mask),
        placeholder(device, torch.float32) if bias is None else bias,
        none if walked is None else walked,
        seq_q,
        none if sequences is None else sequences.seq_k,
    ]


def call_signature(call: Call, tensors: int = CALL_TENSORS) -> tuple:
    """Everything the kernels' choice, configuration and arguments read of ``call`` besides its
    tensors' addresses: each tensor's shape, strides, dtype and whether its address is 16-byte
    aligned (TMA and Triton's pointer specialisation read that), the device and the settings.

    ``tensors``: how many of the record's fields are tensors (a :class:`TopkCall` has fewer).
    Computed once per pass, it keys the memoised decisions of the passes (``forward.py``,
    ``backward.py``) and their launches, so that a call of a layout seen before repeats none of them.
    """
    return (
        tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in call[:tensors]]),
        call.q.device,
        call[tensors:],
    )


def sequences_signature(sequences: Sequences | None) -> tuple | None:
    """What :func:`common_arguments` reads of ``sequences`` besides its tensors' addresses."""
    return None if sequences is None else (sequences.kind, sequences.batch, sequences.max_seqlen_q, sequences.max_seqlen_k)


def common_arguments(
    call: Call, lists: torch.Tensor | None, pack_gqa: bool = False, sequences: Sequences | None = None,
) -> tuple[list, list]:
    """``(runtime, constexprs)``: the shared parameters of the attention kernels, in order.

    Args:
        call: q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` (last dimension contiguous), the mask
            and bias ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` or None (with a key list the mask is not read).
        lists: the block summary's lists this kernel walks (``kv_lists`` or ``q_lists``), or None.
        pack_gqa: the forward packs a GQA group's heads into one tile's rows.
        sequences: packed (varlen) or cached entries; None when every batch row is one entry.
    """
    q, k, v, mask, bias, key_list = call.q, call.k, call.v, call.mask, call.bias, call.key_list
    window_left, window_right, softcap, softmax_scale = call.window_left, call.window_right, call.softcap, call.softmax_scale
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    if sequences is not None and sequences.kind == SEQ_CACHE:
        seqlen_k = sequences.max_seqlen_k  # the cache's slots per entry (a paged K is a pool of pages)
    group = num_heads // num_kv_heads
    walk = walk_kind(lists, key_list)
    walked = key_list if key_list is not None else lists
    band_lo, band_hi = band(window_left, window_right, seqlen_q, seqlen_k)
    walk_strides = broadcast_strides(walked)
    # A per-key input is one row shared by a tile's query rows, unless packed rows mix heads it varies over.
    per_key = lambda t: t is not None and t.shape[2] == 1 and (not pack_gqa or t.shape[1] != num_heads or group == 1)  # noqa: E731
    runtime = [
        *common_tensors(call, walked, sequences),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *broadcast_strides(mask), *broadcast_strides(bias),
        *walk_strides[:3], 0 if walked is None else walked.shape[-1],
        seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim,
        head_divisor(mask, num_heads), head_divisor(bias, num_heads), head_divisor(walked, num_heads),
        call.list_block_q, call.list_block_k, band_lo, band_hi,
        softmax_scale, softmax_scale * tiles.LOG2E.value, softcap * tiles.LOG2E.value, softmax_scale / softcap if softcap > 0 else 0.0,
    ]
    constexprs = [
        mask is not None and key_list is None, bias is not None, walk, per_key(mask), per_key(bias), softcap > 0,
        "ieee" if q.dtype == torch.float32 else "tf32",
        SEQ_FIXED if sequences is None else sequences.kind,
        MASK_KINDS[call.mask_kind],
    ]
    return runtime, constexprs
