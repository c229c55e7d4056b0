"""Rotary position embedding (RoPE) for :class:`~flash_dma.modules.DynamicMaskAttention`."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates query/key channel pairs by angles proportional to the token's position.

    The layout is the half-split one of Llama/HF (channel ``c`` pairs with ``c + D/2``), so weights
    and positions carry over from those models.

    Args:
        head_dim: D, the size of a query/key head; even.
        base: the base of the geometric sequence of rotation frequencies (10000 in most models).
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim: rotary embedding needs an even head dimension, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        # Not persistent: it is a function of the constructor arguments, not a learned state.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, S, heads, D]`` by the positions ``[1|B, S]`` (int); returns a new tensor."""
        angles = position_ids[..., None].float() * self.inv_freq  # [1|B, S, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # [1|B, S, 1, D]
        first, second = x.chunk(2, dim=-1)
        rotated_half = torch.cat([-second, first], dim=-1)
        return (x * angles.cos() + rotated_half * angles.sin()).to(x.dtype)
