"""Context parallelism: attention with dynamic masks and a trainable bias over a sequence sharded
across the ranks of a ``torch.distributed`` process group (NCCL on GPUs, gloo on the CPU).

- :func:`context_parallel_attention`: :func:`flash_dma.flash_dma_func` on shards.
- :func:`shard_sequence`, :func:`unshard_sequence`, :func:`shard_positions`: the layouts.
- :class:`ContextParallel`: the group and layout, for :class:`flash_dma.modules.DynamicMaskAttention`,
  whose key selection then runs over every shard's keys.

``docs/distributed.md`` explains the layouts with a runnable example.
"""

from flash_dma.distributed.attention import context_parallel_attention
from flash_dma.distributed.layout import LAYOUTS, ContextParallel, shard_positions, shard_sequence, unshard_sequence

__all__ = [
    "LAYOUTS",
    "ContextParallel",
    "context_parallel_attention",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
]
