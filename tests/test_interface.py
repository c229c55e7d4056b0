"""The public functions: return values, aliases, backend selection, and what they must not do."""

import pytest
import torch

import flash_dma
from flash_dma import (
    flash_dma_func,
    flash_dma_func_auto,
    flash_dma_topk_func,
    flash_dmattn_func,
    flash_sparse_attn_func,
    get_available_backends,
)
from flash_dma.backends.triton.configs import triton_interpreting
from tests.backends.triton.topk.test_forward_backward import TopkCase, make_topk_inputs
from tests.helpers import DEVICE, Case, make_inputs

BACKENDS = get_available_backends(DEVICE)
CASE = Case(seqlen_q=17, seqlen_k=33, mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True)


def test_available_backends():
    assert "reference" in BACKENDS
    assert ("triton" in BACKENDS) == (DEVICE.type == "cuda" or triton_interpreting())


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_and_lse_shapes(backend):
    inputs = make_inputs(CASE, torch.float32)
    out, lse = flash_dma_func(**inputs, is_causal=True, return_lse=True, backend=backend)
    assert out.shape == inputs["query"].shape and out.dtype == torch.float32
    assert lse.shape == (CASE.batch, CASE.heads, CASE.seqlen_q) and lse.dtype == torch.float32
    assert not lse.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_are_never_modified(backend):
    inputs = make_inputs(CASE, torch.float32, requires_grad=True)
    before = {name: t.detach().clone() for name, t in inputs.items() if t is not None}
    out = flash_dma_func(**inputs, is_causal=True, softcap=3.0, backend=backend)
    out.sum().backward()
    for name, t in before.items():
        assert torch.equal(inputs[name].detach(), t), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_gets_a_gradient_when_nothing_else_does(backend):
    inputs = make_inputs(CASE, torch.float32)
    inputs["attn_bias"].requires_grad_(True)
    flash_dma_func(**inputs, is_causal=True, backend=backend).sum().backward()
    grad = inputs["attn_bias"].grad
    assert grad is not None and grad.shape == inputs["attn_bias"].shape and grad.abs().sum() > 0


def test_seed_aliases_take_v1_arguments_in_v1_order():
    inputs = make_inputs(CASE, torch.float32)
    args = [inputs[n] for n in ("query", "key", "value", "attn_mask", "attn_bias")]
    expected, expected_lse = flash_dma_func(*args, softmax_scale=0.3, is_causal=True, softcap=2.0, return_lse=True)
    for alias in (flash_dmattn_func, flash_sparse_attn_func):
        assert torch.equal(alias(*args, 0.3, True, 2.0, True), expected)
        out, lse, probs = alias(*args, softmax_scale=0.3, is_causal=True, softcap=2.0, return_attn_probs=True)
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse) and probs is None


def test_auto_returns_the_function():
    inputs = make_inputs(CASE, torch.float32)
    attend = flash_dma_func_auto("reference")
    assert torch.equal(attend(**inputs), flash_dma_func(**inputs, backend="reference"))
    assert torch.equal(flash_dma_func_auto()(**inputs), flash_dma_func(**inputs))
    with pytest.raises(ValueError, match=r"backend: expected one of 'triton', 'flex', 'reference' or None, got 'flash'"):
        flash_dma_func_auto("flash")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(0, 5), (5, 0)], ids=["Sq0", "Sk0"])
def test_empty_problems(backend, seqlen_q, seqlen_k):
    inputs = make_inputs(Case(seqlen_q=seqlen_q, seqlen_k=seqlen_k), torch.float32, requires_grad=True)
    out, lse = flash_dma_func(**inputs, return_lse=True, backend=backend)
    assert out.shape == (2, seqlen_q, 4, 16) and not out.any()
    assert torch.isneginf(lse).all()
    out.sum().backward()
    assert not inputs["query"].grad.any()


def test_public_names():
    assert set(flash_dma.__all__) <= set(dir(flash_dma))


TOPK_CASE = TopkCase(seqlen_q=17, seqlen_k=33, width=5, bias="pairs:B,H", causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_output_lse_and_inputs_never_modified(backend):
    if backend == "flex":
        pytest.skip("flex does not serve flash_dma_topk_func (test_topk.py checks the error)")
    inputs = make_topk_inputs(TOPK_CASE, torch.float32)
    before = {name: t.detach().clone() for name, t in inputs.items() if t is not None}
    out, lse = flash_dma_topk_func(**inputs, is_causal=True, softcap=3.0, return_lse=True, backend=backend)
    assert out.shape == inputs["query"].shape and out.dtype == torch.float32
    assert lse.shape == (TOPK_CASE.batch, TOPK_CASE.heads, TOPK_CASE.seqlen_q) and not lse.requires_grad
    out.sum().backward()
    for name, t in before.items():
        assert torch.equal(inputs[name].detach(), t), name


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flex"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "width"), [(0, 5, 3), (5, 0, 3), (5, 7, 0)], ids=["Sq0", "Sk0", "W0"])
def test_topk_empty_problems(backend, seqlen_q, seqlen_k, width):
    case = TopkCase(seqlen_q=seqlen_q, seqlen_k=seqlen_k, width=width, bias="keys:B,Hkv")
    inputs = make_topk_inputs(case, torch.float32)
    out, lse = flash_dma_topk_func(**inputs, return_lse=True, backend=backend)
    assert out.shape == (2, seqlen_q, 4, 16) and not out.any()
    assert torch.isneginf(lse).all()
    out.sum().backward()
    assert not inputs["query"].grad.any() and not inputs["attn_bias"].grad.any()
