"""The demo's model: a small causal transformer whose attention layers are DynamicMaskAttention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flash_dma.modules import DynamicMaskAttention


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
        attention_kwargs: the arguments of :class:`DynamicMaskAttention` after ``hidden_size``
            (``num_heads``, ``window_size``...), the same for every layer.
    """

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, **attention_kwargs):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_size)
        self.previous_token_embedding = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(
            Block(hidden_size, DynamicMaskAttention(hidden_size, **attention_kwargs)) for _ in range(num_layers)
        )
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
