"""The tensors of a benchmark case, shared by every method, and its mask.

Masks are chosen from the per-key bias itself, as a dynamic-mask model chooses them: a block
top-k per key (:func:`block_topk_mask`; per packed document, :func:`document_topk_block_mask`),
a block top-k per query block (``flash_dma.topk_block_mask``), a token top-k
(``flash_dma.create_mask``) or each query's top keys under the causal rule as key intervals
(``flash_dma.causal_topk_intervals``, Doge's selection). Per-query selections keep each query's
top keys of a random per-pair score; KV-cache cases (:class:`CacheInputs`) keep random keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flash_dma.benchmark.llama import LLAMA_CONFIG
from flash_dma.benchmark.suites import (
    INDEX_SELECTIONS,
    MASK_BLOCK,
    TOPKQ_LOCAL_BLOCKS,
    TOPKQ_SINK_BLOCKS,
    Case,
    kept_block_count,
)
from flash_dma.bit_mask import BitMask
from flash_dma.block_mask import EMPTY, BlockMask
from flash_dma.integers import cdiv
from flash_dma.masks import causal_topk_intervals, chunked_topk_indices, create_mask, topk_block_mask, topk_mask
from flash_dma.summaries import block_mask_from_state

DTYPE = torch.bfloat16
SEED = 0


def block_topk_mask(scores: torch.Tensor, keep: float, block_size: int = MASK_BLOCK) -> torch.Tensor:
    """Keep the ``keep`` fraction of key blocks with the largest score, always including block 0.

    Each block is rated by its largest score; per head, the ``kept_block_count(keep, n_blocks)``
    best blocks are kept. Block 0 (the first keys, an attention sink) is always among them: it
    takes the place of the lowest-rated block otherwise kept.

    Args:
        scores: ``[1, Hm, 1, Sk]`` float scores per key (the bias, in the benchmark).
        keep: fraction of the ``ceil(Sk / block_size)`` blocks to keep, per head.

    Returns:
        ``[1, Hm, 1, Sk]`` bool mask, True on the keys of the kept blocks.
    """
    seqlen_k = scores.shape[-1]
    num_blocks = cdiv(seqlen_k, block_size)
    padded = F.pad(scores.float(), (0, num_blocks * block_size - seqlen_k), value=float("-inf"))
    block_scores = padded.unflatten(-1, (num_blocks, block_size)).amax(-1)
    block_scores[..., 0] = float("inf")
    kept = block_scores.topk(kept_block_count(keep, num_blocks), dim=-1).indices
    blocks = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, kept, True)
    return blocks.repeat_interleave(block_size, dim=-1)[..., :seqlen_k]


def query_block_topk_mask(scores: torch.Tensor, case: Case) -> BlockMask:
    """The per-query-block top-k of ``scores`` ``[1, Hm, 1, Sk]``, as ``flash_dma.topk_block_mask`` makes it.

    Each block of MASK_BLOCK queries keeps up to ``case.kept_blocks`` of the key blocks it can
    see (all of them while it sees fewer): block 0 (a sink), its diagonal block, and the others
    by their largest score. The blocks are FULL or EMPTY, so no element-wise mask goes with it.
    """
    forced = TOPKQ_SINK_BLOCKS + TOPKQ_LOCAL_BLOCKS
    return topk_block_mask(
        scores, window_size=max(0, case.kept_blocks - forced) * MASK_BLOCK, block_size=(MASK_BLOCK, MASK_BLOCK),
        query_len=case.seqlen_q, is_causal=True, sink_blocks=TOPKQ_SINK_BLOCKS, local_blocks=TOPKQ_LOCAL_BLOCKS,
    )


def query_topk_mask(scores: torch.Tensor, case: Case) -> BitMask:
    """Each query's ``case.window`` keys of largest per-pair score ``[1, Hm, Sq, Sk]`` (``create_mask``,
    packed): over every key for the seeds' table, as their Quick Start does, over the keys the
    causal rule leaves each query otherwise (the pqtoken suite)."""
    allowed = None
    if case.suite != "seedtable":
        allowed = torch.ones(case.seqlen_q, case.seqlen_k, dtype=torch.bool, device=scores.device).tril(case.seqlen_k - case.seqlen_q)
        allowed = allowed[None, None]
    return create_mask(scores, allowed, case.batch, case.seqlen_q, case.seqlen_k, case.window, packed=True)


def query_topk_indices(case: Case, gen: torch.Generator) -> torch.Tensor:
    """Each query's top ``case.window`` visible keys (causal) of a random per-pair score, as top-k
    indices ``[1, Sq, Hkv, W]`` int32: the score drawn a chunk of query rows at a time, so that no
    ``[Hkv, Sq, Sk]`` tensor is made (32 GiB of bf16 at 128K)."""
    shape = (1, case.kv_heads, case.seqlen_q, case.seqlen_k)

    def score_rows(start: int, stop: int) -> torch.Tensor:
        rows = (1, case.kv_heads, stop - start, case.seqlen_k)
        return torch.randn(rows, generator=gen, device=gen.device, dtype=DTYPE)

    return chunked_topk_indices(score_rows, shape, case.window, is_causal=True, device=gen.device)


# Overlapping selections (``mask="query-index-overlap"``): each query's score of key j is
# <u_i, c_j> / sqrt(rank) plus per-pair noise, with u_i interpolated between random anchors
# OVERLAP_PERIOD queries apart, so that neighbouring queries pick many of the same keys, as an
# indexer whose scores are smooth in the query does. At 32K a block of 16 queries lists about 0.19
# x 16 x 2048 distinct keys (H100 run, design notes "Top-k index attention: the union of a query
# block's keys").
OVERLAP_PERIOD = 64
OVERLAP_RANK = 32
OVERLAP_NOISE = 0.5


def overlapping_topk_indices(case: Case, gen: torch.Generator) -> torch.Tensor:
    """Each query's top ``case.window`` visible keys (causal) of a score smooth in the query (see
    ``OVERLAP_PERIOD``), as top-k indices ``[1, Sq, Hkv, W]`` int32, a chunk of query rows at a time."""
    shape = (1, case.kv_heads, case.seqlen_q, case.seqlen_k)
    anchors = torch.randn(1, case.kv_heads, case.seqlen_q // OVERLAP_PERIOD + 2, OVERLAP_RANK, generator=gen, device=gen.device)
    codes = torch.randn(1, case.kv_heads, case.seqlen_k, OVERLAP_RANK, generator=gen, device=gen.device)

    def score_rows(start: int, stop: int) -> torch.Tensor:
        position = torch.arange(start, stop, device=gen.device) / OVERLAP_PERIOD
        low = position.floor().long()
        weight = (position - low)[:, None]
        query = anchors[:, :, low] * (1 - weight) + anchors[:, :, low + 1] * weight  # [1, Hkv, rows, rank]
        noise = torch.randn(1, case.kv_heads, stop - start, case.seqlen_k, generator=gen, device=gen.device)
        return query @ codes.transpose(-1, -2) / OVERLAP_RANK**0.5 + OVERLAP_NOISE * noise

    return chunked_topk_indices(score_rows, shape, case.window, is_causal=True, device=gen.device)


def cumulative_lengths(documents: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """``cu_seqlens`` ``[N + 1]`` int32 of the packed documents: 0, then each one's end."""
    ends = torch.tensor((0, *documents), dtype=torch.int64).cumsum(0)
    return ends.to(device=device, dtype=torch.int32)


