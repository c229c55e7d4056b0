"""Context parallelism: attention with dynamic masks and a trainable bias over a sequence sharded
across the ranks of a ``torch.distributed`` process group (NCCL on GPUs, gloo on the CPU).

- :func:`context_parallel_attention`: :func:`flash_dma.flash_dma_func` on shards.
- :func:`plan_context_parallel`: a :class:`ContextParallelPlan`, made once per mask and layout
  and passed to every call that shares them, so that calls make no host round trip.
- :func:`shard_sequence`, :func:`unshard_sequence`, :func:`shard_positions`: the layouts.
- :class:`ContextParallel`: the group and layout, for :class:`flash_dma.modules.DynamicMaskAttention`,
  whose key selection then runs over every shard's keys.

``docs/distributed.md`` explains the layouts with a runnable example.
"""

from flash_dma.distributed.attention import ContextParallelPlan, context_parallel_attention, plan_context_parallel
from flash_dma.distributed.layout import LAYOUTS, ContextParallel, shard_positions, shard_sequence, unshard_sequence

__all__ = [
    "LAYOUTS",
    "ContextParallel",
    "ContextParallelPlan",
    "context_parallel_attention",
    "plan_context_parallel",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
]
