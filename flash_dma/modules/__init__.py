"""Neural-network layers built on :func:`flash_dma.flash_dma_func`."""

from flash_dma.modules.attention import DynamicMaskAttention
from flash_dma.modules.rotary import RotaryEmbedding

__all__ = ["DynamicMaskAttention", "RotaryEmbedding"]
