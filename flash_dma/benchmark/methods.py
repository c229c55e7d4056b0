"""The attention implementations compared side by side, all fed one case's shared tensors.

Each method turns the shared :class:`~flash_dma.benchmark.inputs.Inputs` into a ``forward()``
closure. What a model does once per mask rather than once per call (flash-dma's block summary,
Flex's block mask and compiled kernels, K/V heads repeated for SDPA) happens in ``prepare``,
outside the timed region; what a model does on every call stays inside ``forward``. The Llama
methods turn a model case's token ids into a train step or a generate call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_dma import (
    BlockMask,
    build_block_mask,
    flash_dma_func,
    flash_dma_topk_func,
    flash_dma_varlen_func,
    flash_dma_with_kvcache,
    pack_mask,
)
from flash_dma.backends.triton import dispatch
from flash_dma.backends.triton.dispatch import TOPK_INDICES, TOPK_PACKED, TopkPlan
from flash_dma.benchmark import layers, llama
from flash_dma.benchmark.inputs import DTYPE, CacheInputs, Inputs, TokenInputs, pad_documents
from flash_dma.benchmark.suites import Case
from flash_dma.bit_mask import WORD_BITS, BitMask, pack_words
from flash_dma.block_mask import EMPTY, FULL
from flash_dma.inputs import FP8_DTYPE
from flash_dma.summaries import bit_mask_from_words
from flash_dma.v1 import flash_sparse_attn_func_auto

# Dynamo keeps one compiled entry per shape (dynamic=False) and per score_mod; a full run needs up
# to about 20, more than the default limit of 8, past which dynamo would fall back to eager Flex
# (which materialises the whole score matrix).
FLEX_RECOMPILE_LIMIT = 64


@dataclass(frozen=True)
class MethodOptions:
    """Which rows to leave out on purpose.

    Attributes:
        flex_decode: run Flex on decode rows (38-300 ms a call there, so off by default).
        float_mask_budget_gib: largest float mask sdpa-additive may materialise.
    """

    flex_decode: bool = False
    float_mask_budget_gib: float = 8.0


@dataclass(frozen=True)
class Prepared:
    """A method ready to run on one case.

    Attributes:
        forward: one attention call; returns ``[B, Sq, H, D]`` (flash-dma) or ``[B, H, Sq, D]``.
        leaves: the tensors whose ``.grad`` the backward fills, reset between timed calls.
    """

    forward: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]


class Method:
    """One attention implementation.

    ``applies_mask``: its FLOPs are counted over the (mask and causal) pairs; otherwise over all
    causal pairs. ``skips_masked_keys``: it reads only the kept keys' K/V; otherwise all of them.
    """

    name: str
    description: str
    applies_mask = True
    skips_masked_keys = True

    def skip_reason(self, case: Case, mode: str, options: MethodOptions) -> str | None:
        """Why this row is left out without running, or None to run it."""
        return None

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        raise NotImplementedError


class FlashDma(Method):
    def __init__(self, reuse_block_mask: bool, backend: str | None = None):
        self.reuse_block_mask = reuse_block_mask
        self.backend = backend
        if backend == "flex":
            self.name = "flash-dma-flex"
            self.description = (
                "`flash_dma_func(..., block_mask=bm, backend=\"flex\")`: flash-dma's contract on PyTorch's "
                "FlexAttention, Flex's block mask made from flash-dma's summary inside every call"
            )
        elif reuse_block_mask:
            self.name = "flash-dma"
            self.description = (
                "`flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True, block_mask=bm)`. "
                "A block top-k mask gets `bm = build_block_mask(mask)`, built once outside the timed region "
                "(a model reuses it across layers, like Flex's block mask); a per-query-block top-k is "
                "passed as the `BlockMask` from `topk_block_mask`, with no `attn_mask`; a token-level mask "
                "is passed alone (no `block_mask`: flash-dma works out its kept keys inside each call)"
            )
        else:
            self.name = "flash-dma-percall"
            self.description = "`flash_dma_func` without `block_mask`: the summary is rebuilt inside every call"

    def skip_reason(self, case: Case, mode: str, options: MethodOptions) -> str | None:
        return _flex_skip_reason(case, mode, options) if self.backend == "flex" else None

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        block_mask = inputs.block_mask
        if self.reuse_block_mask and case.mask == "block":
            block_mask = build_block_mask(inputs.mask)

        def forward() -> torch.Tensor:
            return flash_dma_func(
                inputs.query, inputs.key, inputs.value, attn_mask=inputs.mask, attn_bias=inputs.bias,
                is_causal=True, softcap=case.softcap, block_mask=block_mask, deterministic=case.deterministic,
                backend=self.backend,
            )

        return Prepared(forward, inputs.leaves)


class FlashDmaUnmasked(Method):
    """``flash_dma_func`` with ``attn_mask=None``: the bias kept (what the mask's selection costs or
    saves), or dropped too (dense causal attention beside the dense ceilings: what the bias costs)."""

    applies_mask = False
    skips_masked_keys = False

    def __init__(self, keeps_bias: bool):
        self.keeps_bias = keeps_bias
        if keeps_bias:
            self.name = "flash-dma-nomask"
            self.description = (
                "the same `flash_dma_func` call with `attn_mask=None` (the bias kept): what the mask's selection "
                "costs or saves (per-query suites)"
            )
        else:
            self.name = "flash-dma-nobias"
            self.description = (
                "`flash_dma_func(q, k, v, is_causal=True)`: no mask and no bias, dense causal attention, against "
                "the dense ceilings: what the contract's bias costs (llm)"
            )

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        bias = inputs.bias if self.keeps_bias else None

        def forward() -> torch.Tensor:
            return flash_dma_func(inputs.query, inputs.key, inputs.value, attn_bias=bias, is_causal=True)

        return Prepared(forward, inputs.leaves if self.keeps_bias else (inputs.query, inputs.key, inputs.value))


class FlashDmaTopk(Method):
    """``flash_dma_topk_func`` on a case's top-k indices: its passes as the cost model plans them
    (``dispatch.topk_plan``), or each pass forced to one walk, so that a run measures the walks
    side by side (the topkfit suite)."""

    # name -> (the plan every call takes, None for the model's; unique_indices)
    VARIANTS = {
        "flash-dma-topk": (None, True),
        "flash-dma-topk-indices": (TopkPlan(TOPK_INDICES, TOPK_INDICES), True),
        "flash-dma-topk-packed": (TopkPlan(TOPK_PACKED, TOPK_PACKED), True),
        "flash-dma-topk-plane": (TopkPlan(TOPK_PACKED, TOPK_PACKED), False),
    }
    _DESCRIPTIONS = {
        "flash-dma-topk": "each pass as the cost model plans it",
        "flash-dma-topk-indices": "both passes forced onto the index walk (the indices gathered by the kernels)",
        "flash-dma-topk-packed": "both passes forced onto the packed per-query mask, its BitMask built inside the call",
        "flash-dma-topk-plane": "the packed mask with `unique_indices=False`: a float32 bias plane counts repeats",
    }

    def __init__(self, name: str):
        self.name = name
        self.plan, self.unique = self.VARIANTS[name]
        self.description = (
            f"`flash_dma_topk_func(q, k, v, indices, bias[:, :, 0], is_causal=True, unique_indices={self.unique})`: "
            f"each query's kept keys as top-k indices `[B, Sq, Hkv, W]` with the per-key bias; {self._DESCRIPTIONS[name]}"
        )

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        bias = None if inputs.bias is None else inputs.bias[:, :, 0]  # per key [1, Hkv, Sk]

        def forward() -> torch.Tensor:
            # The plan is taken in the forward call; the backward follows it.
            chosen, dispatch.TOPK_FORCED_PLAN = dispatch.TOPK_FORCED_PLAN, self.plan
            try:
                return flash_dma_topk_func(inputs.query, inputs.key, inputs.value, inputs.indices, bias, is_causal=True,
                                           unique_indices=self.unique)
            finally:
                dispatch.TOPK_FORCED_PLAN = chosen

        return Prepared(forward, inputs.leaves)


class FlashDmaBits(Method):
    name = "flash-dma-bits"
    description = (
        "the per-query-block selection handed over as a per-query mask: a `BitMask` packed from the "
        "block mask's elements, passed as `attn_mask` alone, so flash-dma finds its tiles from the bits "
        "(topkq suite: whether time follows the non-empty tiles when neighbouring queries pick the same keys)"
    )

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        blocks = inputs.block_mask
        shape = (*blocks.mask_shape[:2], case.seqlen_q, case.seqlen_k)
        words = pack_words(lambda start, stop: blocks.dense_rows(start, stop, case.seqlen_k) != EMPTY,
                           shape, blocks.device)
        mask = bit_mask_from_words(words, shape, blocks.block_size)

        def forward() -> torch.Tensor:
            return flash_dma_func(inputs.query, inputs.key, inputs.value, attn_mask=mask, attn_bias=inputs.bias,
                                  is_causal=True)

        return Prepared(forward, inputs.leaves)


def _dense_selection(mask):
    """The selection as the dense bool ``[1, Hkv, Sq, Sk]`` that v1's ``create_mask`` makes."""
    return mask.dense() if isinstance(mask, BitMask) else mask


