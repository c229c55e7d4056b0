"""The layer suite's model: a stack of :class:`~flash_dma.modules.DynamicMaskAttention` layers.

Each layer is pre-norm and residual, ``x + layer(rms_norm(x))``, over token embeddings; the step's
loss is the mean square of the residual stream's output, so that attention (projections, selection, kernels)
is what a step costs, not a vocabulary head. The sparse stack selects ``window_size`` keys in
blocks plus the first block for every query (the latency issue's layer); the dense stack is the
same layers with ``window_size=None``: every key, the bias only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flash_dma.benchmark.llama import LLAMA_CONFIG, MODEL_DTYPE, WEIGHT_SEED
from flash_dma.benchmark.suites import LAYER_CONFIG, LAYER_COUNT


def describe_layers() -> str:
    c = LAYER_CONFIG
    return (
        f"{LAYER_COUNT} DynamicMaskAttention layers, hidden {c['hidden_size']}, {c['num_heads']} heads "
        f"({c['num_kv_heads']} K/V), window {c['window_size']} in blocks of {c['block_size']} plus "
        f"{c['sink_blocks']} sink block, random weights"
    )


class LayerStack(nn.Module):
    """Token embeddings, then :data:`LAYER_COUNT` pre-norm residual attention layers."""

    def __init__(self, dense: bool):
        from flash_dma.modules import DynamicMaskAttention

        super().__init__()
        config = LAYER_CONFIG
        if dense:  # every key: no window, and so no blocks to select
            config = {k: v for k, v in config.items() if k not in ("block_size", "sink_blocks")} | {"window_size": None}
        hidden = LAYER_CONFIG["hidden_size"]
        self.embed = nn.Embedding(LLAMA_CONFIG["vocab_size"], hidden)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(LAYER_COUNT))
        self.layers = nn.ModuleList(DynamicMaskAttention(**config) for _ in range(LAYER_COUNT))
        for layer in self.layers:  # away from A = 0, where every key's bias ties
            nn.init.normal_(layer.A)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The loss of a train step's forward, from token ids ``[B, S]``."""
        x = self.embed(input_ids)  # [B, S, E]
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return x.float().square().mean()


def build_layers(dense: bool, device: torch.device | str) -> LayerStack:
    """The stack, sparse or ``dense``, in :data:`~flash_dma.benchmark.llama.MODEL_DTYPE` on ``device``;
    both get the same weights."""
    torch.manual_seed(WEIGHT_SEED)
    with torch.device(device):
        return LayerStack(dense).to(MODEL_DTYPE)


def selection_step(stack: LayerStack, input_ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One layer's key selection as a train step makes it, on the first layer's value states of
    ``input_ids`` ``[B, S]`` (computed here, once): the bias (``key_importance``), then ``select``
    (the block top-k and its summary). The callable returns the summary's block states."""
    layer = stack.layers[0]
    batch, seqlen = input_ids.shape
    with torch.no_grad():
        hidden = stack.norms[0](stack.embed(input_ids))
        value = layer.v_proj(hidden).view(batch, seqlen, layer.num_kv_heads, layer.head_dim)

    def select() -> torch.Tensor:
        bias = layer.key_importance(value)
        return layer.select(bias, None)["block_mask"].state

    return select