def document_topk_block_mask(scores: torch.Tensor, documents: tuple[int, ...], keep: float) -> BlockMask:
    """Each packed document keeps the fraction ``keep`` of its own key blocks, block 0 among them.

    ``flash_dma.topk_block_mask`` in its varlen form (``cu_seqlens_k``) keeps the same number of
    blocks in every document; here document i keeps ``kept_block_count(keep, its blocks)``, so the
    varlen call is made once per document with that budget (block 0 as the sink, the rest by the
    largest score) and row i of its result taken. A block cut by a document's end is FULL.

    Args:
        scores: ``[1, Hm, 1, total]`` per-key scores (the packed bias).

    Returns:
        A :class:`BlockMask` of one entry per document, ``mask_shape = (N, Hm, 1, max(documents))``.
    """
    cu_seqlens = cumulative_lengths(documents, scores.device)
    packed, longest = scores[0, :, 0], max(documents)
    rows, result = [], None
    for i, length in enumerate(documents):
        kept = kept_block_count(keep, cdiv(length, MASK_BLOCK))
        result = topk_block_mask(packed, (kept - 1) * MASK_BLOCK, block_size=(MASK_BLOCK, MASK_BLOCK), sink_blocks=1,
                                 cu_seqlens_k=cu_seqlens, max_seqlen_k=longest)
        rows.append(result.state[i])
    return block_mask_from_state(torch.stack(rows), result.mask_shape, result.block_size)


def document_key_mask(block_mask: BlockMask, documents: tuple[int, ...]) -> torch.Tensor:
    """The per-key packed mask ``[1, Hm, 1, total]`` of a per-document block selection: True on
    the keys of each document's kept blocks."""
    kept = block_mask.state[:, :, 0, :] != EMPTY  # [N, Hm, NKB]
    keys = kept.repeat_interleave(block_mask.block_size[1], dim=-1)
    return torch.cat([keys[i, :, :n] for i, n in enumerate(documents)], dim=-1)[None, :, None, :]