class FlashDmaV1Dense(Method):
    name = "flash-dma-v1"
    description = (
        "the seeds' Quick Start as a v1 user runs it: the selection as a dense bool `[1, Hkv, Sq, Sk]` "
        "(what v1's `create_mask` returns), passed with the bias to "
        "`flash_dma.v1.flash_sparse_attn_func_auto(\"cuda\")`; the same mask tensor in every call "
        "(as every layer of a model shares it), so flash-dma packs it once per version"
    )

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        mask, attend = _dense_selection(inputs.mask), flash_sparse_attn_func_auto("cuda")

        def forward() -> torch.Tensor:
            return attend(inputs.query, inputs.key, inputs.value, attn_mask=mask, attn_bias=inputs.bias, is_causal=True)

        return Prepared(forward, inputs.leaves)


class PackDense(Method):
    name = "pack-dense"
    description = (
        "`pack_mask(mask)` of the selection's dense bool `[1, Hkv, Sq, Sk]`: a dense mask's first use "
        "(its bits, block states and lists), forward rows only"
    )
    applies_mask = False
    skips_masked_keys = False

    def skip_reason(self, case: Case, mode: str, options: MethodOptions) -> str | None:
        return "packing has no backward" if mode != "fwd" else None

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        mask = _dense_selection(inputs.mask)
        return Prepared(lambda: pack_mask(mask).words, ())


