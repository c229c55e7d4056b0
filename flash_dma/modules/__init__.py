"""Neural-network layers built on :func:`flash_dma.flash_dma_func`, and their generation caches."""

from flash_dma.modules.attention import DynamicMaskAttention
from flash_dma.modules.cache import KVCache, PagedKVCache
from flash_dma.modules.indexer import LightningIndexer
from flash_dma.modules.rotary import RotaryEmbedding

__all__ = ["DynamicMaskAttention", "KVCache", "LightningIndexer", "PagedKVCache", "RotaryEmbedding"]