def pad_documents(packed: torch.Tensor, documents: tuple[int, ...], fill=0) -> torch.Tensor:
    """``[total, ...]`` packed documents -> ``[N, max(documents), ...]``, each padded at its end with ``fill``."""
    padded = packed.new_full((len(documents), max(documents), *packed.shape[1:]), fill)
    for i, chunk in enumerate(packed.split(list(documents))):
        padded[i, : chunk.shape[0]] = chunk
    return padded


def unpad_documents(padded: torch.Tensor, documents: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`pad_documents`: ``[N, max, ...]`` -> ``[total, ...]``."""
    return torch.cat([padded[i, :n] for i, n in enumerate(documents)])


@dataclass(frozen=True)
class Inputs:
    """One attention case's tensors, in flash-dma's layout; every method reads these same tensors.

    Attributes:
        query: ``[B, Sq, H, D]`` bf16.
        key, value: ``[B, Sk, Hkv, D]`` bf16.
        mask: ``[1, Hkv, 1, Sk]`` bool, chosen from the per-key scores: their block top-k
            (``mask="block"``) or token top-k (``"token"``); a ``BitMask`` ``[1, Hkv, Sq, Sk]`` of each
            query's top-k keys of a per-pair score (``"query-token"``, and the index selections
            with ``indices``); ``KeyIntervals`` ``[1, Hkv, Sq, Sk]`` of each query's top keys of the
            per-key scores (``"intervals"``); None otherwise.
        bias: ``[1, Hkv, 1, Sk]`` bf16 (the per-key scores themselves), ``[1, H, Sq, Sk]`` bf16,
            ``[1, Hkv, Sq, Sk]`` bf16 (``"pair"``: the per-pair scores the mask is chosen from), or None.
        block_mask: the per-query-block top-k of the scores (``mask="query-block"``), or None.
        cu_seqlens: packed documents (``case.documents``): ``[N + 1]`` int32 boundaries, the
            same for queries and keys. Then B is 1, Sq = Sk the total, ``block_mask`` each
            document's own block top-k (:func:`document_topk_block_mask`) and ``mask`` the same
            selection per key, packed ``[1, Hkv, 1, total]``.
        indices: ``mask="query-index"``: each query's top ``case.window`` keys of a random per-pair
            score (:func:`query_topk_indices`), or ``"query-index-overlap"`` of a score smooth in
            the query (:func:`overlapping_topk_indices`), ``[B, Sq, Hkv, W]`` int32, the
            ``indices`` of ``flash_dma_topk_func``; ``mask`` is their ``BitMask``.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    block_mask: BlockMask | None = None
    cu_seqlens: torch.Tensor | None = None
    indices: torch.Tensor | None = None

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        """The tensors whose gradients a backward pass produces."""
        return (self.query, self.key, self.value) + (() if self.bias is None else (self.bias,))


@dataclass(frozen=True)
class CacheInputs:
    """A KV-cache case's tensors, as ``flash_dma_with_kvcache`` takes them (forward only).

    Attributes:
        query: ``[B, Sq, H, D]`` bf16 (Sq = 1: decode; more: a chunk of prefill over the cache).
        k_cache, v_cache: ``[B, S, Hkv, D]`` bf16, or paged ``[B * S / page_size, page_size, Hkv, D]``.
        cache_seqlens: ``[B]`` int32, every entry full (S keys).
        block_table: ``[B, S / page_size]`` int32, a random permutation of the pages; None if contiguous.
        mask: ``[B, Hkv, 1, S]`` bool over the cached keys: ``round(keep * S)`` random keys of each
            (entry, K/V head) kept.
        bias_cache: ``[B, S, Hkv]`` bf16, or paged ``[pages, page_size, Hkv]``: a per-key bias.

    A paged case holds the same keys, values and bias as its contiguous twin, moved to the pages
    of its block table.
    """

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor | None
    mask: torch.Tensor
    bias_cache: torch.Tensor

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        return ()


@dataclass(frozen=True)
class TokenInputs:
    """A model case's input: token ids ``[B, S]``, shared by every attention implementation."""

    input_ids: torch.Tensor