def _bottom_right_causal(seqlen_q: int, seqlen_k: int) -> Callable:
    """``visible(q_idx, kv_idx)``: key ``kv_idx`` is at or before query ``q_idx``, aligned bottom-right."""
    offset = seqlen_k - seqlen_q

    def visible(q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    return visible


def flex_mask_mod(mask: torch.Tensor, num_heads: int, seqlen_q: int) -> Callable:
    """Flex ``mask_mod`` of a per-key mask ``[1, Hm, 1, Sk]`` and the bottom-right causal rule."""
    group = num_heads // mask.shape[1]
    causal = _bottom_right_causal(seqlen_q, mask.shape[-1])

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[0, h // group, 0, kv_idx] & causal(q_idx, kv_idx)

    return mask_mod


def flex_bit_mask_mod(mask: BitMask, num_heads: int, seqlen_q: int) -> Callable:
    """Flex ``mask_mod`` of a per-query :class:`BitMask` ``[1, Hm, Sq, Sk]`` (its bits read from
    its words) and the bottom-right causal rule."""
    words = mask.words
    group = num_heads // words.shape[1]
    causal = _bottom_right_causal(seqlen_q, mask.shape[3])

    def mask_mod(b, h, q_idx, kv_idx):
        return (((words[0, h // group, q_idx, kv_idx // WORD_BITS] >> (kv_idx % WORD_BITS)) & 1) != 0) & causal(q_idx, kv_idx)

    return mask_mod


def flex_block_mask_mod(block_mask: BlockMask, num_heads: int, seqlen_q: int, seqlen_k: int) -> Callable:
    """Flex ``mask_mod`` of a flash-dma :class:`BlockMask` of FULL and EMPTY blocks per query block
    (``state`` ``[1, Hm, NQB, NKB]``) and the bottom-right causal rule: the same selection,
    read from the block state, so no ``[H, Sq, Sk]`` mask is ever made. Flex's own blocks
    (128 x 128, as the state's) come out full wherever the causal rule cuts nothing."""
    state = block_mask.state
    group = num_heads // state.shape[1]
    block_q, block_k = block_mask.block_size
    causal = _bottom_right_causal(seqlen_q, seqlen_k)

    def mask_mod(b, h, q_idx, kv_idx):
        return (state[0, h // group, q_idx // block_q, kv_idx // block_k] == FULL) & causal(q_idx, kv_idx)

    return mask_mod


def flex_causal_mask_mod(seqlen_q: int, seqlen_k: int) -> Callable:
    """Flex ``mask_mod`` of the bottom-right causal rule alone (no mask)."""
    causal = _bottom_right_causal(seqlen_q, seqlen_k)

    def mask_mod(b, h, q_idx, kv_idx):
        return causal(q_idx, kv_idx)

    return mask_mod


def flex_score_mod(bias: torch.Tensor, num_heads: int) -> Callable:
    """Flex ``score_mod`` adding a bias ``[1, Hb, 1, Sk]`` (per key) or ``[1, Hb, Sq, Sk]`` to the scores."""
    group = num_heads // bias.shape[1]
    if bias.shape[2] == 1:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[0, h // group, 0, kv_idx]

    else:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[0, h // group, q_idx, kv_idx]

    return score_mod


def flex_document_mask_mod(documents: tuple[int, ...], block_mask: BlockMask, num_heads: int) -> Callable:
    """Flex ``mask_mod`` of packed documents: a key is visible iff it is in the query's document,
    at or before the query (causal within each document: queries and keys of a document have
    the same length, so bottom-right and top-left alignment agree), and in one of the blocks its
    document keeps, read from a table of kept document-local blocks ``[N, Hm, NKB]`` built from
    the per-document block state ``[N, Hm, 1, NKB]``."""
    device = block_mask.device
    lengths = torch.tensor(documents, device=device)
    document_id = torch.repeat_interleave(torch.arange(len(documents), device=device), lengths)  # [total]
    starts = (lengths.cumsum(0) - lengths).to(torch.int32)  # [N]
    kept = block_mask.state[:, :, 0, :] != EMPTY  # [N, Hm, NKB]
    group = num_heads // kept.shape[1]
    block_k = block_mask.block_size[1]

    def mask_mod(b, h, q_idx, kv_idx):
        document = document_id[kv_idx]
        local_block = (kv_idx - starts[document]) // block_k
        return (document_id[q_idx] == document) & (q_idx >= kv_idx) & kept[document, h // group, local_block]

    return mask_mod


def flex_mods(case: Case, inputs: Inputs) -> tuple[Callable, Callable | None]:
    """``(mask_mod, score_mod)`` giving Flex the case's selection and bias (``score_mod`` None without bias)."""
    if case.documents is not None:
        mask_mod = flex_document_mask_mod(case.documents, inputs.block_mask, case.heads)
    elif inputs.block_mask is not None:
        mask_mod = flex_block_mask_mod(inputs.block_mask, case.heads, case.seqlen_q, case.seqlen_k)
    elif isinstance(inputs.mask, BitMask):
        mask_mod = flex_bit_mask_mod(inputs.mask, case.heads, case.seqlen_q)
    elif inputs.mask is not None:
        mask_mod = flex_mask_mod(inputs.mask, case.heads, case.seqlen_q)
    else:
        mask_mod = flex_causal_mask_mod(case.seqlen_q, case.seqlen_k)
    score_mod = None if inputs.bias is None else flex_score_mod(inputs.bias, case.heads)
    return mask_mod, score_mod


@functools.cache
def _compiled_flex() -> tuple[Callable, Callable]:
    """``(flex_attention, create_block_mask)``, compiled once per process and reused by every case.

    With ``dynamic=False`` each new shape compiles its own kernels, as a model with fixed shapes
    would get. ``create_block_mask`` is compiled too: uncompiled, it materialises the whole
    ``[B, H, Sq, Sk]`` mask (16 GiB for the llm suite at 32K).
    """
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, FLEX_RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask, dynamic=False)


def _flex_skip_reason(case: Case, mode: str, options: MethodOptions) -> str | None:
    if case.is_decode and not options.flex_decode:
        return "not run by default (38-300 ms a call at decode shapes); pass --flex-decode"
    if case.needs_grad and case.bias != "none" and torch.__version__ < (2, 6):
        return f"a gradient of a bias captured by score_mod needs torch >= 2.6 (this is {torch.__version__})"
    return None


class Flex(Method):
    name = "flex"
    description = (
        "FlexAttention, `torch.compile`d: block mask from `create_block_mask` (built outside the timed "
        "region), mask and bias through `mask_mod`/`score_mod`, `enable_gqa=True`; packed documents "
        "(varlen suite) as one sequence with a document mask (same document, causal, and the document's "
        "kept key blocks)"
    )

    def skip_reason(self, case: Case, mode: str, options: MethodOptions) -> str | None:
        return _flex_skip_reason(case, mode, options)

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        flex_attention, create_block_mask = _compiled_flex()
        q, k, v = (t.transpose(1, 2) for t in (inputs.query, inputs.key, inputs.value))
        mask_mod, score_mod = flex_mods(case, inputs)
        block_mask = create_block_mask(
            mask_mod, case.batch, case.heads, case.seqlen_q, case.seqlen_k, device=inputs.query.device
        )

        def forward() -> torch.Tensor:
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)

        return Prepared(forward, inputs.leaves)


class FlashDmaVarlen(Method):
    name = "flash-dma-varlen"
    description = (
        "packed documents: `flash_dma_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, "
        "attn_bias=bias, is_causal=True, block_mask=bm)`, q/k/v `[total, heads, D]`, the bias packed "
        "`[Hkv, total]` (these are the leaves, made outside the timed region, as the padded row's are); "
        "`bm`, each document's block top-k (`topk_block_mask(..., cu_seqlens_k=...)`), is built once "
        "outside the timed region"
    )

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        longest = max(case.documents)
        # Leaves of their own in the packed layout: views of the shared [1, total, ...] leaves would
        # add autograd's copies of every gradient into a zeroed [1, ...] tensor to the timed step.
        query, key, value = (t.detach()[0].requires_grad_(t.requires_grad) for t in (inputs.query, inputs.key, inputs.value))
        bias = None if inputs.bias is None else inputs.bias.detach()[0, :, 0].requires_grad_(inputs.bias.requires_grad)

        def forward() -> torch.Tensor:
            out = flash_dma_varlen_func(
                query, key, value, inputs.cu_seqlens, inputs.cu_seqlens, longest, longest,
                attn_bias=bias, is_causal=True, block_mask=inputs.block_mask,
            )
            return out[None]

        return Prepared(forward, tuple(t for t in (query, key, value, bias) if t is not None and t.requires_grad))


def padded_document_inputs(case: Case, inputs: Inputs) -> Inputs:
    """The packed documents as a batch padded to the longest: q/k/v ``[N, max, heads, D]``, mask
    and bias ``[N, Hkv, 1, max]`` (padding keys masked, bias 0 there), copied from the packed
    tensors into new leaves; ``block_mask`` the summary of the padded mask."""
    documents = case.documents

    def per_key(t: torch.Tensor, fill) -> torch.Tensor:  # [1, Hm, 1, total] -> [N, Hm, 1, max]
        return pad_documents(t[0, :, 0].t(), documents, fill).permute(0, 2, 1).unsqueeze(2).contiguous()

    query, key, value = (pad_documents(t.detach()[0], documents).requires_grad_(t.requires_grad)
                         for t in (inputs.query, inputs.key, inputs.value))
    bias = None if inputs.bias is None else per_key(inputs.bias.detach(), 0).requires_grad_(inputs.bias.requires_grad)
    mask = per_key(inputs.mask, False)
    return Inputs(query=query, key=key, value=value, mask=mask, bias=bias, block_mask=build_block_mask(mask))


class FlashDmaPadded(Method):
    name = "flash-dma-padded"
    description = (
        "packed documents padded to the longest: `flash_dma_func` on a batch of N documents of max_len "
        "(q/k/v `[N, max_len, heads, D]`), padding keys masked out, the same per-document block top-k as "
        "`attn_mask` `[N, Hkv, 1, max_len]` with its `build_block_mask` summary built once outside the "
        "timed region; the padded tensors are made (and are the leaves) outside the timed region too, "
        "so the row is attention on padded inputs, without the pad/unpad copies"
    )

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        padded = padded_document_inputs(case, inputs)

        def forward() -> torch.Tensor:
            return flash_dma_func(
                padded.query, padded.key, padded.value, attn_mask=padded.mask, attn_bias=padded.bias,
                is_causal=True, block_mask=padded.block_mask,
            )

        return Prepared(forward, padded.leaves)


class FlashDmaKvcache(Method):
    name = "flash-dma-kvcache"
    description = (
        "decode over a KV cache: `flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., "
        "block_table=..., attn_mask=mask, bias_cache=..., is_causal=True)`, q `[B, 1, H, D]`, the cache "
        "full (no new key appended: the call is attention alone), contiguous or paged (pages of 256 in "
        "a shuffled block table), mask `[B, Hkv, 1, S]` of random kept keys (none at keep 1), bias "
        "`[B|pages, S|256, Hkv]`"
    )

    def prepare(self, case: Case, inputs: CacheInputs) -> Prepared:
        # Keep 1 is a plain decode: a caller that keeps every key passes no mask.
        mask = None if case.keep == 1 else inputs.mask

        def forward() -> torch.Tensor:
            return flash_dma_with_kvcache(
                inputs.query, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens,
                block_table=inputs.block_table, attn_mask=mask, bias_cache=inputs.bias_cache, is_causal=True,
            )

        return Prepared(forward, ())


def quantized_fp8(t: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t8, descale)``: ``t`` ``[B, S, heads, D]`` in float8_e4m3fn, scaled per (batch, key/value
    head) so that its largest magnitude is e4m3's largest (448), and the ``[B, Hkv]`` float32 factors
    that undo the scaling (``flash_dma_func``'s ``*_descale``)."""
    batch, length, heads, head_dim = t.shape
    grouped = t.detach().float().view(batch, length, num_kv_heads, heads // num_kv_heads, head_dim)
    descale = grouped.abs().amax(dim=(1, 3, 4)).clamp_min(1e-12) / torch.finfo(FP8_DTYPE).max  # [B, Hkv]
    return (grouped / descale[:, None, :, None, None]).to(FP8_DTYPE).view(t.shape), descale


class FlashDmaFp8(Method):
    name = "flash-dma-fp8"
    description = (
        "the `flash-dma` call on FP8 inputs: q, k and v in float8_e4m3fn, each scaled per (batch, key/value "
        "head) to e4m3's range, with the factors that undo it as `q_descale`, `k_descale`, `v_descale` "
        "`[B, Hkv]` (quantized outside the timed region), the bias in bfloat16; the forward only"
    )

    def skip_reason(self, case: Case, mode: str, options: MethodOptions) -> str | None:
        return "FP8 attention has a forward only" if mode != "fwd" else None

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        num_kv_heads = inputs.key.shape[2]
        (q, q_descale), (k, k_descale), (v, v_descale) = (
            quantized_fp8(t, num_kv_heads) for t in (inputs.query, inputs.key, inputs.value)
        )
        block_mask = build_block_mask(inputs.mask) if case.mask == "block" else inputs.block_mask
        bias = None if inputs.bias is None else inputs.bias.detach()

        def forward() -> torch.Tensor:
            return flash_dma_func(
                q, k, v, attn_mask=inputs.mask, attn_bias=bias, is_causal=True, softcap=case.softcap, block_mask=block_mask,
                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            )

        return Prepared(forward, ())


class FlashDmaNoCache(Method):
    name = "flash-dma-nocache"
    description = (
        "a KV-cache row's problem without the cache: `flash_dma_func(q, k_cache, v_cache, attn_mask=mask, "
        "attn_bias=bias, is_causal=True)` on the contiguous cache's tensors, the bias `[B, Hkv, 1, S]` a view "
        "of `bias_cache` (a cache call's twin: what the cache costs)"
    )

    def prepare(self, case: Case, inputs: CacheInputs) -> Prepared:
        if inputs.block_table is not None:
            raise ValueError(f"{self.name}: expected a contiguous cache, got kv_layout={case.kv_layout!r}")
        mask = None if case.keep == 1 else inputs.mask
        bias = inputs.bias_cache.permute(0, 2, 1)[:, :, None]  # [B, Hkv, 1, S]

        def forward() -> torch.Tensor:
            return flash_dma_func(inputs.query, inputs.k_cache, inputs.v_cache, attn_mask=mask, attn_bias=bias, is_causal=True)

        return Prepared(forward, ())


def _repeat_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, h, X, Y]`` -> ``[B, num_heads, X, Y]``, each head repeated ``num_heads / h`` times.

    A zero-copy view (head stride 0) when ``h == 1``, a copy otherwise.
    """
    batch, heads, x, y = t.shape
    return t[:, :, None].expand(batch, heads, num_heads // heads, x, y).reshape(batch, num_heads, x, y)


def _sdpa_qkv(inputs: Inputs, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's layout: q ``[B, H, Sq, D]`` (a view of the shared query) and k, v ``[B, H, Sk, D]``.

    K/V heads are repeated to H here, outside the timed region, and become new leaves: not every
    fused kernel that takes a float mask takes ``enable_gqa`` (memory-efficient does not), and
    where none does SDPA falls back to its unfused math path. Every SDPA method gets the same
    layout. The repeat's backward (a sum over each group, into the shared K/V) is not timed.
    """
    q = inputs.query.transpose(1, 2)
    k, v = (
        _repeat_heads(t.detach().transpose(1, 2), num_heads).requires_grad_(t.requires_grad)
        for t in (inputs.key, inputs.value)
    )
    return q, k, v


def _sdpa_restricted_to(backends: tuple[str, ...] | None) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention`` allowed to use only the named ``SDPBackend`` members
    (None: plain SDPA, free to pick, without the host time of entering ``sdpa_kernel``)."""
    if backends is None:
        return F.scaled_dot_product_attention
    enabled = [getattr(SDPBackend, name) for name in backends]

    def sdpa(*args, **kwargs) -> torch.Tensor:
        with sdpa_kernel(enabled):
            return F.scaled_dot_product_attention(*args, **kwargs)

    return sdpa


def additive_float_mask(mask: torch.Tensor, bias: torch.Tensor, seqlen_q: int, num_heads: int) -> torch.Tensor:
    """SDPA's float mask: the bias where the mask and the causal rule let a key through, -inf elsewhere.

    Block 0 is always kept, so no query row is left with only -inf (which SDPA turns into NaN).

    Args:
        mask: ``[1, Hkv, 1, Sk]`` bool, or a per-query ``BitMask`` ``[1, Hkv, Sq, Sk]``.
        bias: ``[1, Hkv, 1, Sk]``, ``[1, Hkv, Sq, Sk]`` or ``[1, H, Sq, Sk]``; the result is
            differentiable with respect to it.

    Returns:
        ``[1, 1|H, Sq, Sk]`` in the bias dtype: one head when mask and bias have one head.
    """
    seqlen_k = mask.shape[-1]
    mask = mask.dense() if isinstance(mask, BitMask) else mask
    mask, bias = (t if t.shape[1] in (1, num_heads) else _repeat_heads(t, num_heads) for t in (mask, bias))
    causal = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=mask.device).tril(seqlen_k - seqlen_q)
    return torch.where(causal, bias.masked_fill(~mask, float("-inf")), float("-inf"))


def float_mask_gib(case: Case) -> float:
    """Size of :func:`additive_float_mask`'s result for ``case``."""
    heads = 1 if case.kv_heads == 1 and case.bias in ("key", "pair") else case.heads
    return heads * case.seqlen_q * case.seqlen_k * DTYPE.itemsize / 2**30


class SdpaAdditive(Method):
    name = "sdpa-additive"
    description = (
        "the seeds' baseline: `F.scaled_dot_product_attention` with a materialised float mask (bias, "
        "-inf where masked or acausal) built inside every call, under autograd so the bias gets its "
        "gradient; K/V heads repeated outside the timed region; SDPA picks among its fused kernels "
        "that take a float mask (cuDNN, memory-efficient)"
    )
    skips_masked_keys = False
    # The math backend is left out: a silent fallback to it (O(S^2) float32 scores) would make the
    # baseline look slower than SDPA is; without a fused kernel the row fails and says why.
    backends: tuple[str, ...] | None = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION")

    def skip_reason(self, case: Case, mode: str, options: MethodOptions) -> str | None:
        gib = float_mask_gib(case)
        if gib > options.float_mask_budget_gib:
            return f"float mask would take {gib:.0f} GiB (budget {options.float_mask_budget_gib:g} GiB)"
        return None

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        sdpa = _sdpa_restricted_to(self.backends)
        q, k, v = _sdpa_qkv(inputs, case.heads)
        leaves = (inputs.query, k, v) + (() if inputs.bias is None else (inputs.bias,))
        if inputs.mask is None and inputs.bias is None:
            is_causal = _sdpa_is_causal(case)

            def forward() -> torch.Tensor:
                return sdpa(q, k, v, is_causal=is_causal)

        else:

            def forward() -> torch.Tensor:
                float_mask = additive_float_mask(inputs.mask, inputs.bias, case.seqlen_q, case.heads)
                return sdpa(q, k, v, attn_mask=float_mask)

        return Prepared(forward, leaves)


class Sdpa(SdpaAdditive):
    name = "sdpa"
    description = (
        "plain `F.scaled_dot_product_attention`, as the seeds call it: the float mask of sdpa-additive "
        "built inside every call (`is_causal=True` when there is neither mask nor bias), and SDPA free to "
        "pick its kernel, with no `sdpa_kernel` context around the call (host suite)"
    )
    backends = None


def _sdpa_is_causal(case: Case) -> bool:
    """SDPA's ``is_causal`` aligns top-left; it matches bottom-right alignment when Sq == Sk, and
    with one query row bottom-right causal attention masks nothing."""
    if case.seqlen_q == case.seqlen_k:
        return True
    if case.seqlen_q == 1:
        return False
    raise ValueError(f"dense SDPA rows need Sq == Sk or Sq == 1, got Sq={case.seqlen_q}, Sk={case.seqlen_k}")


class SdpaDense(Method):
    """A dense ceiling: one SDPA backend, no mask and no bias, causal."""

    applies_mask = False
    skips_masked_keys = False

    def __init__(self, name: str, backend: str, kernel: str):
        self.name = name
        self.backends = (backend,)
        self.description = f"dense ceiling: SDPA's {kernel} backend, causal, no mask and no bias"

    def prepare(self, case: Case, inputs: Inputs) -> Prepared:
        sdpa = _sdpa_restricted_to(self.backends)
        q, k, v = _sdpa_qkv(inputs, case.heads)
        is_causal = _sdpa_is_causal(case)

        def forward() -> torch.Tensor:
            return sdpa(q, k, v, is_causal=is_causal)

        return Prepared(forward, (inputs.query, k, v))


class Llama(Method):
    """Model cases, run by the transformers Llama of :mod:`~flash_dma.benchmark.llama` with one attention."""

    applies_mask = False
    skips_masked_keys = False

    def __init__(self, attn_implementation: str, family: str = "llama"):
        self.attn_implementation = attn_implementation
        self.family = family
        self.name = f"{family}-{attn_implementation.replace('_', '-')}"
        model = llama.describe_llama() if family == "llama" else llama.describe_doge()
        self.description = (
            f'the {model}, bf16, with `attn_implementation="{attn_implementation}"`: a train step '
            f"(LM loss over every position, forward + backward{', Doge choosing its own dynamic mask' if family == 'doge' else ', no mask'}) "
            f"or `generate(max_new_tokens={llama.GENERATE_NEW_TOKENS})`; the model is built outside the timed region"
        )

    def prepare(self, case: Case, inputs: TokenInputs) -> Prepared:
        model = llama.build_llama(self.attn_implementation, inputs.input_ids.device, self.family)
        if case.kind == "generate":
            model.eval()
            return Prepared(lambda: llama.generate(model, inputs.input_ids), ())
        return Prepared(lambda: llama.train_loss(model, inputs.input_ids), tuple(model.parameters()))


class LlamaBatch(Method):
    """The batching suite: the Llama serving its requests through ``generate_batch``."""

    applies_mask = False
    skips_masked_keys = False

    def __init__(self, attn_implementation: str):
        self.attn_implementation = attn_implementation
        self.name = f"batch-{attn_implementation.replace('_', '-')}"
        self.description = (
            f'the {llama.describe_llama()}, bf16, with `attn_implementation="{attn_implementation}"`: '
            f"`generate_batch` (continuous batching over transformers' paged cache, its default configuration) of "
            f"{len(llama.BATCH_PROMPT_LENGTHS)} prompts of {min(llama.BATCH_PROMPT_LENGTHS)} to "
            f"{max(llama.BATCH_PROMPT_LENGTHS)} tokens, {llama.BATCH_NEW_TOKENS} greedy new tokens each; "
            "the model is built outside the timed region"
        )

    def prepare(self, case: Case, inputs: TokenInputs) -> Prepared:
        model = llama.build_llama(self.attn_implementation, inputs.input_ids.device)
        model.eval()
        return Prepared(lambda: llama.generate_batch(model, inputs.input_ids), ())


class Layers(Method):
    """The layer suite: the :mod:`~flash_dma.benchmark.layers` stack's train step (sparse or dense),
    or one layer's key selection alone (``select``)."""

    applies_mask = False
    skips_masked_keys = False
    VARIANTS = {
        "flash-dma": "a train step (forward + backward) of the stack, each layer selecting its keys",
        "dense-bias": "a train step of the same stack with `window_size=None`: every key, the bias only",
        "select": "one layer's key selection (its bias from the value states, the block top-k and its summary)",
    }

    def __init__(self, variant: str):
        self.variant = variant
        self.name = f"layer-{variant}"
        self.description = (
            f"the {layers.describe_layers()}, bf16, eager: {self.VARIANTS[variant]}; built outside the timed region"
        )

    def prepare(self, case: Case, inputs: TokenInputs) -> Prepared:
        stack = layers.build_layers(self.variant == "dense-bias", inputs.input_ids.device)
        if self.variant == "select":
            return Prepared(layers.selection_step(stack, inputs.input_ids), ())
        return Prepared(lambda: stack(inputs.input_ids), tuple(stack.parameters()))


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        FlashDma(reuse_block_mask=True),
        FlashDma(reuse_block_mask=False),
        FlashDma(reuse_block_mask=True, backend="flex"),
        FlashDmaUnmasked(keeps_bias=True),
        FlashDmaUnmasked(keeps_bias=False),
        FlashDmaBits(),
        Flex(),
        SdpaAdditive(),
        Sdpa(),
        SdpaDense("sdpa-flash", "FLASH_ATTENTION", "FLASH_ATTENTION (FlashAttention-2)"),
        SdpaDense("sdpa-cudnn", "CUDNN_ATTENTION", "CUDNN_ATTENTION (cuDNN, FlashAttention-3 class on H100)"),
        Llama("flash_dma"),
        Llama("sdpa"),
        Llama("flash_dma", "doge"),
        Llama("sdpa", "doge"),
        LlamaBatch("flash_dma"),
        LlamaBatch("sdpa"),
        *(Layers(variant) for variant in Layers.VARIANTS),
        FlashDmaVarlen(),
        FlashDmaPadded(),
        FlashDmaKvcache(),
        FlashDmaNoCache(),
        FlashDmaTopk("flash-dma-topk"),
        FlashDmaFp8(),
        FlashDmaV1Dense(),
        PackDense(),
        *(FlashDmaTopk(name) for name in FlashDmaTopk.VARIANTS if name != "flash-dma-topk"),  # new methods last: the plots' colours follow this order
    )
}
