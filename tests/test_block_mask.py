"""The block summary: states, sorted lists, broadcast axes, and its use by the reference."""

import pytest
import torch

from flash_dma import BlockMask, block_mask_from_state, build_block_mask, flash_dma_func
from flash_dma.block_mask import EMPTY, FULL, PARTIAL
from tests.helpers import DEVICE, SUMMARY_BLOCK_SIZES, SUMMARY_CASES, Case, make_inputs, make_mask


def brute_force_state(mask: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    nb, nh, sq, sk = mask.shape
    bq, bk = (block_q if sq > 1 else 1), (block_k if sk > 1 else 1)
    state = torch.empty(nb, nh, -(-sq // bq), -(-sk // bk), dtype=torch.int8)
    for i in range(state.shape[2]):
        for j in range(state.shape[3]):
            block = mask[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].bool().cpu()
            state[:, :, i, j] = torch.where(block.all(-1).all(-1), FULL, torch.where(block.any(-1).any(-1), PARTIAL, EMPTY))
    return state


def check_lists(lists: torch.Tensor, state: torch.Tensor) -> None:
    columns = state.shape[-1]
    for code, which in ((PARTIAL, 0), (FULL, 1)):
        hit = (state == code).cpu()
        rank = lists[..., which, 1, :].cpu()
        assert torch.equal(rank[..., 1:], hit.cumsum(-1).int()) and not rank[..., 0].any()
        for index in torch.nonzero(torch.ones(state.shape[:-1])):
            n = rank[(*index, columns)]
            listed = lists[(*index, which, 0)][:n].cpu()
            assert torch.equal(listed, torch.nonzero(hit[tuple(index)]).flatten().int())


@pytest.mark.parametrize("block_size", SUMMARY_BLOCK_SIZES, ids=lambda b: f"block{b[0]}x{b[1]}")
@pytest.mark.parametrize("case", SUMMARY_CASES, ids=str)
def test_summary_matches_brute_force(case, block_size):
    mask = make_mask(case, case.generator())
    summary = build_block_mask(mask, block_size=block_size)
    expected = brute_force_state(mask, *block_size)
    assert torch.equal(summary.state.cpu(), expected)
    assert summary.mask_shape == tuple(mask.shape)
    check_lists(summary.kv_lists, summary.state)
    check_lists(summary.q_lists, summary.state.transpose(-1, -2))


def test_per_key_mask_has_one_query_block():
    mask = torch.rand(2, 4, 1, 1000, device=DEVICE) < 0.1
    summary = build_block_mask(mask)
    assert summary.state.shape == (2, 4, 1, 8)
    assert summary.kv_lists.shape == (2, 4, 1, 2, 2, 9)


def test_summary_of_int_mask_equals_bool_mask():
    mask = torch.rand(1, 2, 40, 50, device=DEVICE) < 0.3
    assert torch.equal(build_block_mask(mask.int(), block_size=(16, 16)).state, build_block_mask(mask, block_size=(16, 16)).state)


def test_block_size_is_validated():
    with pytest.raises(ValueError, match=r"block_size: expected a pair of values from \(16, 32, 64, 128, 256\), got \(128, 100\)"):
        build_block_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool), block_size=(128, 100))
    with pytest.raises(ValueError, match=r"state: expected shape \(1, 1, 1, 2\)"):
        block_mask_from_state(torch.zeros(1, 1, 1, 3), (1, 1, 1, 200))


@pytest.mark.parametrize("block_size", [(16, 16), (32, 16)], ids=lambda b: f"block{b[0]}x{b[1]}")
def test_reference_with_summary_equals_reference_with_mask(block_size):
    case = Case(seqlen_q=70, seqlen_k=90, mask="B,Hkv,Sq,Sk", bias="1,H,Sq,Sk", mask_kind="blocks", causal=True)
    inputs = make_inputs(case, torch.float32)
    summary = build_block_mask(inputs["attn_mask"], block_size=block_size)
    expected = flash_dma_func(**inputs, is_causal=True, backend="reference")
    actual = flash_dma_func(**inputs, block_mask=summary, is_causal=True, backend="reference")
    assert torch.equal(actual, expected)


def test_block_level_summary_without_element_mask():
    # A summary made of EMPTY/FULL blocks is a mask on its own.
    state = torch.tensor([[[[FULL, EMPTY, FULL]]]], dtype=torch.int8, device=DEVICE)
    summary = block_mask_from_state(state, (1, 1, 1, 40), block_size=(16, 16))
    assert not summary.needs_mask
    case = Case(batch=1, heads=2, kv_heads=1, seqlen_q=5, seqlen_k=40)
    inputs = make_inputs(case, torch.float32)
    mask = torch.zeros(1, 1, 1, 40, dtype=torch.bool, device=DEVICE)
    mask[..., :16] = mask[..., 32:] = True
    expected = flash_dma_func(**{**inputs, "attn_mask": mask})
    # The two take different tile paths (FULL blocks vs masked tiles): equal up to rounding.
    torch.testing.assert_close(flash_dma_func(**inputs, block_mask=summary), expected, rtol=1e-5, atol=1e-6)
