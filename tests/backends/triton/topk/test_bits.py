"""The BitMask of top-k indices built by the Triton kernels (``topk/bits.py``) against the torch
build of the same entries (``masks.listed_bit_mask``): words and block states, with -1 entries,
entries past Sk, repeats, causal and window bands, Sq != Sk, and blocks that come out FULL."""

from __future__ import annotations

import pytest
import torch

from flash_dma.backends.reference import valid_indices
from flash_dma.backends.triton.topk.bits import topk_bit_mask
from flash_dma.block_mask import FULL
from flash_dma.masks import listed_bit_mask
from tests.helpers import DEVICE

# (B, Sq, Sk, Hkv, W, window): window with causal folded in (right 0), -1 unbounded.
SHAPES = [
    (2, 130, 300, 2, 40, (-1, 0)),
    (1, 1, 1, 1, 3, (-1, -1)),
    (1, 257, 129, 3, 7, (5, 2)),
    (1, 200, 4096, 1, 600, (-1, -1)),  # more than one program of key blocks per query block
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-Hkv{}-W{}-win{},{}".format(*s[:5], *s[5]))
def test_matches_the_torch_build(shape):
    batch, seqlen_q, seqlen_k, kv_heads, width, window = shape
    gen = torch.Generator().manual_seed(seqlen_q * seqlen_k)
    indices = torch.randint(-2, seqlen_k + 3, (batch, seqlen_q, kv_heads, width), generator=gen, dtype=torch.int32)
    indices[..., 1] = indices[..., 0]  # repeats set one bit
    if seqlen_q >= 128 and width >= 128:
        indices[:, :128, 0, :128] = torch.arange(128, dtype=torch.int32)  # the first block FULL where the band allows
    indices = indices.to(DEVICE)
    built = topk_bit_mask(indices, seqlen_q, seqlen_k, window)
    counting = valid_indices(indices, 0, seqlen_q, seqlen_k, window)
    expected = listed_bit_mask(torch.where(counting, indices, -1).transpose(1, 2), seqlen_k)
    assert built.shape == (batch, kv_heads, seqlen_q, seqlen_k)
    assert torch.equal(built.words, expected.words)
    assert torch.equal(built.summary.state, expected.summary.state)
    assert built.summary.needs_mask


def test_a_block_every_query_lists_whole_is_full():
    indices = torch.arange(256, dtype=torch.int32).expand(1, 128, 1, 256).contiguous().to(DEVICE)
    state = topk_bit_mask(indices, 128, 300, (-1, -1)).summary.state
    assert state.tolist() == [[[[FULL, FULL, 0]]]]
