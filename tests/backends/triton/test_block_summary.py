"""The block summary kernels build exactly what the torch summary does (``block_mask.py``)."""

import pytest
import torch

from flash_dma.backends.triton.block_summary import block_lists, block_state
from flash_dma.block_mask import block_lists as torch_block_lists
from flash_dma.block_mask import summarize_mask
from tests.helpers import DEVICE, SUMMARY_BLOCK_SIZES, SUMMARY_CASES, Case, make_mask


@pytest.mark.parametrize("block_size", SUMMARY_BLOCK_SIZES, ids=lambda b: f"block{b[0]}x{b[1]}")
@pytest.mark.parametrize(
    "case", [*SUMMARY_CASES, Case(seqlen_q=40, seqlen_k=2100, mask="1,H,Sq,Sk")], ids=str  # rows of many chunks
)
def test_kernels_match_the_torch_summary(case, block_size):
    mask = make_mask(case, case.generator())
    expected = summarize_mask(mask, *block_size)
    state = block_state(mask, *block_size)
    assert torch.equal(state, expected)
    assert torch.equal(block_lists(state, False), torch_block_lists(expected))
    assert torch.equal(block_lists(state, True), torch_block_lists(expected.transpose(-1, -2)))


def test_integer_masks_and_broadcast_strides():
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(1, 2, 50, 70, generator=gen) < 0.5).to(DEVICE, torch.int64).expand(3, 2, 50, 70)
    assert torch.equal(block_state(mask, 16, 32), summarize_mask(mask, 16, 32))
