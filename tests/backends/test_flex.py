"""The Flex backend against the float64 reference, and the block mask it gives Flex.

On the CPU Flex has no backward pass, so there the module's forward is checked directly (Flex's
eager implementation); on CUDA the backend runs compiled, gradients included.
"""

import pytest
import torch

from flash_dma import build_block_mask, flash_dma_func, flash_dma_varlen_func, flash_dma_with_kvcache
from flash_dma.backends import flex, get_available_backends
from flash_dma.backends.reference import visible_positions
from flash_dma.block_mask import EMPTY, FULL, effective_mask_rows
from flash_dma.inputs import normalize_inputs
from flash_dma.masks import topk_block_mask
from tests.helpers import (
    DEVICE,
    DTYPE_IDS,
    KERNEL_DTYPES,
    ON_GPU,
    Case,
    assert_close,
    assert_gradients_close,
    broadcast_cases,
    call_kwargs,
    make_inputs,
    reference_outputs,
)

CASES = [
    *broadcast_cases(Case(seqlen_q=17, seqlen_k=150, mask_kind="blocks")),
    Case(seqlen_q=150, seqlen_k=60, heads=3, kv_heads=1, mask="B,H,Sq,Sk", mask_kind="rows", bias="B,Hkv,Sq,Sk", causal=True),
    Case(seqlen_q=140, seqlen_k=300, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="1,1,1,Sk", causal=True, block_size=(32, 64)),
    Case(seqlen_q=300, seqlen_k=300, mask="1,H,Sq,Sk", mask_kind="blocks", bias="B,H,Sq,Sk", window=(100, 20), block_size=(256, 16)),
    Case(seqlen_q=130, seqlen_k=260, bias="1,H,Sq,Sk", softcap=3.0, causal=True),
    Case(seqlen_q=1, seqlen_k=300, heads=8, kv_heads=2, mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True),
    Case(seqlen_q=200, seqlen_k=200, head_dim=64, window=(30, -1)),
    Case(seqlen_q=90, seqlen_k=90, heads=8, kv_heads=8, causal=True),
]


def _problem(case: Case, inputs: dict, block_mask=None):
    return normalize_inputs(
        **inputs, softmax_scale=None, **call_kwargs(case), block_mask=block_mask, deterministic=False
    )


def _summary(case: Case, inputs: dict):
    if case.block_size and inputs["attn_mask"] is not None:
        return build_block_mask(inputs["attn_mask"], block_size=case.block_size)
    return None


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_reference(case):
    inputs = make_inputs(case, torch.float32)
    out, lse = flex.attention(_problem(case, inputs, _summary(case, inputs)))
    expected, expected_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=2e-5, rtol=2e-5)


def test_the_lse_is_asked_for_without_deprecated_arguments(monkeypatch, recwarn):
    case = CASES[1]
    inputs = make_inputs(case, torch.float32)
    out, lse = flex.attention(_problem(case, inputs))
    assert not [w for w in recwarn if "return_lse" in str(w.message)]  # torch >= 2.9 deprecates it
    # A torch without AuxRequest (2.5-2.8) gets return_lse, and the same LSE.
    from torch.nn.attention import flex_attention as flex_module

    with monkeypatch.context() as without:  # torch's own Flex code needs AuxRequest back for the call
        without.delattr(flex_module, "AuxRequest", raising=False)
        assert flex._lse_request() == {"return_lse": True}
    monkeypatch.setattr(flex, "_lse_request", lambda: {"return_lse": True})
    old_out, old_lse = flex.attention(_problem(case, inputs))
    assert torch.equal(old_out, out) and torch.equal(old_lse, lse)


