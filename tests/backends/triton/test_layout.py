"""``layout``: the host's reading of how a call's tensors broadcast over heads."""

import pytest
import torch

from flash_dma.backends.triton.layout import walks_per_group

HEADS, KV_HEADS = 8, 2


def _walk(heads: int, expanded: bool = False) -> torch.Tensor:
    """A summary's lists ``[B, heads, ...]``; ``expanded``: one head's lists broadcast to ``heads``."""
    if expanded:
        return torch.zeros(2, 1, 3, 5, dtype=torch.int32).expand(2, heads, 3, 5)
    return torch.zeros(2, heads, 3, 5, dtype=torch.int32)


@pytest.mark.parametrize(
    ("walk", "heads", "kv_heads", "expected"),
    [
        (None, HEADS, KV_HEADS, 1),
        (_walk(1), HEADS, KV_HEADS, 1),
        (_walk(KV_HEADS), HEADS, KV_HEADS, 1),
        (_walk(HEADS), HEADS, KV_HEADS, HEADS // KV_HEADS),
        (_walk(HEADS, expanded=True), HEADS, KV_HEADS, 1),
        (_walk(HEADS), HEADS, HEADS, 1),
    ],
    ids=["none", "one-summary", "per-kv-head", "per-query-head", "broadcast-to-query-heads", "no-groups"],
)
def test_walks_per_group_counts_the_groups_distinct_summaries(walk, heads, kv_heads, expected):
    assert walks_per_group(walk, heads, kv_heads) == expected