def random_key_mask(batch: int, heads: int, seqlen: int, kept: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, heads, 1, seqlen]`` bool: ``kept`` keys of each (batch, head) row, chosen at random."""
    scores = torch.rand(batch, heads, seqlen, generator=gen, device=gen.device)
    kept_keys = scores.topk(kept, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, kept_keys, True)[:, :, None, :]


def make_cache_inputs(case: Case, device: torch.device | str, seed: int = SEED) -> CacheInputs:
    """Random KV-cache inputs for ``case``: a full cache, contiguous or (``kv_layout="paged"``) paged."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, length, kv_heads, head_dim = case.batch, case.seqlen_k, case.kv_heads, case.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=DTYPE)

    query = randn(batch, case.seqlen_q, case.heads, head_dim)
    k_cache, v_cache = randn(batch, length, kv_heads, head_dim), randn(batch, length, kv_heads, head_dim)
    bias_cache = randn(batch, length, kv_heads)
    mask = random_key_mask(batch, kv_heads, length, case.kept_keys, gen)
    block_table = None
    if case.kv_layout == "paged":
        page_size = case.page_size
        if length % page_size:
            raise ValueError(f"a paged cache of {length} keys needs whole pages of {page_size}")
        pages_per_entry = length // page_size
        order = torch.randperm(batch * pages_per_entry, generator=gen, device=device)
        block_table = order.view(batch, pages_per_entry).to(torch.int32)

        def paged(t: torch.Tensor) -> torch.Tensor:
            pool = torch.empty((batch * pages_per_entry, page_size, *t.shape[2:]), dtype=t.dtype, device=t.device)
            pool[order] = t.reshape(batch * pages_per_entry, page_size, *t.shape[2:])
            return pool

        k_cache, v_cache, bias_cache = paged(k_cache), paged(v_cache), paged(bias_cache)
    elif case.kv_layout != "contiguous":
        raise ValueError(f"kv_layout: expected 'contiguous' or 'paged', got {case.kv_layout!r}")
    cache_seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    return CacheInputs(query=query, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                       block_table=block_table, mask=mask, bias_cache=bias_cache)


def make_inputs(case: Case, device: torch.device | str, seed: int = SEED) -> Inputs | TokenInputs | CacheInputs:
    """Random inputs for ``case`` (drawn on ``device`` from ``seed``); they require grad iff the case has a backward."""
    if case.uses_kv_cache:
        return make_cache_inputs(case, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    if case.is_model:
        # From 1: id 0 is the pad token of generation.
        ids = torch.randint(1, LLAMA_CONFIG["vocab_size"], (case.batch, case.seqlen_k), generator=gen, device=device)
        return TokenInputs(input_ids=ids)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=DTYPE)

    batch, heads, kv_heads, head_dim = case.batch, case.heads, case.kv_heads, case.head_dim
    key_scores = randn(1, kv_heads, 1, case.seqlen_k)
    mask = block_mask = cu_seqlens = None
    if case.documents is not None:
        if case.mask != "block" or batch != 1 or not case.seqlen_q == case.seqlen_k == sum(case.documents):
            raise ValueError("packed documents take mask='block', batch 1 and Sq = Sk = the documents' total")
        cu_seqlens = cumulative_lengths(case.documents, device)
        block_mask = document_topk_block_mask(key_scores, case.documents, case.keep)
        mask = document_key_mask(block_mask, case.documents)
    elif case.mask == "block":
        mask = block_topk_mask(key_scores, case.keep)
    elif case.mask == "token":
        mask = create_mask(key_scores, None, batch, case.seqlen_q, case.seqlen_k, window_size=case.window)
    elif case.mask == "query-block":
        block_mask = query_block_topk_mask(key_scores, case)
    elif case.mask == "intervals":
        mask = causal_topk_intervals(key_scores[:, :, 0], case.kept_keys, query_len=case.seqlen_q)
    per_pair = case.bias == "pair" or case.mask == "query-token"
    pair_scores = randn(1, kv_heads, case.seqlen_q, case.seqlen_k) if per_pair else None
    indices = None
    if case.mask == "query-token":
        mask = query_topk_mask(pair_scores, case)
    elif case.mask in INDEX_SELECTIONS:
        chosen = (query_topk_indices if case.mask == "query-index" else overlapping_topk_indices)(case, gen)  # [1, Sq, Hkv, W]
        mask = topk_mask(chosen, case.seqlen_k)
        indices = chosen.expand(batch, -1, -1, -1)  # flash_dma_topk_func takes every batch entry's
    query = randn(batch, case.seqlen_q, heads, head_dim)
    key = randn(batch, case.seqlen_k, kv_heads, head_dim)
    value = randn(batch, case.seqlen_k, kv_heads, head_dim)
    if case.bias == "full":
        bias = randn(1, heads, case.seqlen_q, case.seqlen_k)
    elif case.bias == "pair":
        bias = pair_scores
    else:
        bias = key_scores if case.bias == "key" else None
    for t in (query, key, value, bias):
        if t is not None:
            t.requires_grad_(case.needs_grad)
    return Inputs(query=query, key=key, value=value, mask=mask, bias=bias, block_mask=block_mask, cu_seqlens=cu_seqlens,
                  indices=indices)