def _visible(case: Case, inputs: dict, summary) -> torch.Tensor:
    """``[B|1, H|1, Sq, Sk]`` what the contract attends: the band, and the mask as the summary reads it."""
    window = (case.window[0], 0) if case.causal else case.window
    band = visible_positions(torch.arange(case.seqlen_q), case.seqlen_q, case.seqlen_k, window)
    mask = effective_mask_rows(inputs["attn_mask"], summary, 0, case.seqlen_q, case.seqlen_k)
    if mask is None:
        return band[None, None]
    if mask.shape[1] not in (1, case.heads):
        mask = mask.repeat_interleave(case.heads // mask.shape[1], dim=1)
    return band & mask


@pytest.mark.parametrize("case", CASES, ids=str)
def test_block_states_are_exact_where_they_claim(case):
    inputs = make_inputs(case, torch.float32, device="cpu")
    summary = _summary(case, inputs)
    state = flex._block_state(_problem(case, inputs, summary))
    if state is None:
        assert case.mask is None and case.window == (-1, -1) and not case.causal
        return
    visible = _visible(case, inputs, summary)
    block = flex.FLEX_BLOCK
    for qb in range(state.shape[2]):
        for kb in range(state.shape[3]):
            tile = visible[..., qb * block : (qb + 1) * block, kb * block : (kb + 1) * block]
            tile_state = state[..., qb, kb]
            any_visible, all_visible = tile.any((-1, -2)), tile.all(-1).all(-1)
            assert not ((tile_state == EMPTY) & any_visible).any(), (qb, kb)
            assert not ((tile_state == FULL) & ~all_visible).any(), (qb, kb)
            # Tight where no mask is involved: the band alone is classified exactly.
            if case.mask is None:
                assert torch.equal(tile_state == EMPTY, ~any_visible) and torch.equal(tile_state == FULL, all_visible)


def test_block_level_summary_from_topk():
    case = Case(seqlen_q=256, seqlen_k=384, causal=True, bias="B,Hkv,1,Sk")
    inputs = make_inputs(case, torch.float32)
    summary = topk_block_mask(inputs["attn_bias"], 128, block_size=(64, 64), query_len=256, is_causal=True, local_blocks=1)
    out, _ = flex.attention(_problem(case, inputs, summary))
    expected, _, _ = reference_outputs(case, inputs, None, torch.float64, block_mask=summary)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_listed_only_on_cuda():
    assert ("flex" in get_available_backends(DEVICE)) == ON_GPU
    assert "flex" not in get_available_backends("cpu")


def test_what_flex_cannot_do_raises():
    case = Case(seqlen_q=20, seqlen_k=20, bias="B,H,Sq,Sk")
    inputs = make_inputs(case, torch.float32, requires_grad=True)
    problem = normalize_inputs(**inputs, softmax_scale=None, is_causal=True, deterministic=True)
    with pytest.raises(ValueError, match="deterministic: the 'flex' backend cannot make gradients bitwise"):
        flex.attention(problem)
    with pytest.raises(ValueError, match="backend: 'flex' does not serve flash_dma_with_kvcache"):
        flex.attention_with_cache(None)


@pytest.mark.gpu_only
def test_unsupported_calls_name_the_argument():
    q = torch.randn(20, 4, 16, device=DEVICE)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="backend: 'flex' does not take packed sequences"):
        flash_dma_varlen_func(q, q, q, cu, cu, 12, 12, backend="flex")
    cache = torch.zeros(1, 32, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="backend: 'flex' does not serve"):
        flash_dma_with_kvcache(q[None, :1], cache, cache, cache_seqlens=4, backend="flex")
    small = torch.randn(1, 8, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="query: the 'flex' backend needs a head dim of at least 16"):
        flash_dma_func(small, small, small, backend="flex")


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", KERNEL_DTYPES[:1], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradients_match_reference(case, dtype):
    inputs = make_inputs(case, dtype, requires_grad=True)
    out = flash_dma_func(**inputs, **call_kwargs(case), block_mask=_summary(case, inputs), backend="flex")
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    out.backward(dout)
    oracle_out, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    baseline_out, _, baseline = reference_outputs(case, inputs, dout, dtype)
    assert_close("out", out, oracle_out, baseline_out)
    assert_gradients_close(inputs, oracle, baseline)


def test_flex_block_masks_are_made_once_per_summary_and_mask_version():
    case = Case(seqlen_q=140, seqlen_k=300, mask="B,Hkv,1,Sk", mask_kind="blocks", causal=True)
    inputs = make_inputs(case, torch.float32)
    summary = build_block_mask(inputs["attn_mask"])
    problem = _problem(case, inputs, summary)
    made = flex._flex_block_mask(problem)
    assert flex._flex_block_mask(_problem(case, inputs, summary)) is made
    assert flex._flex_block_mask(_problem(case.with_(window=(50, -1)), inputs, summary)) is not made
    inputs["attn_mask"][0, 0, 0, :10] = True  # a new mask version: its mask_mod must read it afresh
    assert flex._flex_block_mask(_problem(case, inputs, summary)) is not made
