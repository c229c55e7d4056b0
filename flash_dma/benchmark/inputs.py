"""The tensors of a benchmark case, shared by every method, and its block top-k mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flash_dma.benchmark.suites import MASK_BLOCK, Case, kept_block_count
from flash_dma.block_mask import cdiv

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


@dataclass(frozen=True)
class Inputs:
    """One case's tensors, in flash-dma's layout; every method reads these same tensors.

    Attributes:
        query: ``[B, Sq, H, D]`` bf16.
        key, value: ``[B, Sk, Hkv, D]`` bf16.
        mask: ``[1, Hkv, 1, Sk]`` bool, the block top-k of the per-key scores.
        bias: ``[1, Hkv, 1, Sk]`` bf16 (the per-key scores themselves) or ``[1, H, Sq, Sk]`` bf16.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        """The tensors whose gradients a backward pass produces."""
        return self.query, self.key, self.value, self.bias


def make_inputs(case: Case, device: torch.device | str, seed: int = SEED) -> Inputs:
    """Random inputs for ``case`` (drawn on ``device`` from ``seed``); they require grad iff the case has a backward."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=DTYPE)

    batch, heads, kv_heads, head_dim = case.batch, case.heads, case.kv_heads, case.head_dim
    key_scores = randn(1, kv_heads, 1, case.seqlen_k)
    mask = block_topk_mask(key_scores, case.keep)
    query = randn(batch, case.seqlen_q, heads, head_dim)
    key = randn(batch, case.seqlen_k, kv_heads, head_dim)
    value = randn(batch, case.seqlen_k, kv_heads, head_dim)
    bias = key_scores if case.bias == "key" else randn(1, heads, case.seqlen_q, case.seqlen_k)
    for t in (query, key, value, bias):
        t.requires_grad_(case.needs_grad)
    return Inputs(query=query, key=key, value=value, mask=mask, bias=bias)
