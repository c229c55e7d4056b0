"""The demo's model: a small causal transformer whose attention layers are DynamicMaskAttention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flash_dma.modules import DynamicMaskAttention


class PositiveBiasAttention(DynamicMaskAttention):
    """:class:`DynamicMaskAttention` whose per-key bias is ``bias_scale * exp(A) * softplus(dt_proj(V))``.

    The library's bias ``A * softplus(dt)`` starts from ``A = 0``: every key tied, and the sign of
    ``A``, which decides whether the selection keeps the keys with the largest or the smallest
    ``dt``, is learned from a gradient that is mostly noise until recall begins. Here the factor in
    front of ``softplus(dt)`` is positive from the start (``bias_scale``, as ``A`` starts at 0), so
    the ranking is always that of ``dt`` and what ``dt_proj`` learns is never turned upside down.
    """

    def __init__(self, hidden_size: int, *args, bias_scale: float, **kwargs):
        super().__init__(hidden_size, *args, **kwargs)
        if isinstance(bias_scale, bool) or not isinstance(bias_scale, (int, float)) or not bias_scale > 0:
            raise ValueError(f"bias_scale: expected a float > 0 or None, got {bias_scale!r}")
        if self.importance != "softplus":
            raise ValueError(f"importance: bias_scale needs importance='softplus', got {self.importance!r}")
        self.bias_scale = float(bias_scale)

    def key_importance(self, value: torch.Tensor) -> torch.Tensor:
        batch, seqlen, _, _ = value.shape
        dt = self.dt_proj(value.reshape(batch, seqlen, self.num_kv_heads * self.head_dim))  # [B, Sk, Hkv]
        strength = self.bias_scale * torch.exp(self.A) * F.softplus(dt)
        return strength.float().transpose(1, 2).unsqueeze(2)


class Block(nn.Module):
    """Pre-norm residual block: RMSNorm -> attention, RMSNorm -> GELU MLP (4x wide)."""

    def __init__(self, hidden_size: int, attention: DynamicMaskAttention):
        super().__init__()
        self.attention_norm = nn.RMSNorm(hidden_size)
        self.attention = attention
        self.mlp_norm = nn.RMSNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """``x`` ``[B, S, E]`` -> ``([B, S, E], the attention's selection)``."""
        attended, selection = self.attention(self.attention_norm(x), return_selection=True)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), selection


class RecallTransformer(nn.Module):
    """Token and previous-token embeddings, ``num_layers`` blocks, a linear read-out.

    Each position embeds its token plus the token before it (a token shift, as in RWKV, or the
    "smeared keys" of induction-head studies), so a value token carries its key and one attention
    hop can fetch the value of a queried key; the attention layers must find it among the fillers.

    Args:
        vocab_size: V.
        hidden_size: E.
        num_layers: the number of blocks.
        bias_scale: None for the library's bias ``A * softplus(dt)`` (A from 0, sign learned); a
            float > 0 for :class:`PositiveBiasAttention`'s ``bias_scale * exp(A) * softplus(dt)``.
        attention_kwargs: the arguments of :class:`DynamicMaskAttention` after ``hidden_size``
            (``num_heads``, ``window_size``...), the same for every layer.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, num_layers: int, *, bias_scale: float | None = None, **attention_kwargs
    ):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_size)
        self.previous_token_embedding = nn.Embedding(vocab_size, hidden_size)

        def attention() -> DynamicMaskAttention:
            if bias_scale is None:
                return DynamicMaskAttention(hidden_size, **attention_kwargs)
            return PositiveBiasAttention(hidden_size, bias_scale=bias_scale, **attention_kwargs)

        self.blocks = nn.ModuleList(Block(hidden_size, attention()) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size)

    @property
    def attention_layers(self) -> list[DynamicMaskAttention]:
        return [block.attention for block in self.blocks]

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """``tokens`` ``[B, S]`` -> ``(logits [B, S, V], one selection per layer)``."""
        # The first position has no predecessor; token 0 (the separator) stands in for it.
        previous = F.pad(tokens[:, :-1], (1, 0), value=0)
        x = self.token_embedding(tokens) + self.previous_token_embedding(previous)
        selections = []
        for block in self.blocks:
            x, selection = block(x)
            selections.append(selection)
        return self.head(self.norm(x)), selections
