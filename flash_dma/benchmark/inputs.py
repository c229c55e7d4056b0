"""The tensors of a benchmark case, shared by every method, and its mask.

Masks are chosen from the per-key bias itself, as a dynamic-mask model chooses them: a block
top-k per key (:func:`block_topk_mask`), a block top-k per query block
(``flash_dma.topk_block_mask``) or a token top-k (``flash_dma.create_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flash_dma.benchmark.llama import LLAMA_CONFIG
from flash_dma.benchmark.suites import (
    MASK_BLOCK,
    TOPKQ_LOCAL_BLOCKS,
    TOPKQ_SINK_BLOCKS,
    Case,
    kept_block_count,
)
from flash_dma.block_mask import BlockMask, cdiv
from flash_dma.masks import create_mask, topk_block_mask

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


@dataclass(frozen=True)
class Inputs:
    """One attention case's tensors, in flash-dma's layout; every method reads these same tensors.

    Attributes:
        query: ``[B, Sq, H, D]`` bf16.
        key, value: ``[B, Sk, Hkv, D]`` bf16.
        mask: ``[1, Hkv, 1, Sk]`` bool, chosen from the per-key scores: their block top-k
            (``mask="block"``) or token top-k (``"token"``); None otherwise.
        bias: ``[1, Hkv, 1, Sk]`` bf16 (the per-key scores themselves), ``[1, H, Sq, Sk]`` bf16, or None.
        block_mask: the per-query-block top-k of the scores (``mask="query-block"``), or None.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    block_mask: BlockMask | None = None

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        """The tensors whose gradients a backward pass produces."""
        return (self.query, self.key, self.value) + (() if self.bias is None else (self.bias,))


@dataclass(frozen=True)
class TokenInputs:
    """A model case's input: token ids ``[B, S]``, shared by every attention implementation."""

    input_ids: torch.Tensor


def make_inputs(case: Case, device: torch.device | str, seed: int = SEED) -> Inputs | TokenInputs:
    """Random inputs for ``case`` (drawn on ``device`` from ``seed``); they require grad iff the case has a backward."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if case.is_model:
        # From 1: id 0 is the pad token of generation.
        ids = torch.randint(1, LLAMA_CONFIG["vocab_size"], (case.batch, case.seqlen_k), generator=gen, device=device)
        return TokenInputs(input_ids=ids)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=DTYPE)

    batch, heads, kv_heads, head_dim = case.batch, case.heads, case.kv_heads, case.head_dim
    key_scores = randn(1, kv_heads, 1, case.seqlen_k)
    mask = block_mask = None
    if case.mask == "block":
        mask = block_topk_mask(key_scores, case.keep)
    elif case.mask == "token":
        mask = create_mask(key_scores, None, batch, case.seqlen_q, case.seqlen_k, window_size=case.window)
    elif case.mask == "query-block":
        block_mask = query_block_topk_mask(key_scores, case)
    query = randn(batch, case.seqlen_q, heads, head_dim)
    key = randn(batch, case.seqlen_k, kv_heads, head_dim)
    value = randn(batch, case.seqlen_k, kv_heads, head_dim)
    if case.bias == "full":
        bias = randn(1, heads, case.seqlen_q, case.seqlen_k)
    else:
        bias = key_scores if case.bias == "key" else None
    for t in (query, key, value, bias):
        if t is not None:
            t.requires_grad_(case.needs_grad)
    return Inputs(query=query, key=key, value=value, mask=mask, bias=bias, block_mask=block_mask)
