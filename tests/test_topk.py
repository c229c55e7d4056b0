"""flash_dma_topk_func's argument checks (``flash_dma/topk.py``), its semantics on the reference
backend, and the packed per-query mask problem that states the same call for the dense kernels."""

import dataclasses

import pytest
import torch

from flash_dma import flash_dma_func, flash_dma_topk_func, topk_mask
from flash_dma.backends import flex, reference
from flash_dma.topk import as_mask_problem, normalize_topk_inputs, plane_heads
from tests.helpers import DEVICE

B, SQ, SK, H, HKV, D, W = 2, 8, 12, 4, 2, 16, 3


def _inputs(**overrides):
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "query": torch.randn(B, SQ, H, D, generator=gen),
        "key": torch.randn(B, SK, HKV, D, generator=gen),
        "value": torch.randn(B, SK, HKV, D, generator=gen),
        "indices": torch.randint(0, SK, (B, SQ, HKV, W), generator=gen, dtype=torch.int32),
        "attn_bias": None,
    }
    inputs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs.update(overrides)
    return inputs


BAD_INPUTS = [
    ("indices-list", dict(indices=[[0]]), TypeError, r"indices: expected a torch.Tensor, got list"),
    ("indices-int64", dict(indices=torch.zeros(B, SQ, HKV, W, dtype=torch.int64)), TypeError,
     r"indices: expected dtype torch.int32, got torch.int64"),
    ("indices-heads", dict(indices=torch.zeros(B, SQ, H, W, dtype=torch.int32)), ValueError,
     r"indices: expected shape \[B, Sq, Hkv, W\] = \[2, 8, 2, W\], got \(2, 8, 4, 3\)"),
    ("indices-3d", dict(indices=torch.zeros(B, SQ, W, dtype=torch.int32)), ValueError, r"indices: expected shape \[B, Sq, Hkv, W\]"),
    ("bias-pairs-width", dict(attn_bias=torch.zeros(B, SQ, H, W + 1)), ValueError,
     r"attn_bias: expected per pair \[1\|B, Sq, 1\|Hkv\|H, W\] = \[1\|2, 8, 1\|2\|4, 3\] or per key "
     r"\[1\|B, 1\|Hkv\|H, Sk\] = \[1\|2, 1\|2\|4, 12\], got shape \(2, 8, 4, 4\)"),
    ("bias-keys-heads", dict(attn_bias=torch.zeros(B, 3, SK)), ValueError, r"attn_bias: expected per pair .* got shape \(2, 3, 12\)"),
    # One batch entry and one K/V head: each size once (``[1, 8, 1|4, 3]``, not ``[1|1, 8, 1|1|4, 3]``).
    ("bias-pairs-mqa", dict(query=torch.zeros(1, SQ, H, D), key=torch.zeros(1, SK, 1, D), value=torch.zeros(1, SK, 1, D),
                            indices=torch.zeros(1, SQ, 1, W, dtype=torch.int32), attn_bias=torch.zeros(1, SQ, 2, W)), ValueError,
     r"= \[1, 8, 1\|4, 3\] or per key \[1\|B, 1\|Hkv\|H, Sk\] = \[1, 1\|4, 12\]"),
    ("bias-dense", dict(attn_bias=torch.zeros(B, H, SQ, SK)), ValueError, r"attn_bias: expected per pair"),
    ("bias-dtype", dict(attn_bias=torch.zeros(B, H, SK, dtype=torch.float64)), TypeError,
     r"attn_bias: expected dtype torch.float32, got torch.float64"),
    ("bias-type", dict(attn_bias=1.0), TypeError, r"attn_bias: expected a torch.Tensor or None, got float"),
    ("key-heads", dict(key=torch.zeros(B, SK, 3, D), value=torch.zeros(B, SK, 3, D)), ValueError,
     r"key: expected a number of heads that divides the 4 heads of query .*, got 3"),
    ("window-negative", dict(window_size=(-2, 0)), ValueError, r"window_size: left size must be -1"),
    ("softcap-negative", dict(softcap=-1.0), ValueError, r"softcap: expected a finite float >= 0"),
    ("deterministic-int", dict(deterministic=1), TypeError, r"deterministic: expected a bool, got int 1"),
    ("unique-indices-none", dict(unique_indices=None), TypeError, r"unique_indices: expected a bool, got NoneType None"),
    ("backend-unknown", dict(backend="cuda"), ValueError, r"backend: expected one of"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), [p[1:] for p in BAD_INPUTS], ids=[p[0] for p in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(overrides, error, message):
    overrides = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in overrides.items()}
    with pytest.raises(error, match=message):
        flash_dma_topk_func(**_inputs(**overrides))


def test_flex_does_not_serve_topk():
    # On the CPU flex is unavailable altogether; where it runs, it refuses top-k calls by name.
    with pytest.raises(ValueError, match=r"backend: 'flex' does not serve flash_dma_topk_func"):
        flex.topk_attention(None)


def test_a_listed_key_counts_once_per_entry():
    # Listing key 3 twice weighs it as two keys: the same as attending a copy of it.
    inputs = _inputs(indices=torch.tensor([3, 3, 5], dtype=torch.int32).expand(B, SQ, HKV, 3).contiguous().to(DEVICE))
    out = flash_dma_topk_func(**inputs, backend="reference")
    key = torch.cat([inputs["key"], inputs["key"][:, 3:4]], dim=1)
    value = torch.cat([inputs["value"], inputs["value"][:, 3:4]], dim=1)
    copy = torch.tensor([3, SK, 5], dtype=torch.int32, device=DEVICE).expand(B, SQ, HKV, 3).contiguous()
    expected = flash_dma_topk_func(inputs["query"], key, value, copy, backend="reference")
    torch.testing.assert_close(out, expected)


def test_out_of_range_entries_count_as_none():
    indices = torch.tensor([2, -1, SK, SK + 7, -5], dtype=torch.int32, device=DEVICE).expand(B, SQ, HKV, 5).contiguous()
    out = flash_dma_topk_func(**_inputs(indices=indices), backend="reference")
    only = flash_dma_topk_func(**_inputs(indices=indices[..., :1].contiguous()), backend="reference")
    torch.testing.assert_close(out, only)


@pytest.mark.parametrize(("causal", "window"), [(True, (-1, -1)), (False, (3, 1)), (True, (2, 0))], ids=["causal", "win3,1", "causal-win2"])
def test_reference_equals_flash_dma_func_on_the_mask_of_distinct_indices(causal, window):
    gen = torch.Generator().manual_seed(1)
    indices = torch.rand(B, SQ, HKV, SK, generator=gen).argsort(-1)[..., :5].to(DEVICE, torch.int32)
    bias = torch.randn(B, H, SK, generator=gen).to(DEVICE)
    inputs = _inputs(indices=indices, attn_bias=bias)
    top, top_lse = flash_dma_topk_func(**inputs, is_causal=causal, window_size=window, return_lse=True, backend="reference")
    dense, dense_lse = flash_dma_func(
        inputs["query"], inputs["key"], inputs["value"], topk_mask(indices, SK), bias[:, :, None, :],
        is_causal=causal, window_size=window, return_lse=True, backend="reference",
    )
    torch.testing.assert_close(top, dense)
    torch.testing.assert_close(top_lse, dense_lse)


@pytest.mark.parametrize("bias", [None, (B, SQ, HKV, W), (1, SQ, H, W), (1, SQ, 1, W), (B, H, SK), (1, 1, SK)],
                         ids=["none", "pairs-B,Hkv", "pairs-1,H", "pairs-1,1", "keys-B,H", "keys-1,1"])
def test_the_packed_mask_problem_attends_as_the_indices(bias):
    """Entries listed twice or three times, -1, past Sk and past the diagonal, and -inf biases (on
    one entry of a repeated key, and on every entry of another): the same output, LSE and gradients."""
    gen = torch.Generator().manual_seed(3)
    indices = torch.randint(-1, SK + 2, (B, SQ, HKV, W), generator=gen, dtype=torch.int32)
    indices[..., 1] = indices[..., 0]
    indices[:, ::2, :, 2] = indices[:, ::2, :, 0]
    inputs = _inputs(indices=indices.to(DEVICE))
    if bias is not None:
        values = torch.randn(bias, generator=gen)
        values[torch.rand(bias, generator=gen) < 0.2] = float("-inf")
        inputs["attn_bias"] = values.to(DEVICE)
    leaves = [t.requires_grad_() for t in (inputs["query"], inputs["key"], inputs["value"], inputs["attn_bias"]) if t is not None]
    problem = normalize_topk_inputs(**inputs, softmax_scale=None, is_causal=True, window_size=(6, -1), softcap=3.0,
                                    deterministic=False)
    packed = as_mask_problem(problem)
    assert packed.attn_mask.shape == (B, HKV, SQ, SK) and not packed.deterministic
    assert as_mask_problem(dataclasses.replace(problem, deterministic=True)).deterministic
    _assert_attends_as_the_indices(problem, packed, leaves)


def _assert_attends_as_the_indices(problem, packed, leaves) -> None:
    """The packed ``flash_dma_func`` problem has the top-k ``problem``'s output, LSE and gradients
    of ``leaves`` (in their shapes), on the reference backend."""
    results = []
    for out, lse in (reference.topk_attention(problem), reference.attention(packed)):
        results.append((out, lse, torch.autograd.grad(out.square().sum(), leaves)))
    (out, lse, grads), (packed_out, packed_lse, packed_grads) = results
    torch.testing.assert_close(packed_out, out)
    torch.testing.assert_close(packed_lse, lse)
    for grad, packed_grad in zip(grads, packed_grads):
        assert not packed_grad.isnan().any() and packed_grad.shape == grad.shape
        torch.testing.assert_close(packed_grad, grad, atol=1e-4, rtol=1e-4)  # sums over queries in another order


@pytest.mark.parametrize(
    ("unique", "bias", "heads"),
    [(True, None, 0), (True, (B, H, SK), 0), (True, (1, SQ, 1, W), HKV), (False, None, HKV), (False, (1, H, SK), H),
     (False, (B, SQ, HKV, W), HKV)],
    ids=["unique", "unique-keys", "unique-pairs", "repeats", "repeats-keys-H", "repeats-pairs-Hkv"],
)
def test_a_bias_plane_is_needed_for_repeats_or_a_per_pair_bias(unique, bias, heads):
    inputs = _inputs(attn_bias=None if bias is None else torch.randn(bias).to(DEVICE))
    problem = normalize_topk_inputs(**inputs, softmax_scale=None, is_causal=False, window_size=(-1, -1), softcap=0.0,
                                    deterministic=False, unique_indices=unique)
    assert plane_heads(problem) == heads
    packed = as_mask_problem(problem)
    if heads:
        assert packed.attn_bias.shape == (B, heads, SQ, SK) and packed.attn_bias.dtype == torch.float32
    else:  # the caller's per-key bias, or none
        assert packed.attn_bias is None if bias is None else packed.attn_bias.shape == (B, H, 1, SK)


@pytest.mark.parametrize("bias", [None, (B, H, SK), (1, 1, SK)], ids=["none", "keys-B,H", "keys-1,1"])
def test_unique_indices_attend_as_the_indices_without_a_plane(bias):
    """Distinct keys per list (with -1 and entries past Sk): the packed problem without a plane has
    the index attention's output, LSE and gradients, the bias's in its own shape."""
    gen = torch.Generator().manual_seed(5)
    indices = torch.rand(B, SQ, HKV, SK + 2, generator=gen).argsort(-1)[..., :W].to(torch.int32)
    indices[:, ::3, :, 0] = -1
    inputs = _inputs(indices=indices.to(DEVICE))
    if bias is not None:
        inputs["attn_bias"] = torch.randn(bias, generator=gen).to(DEVICE)
    leaves = [t.requires_grad_() for t in (inputs["query"], inputs["key"], inputs["value"], inputs["attn_bias"]) if t is not None]
    problem = normalize_topk_inputs(**inputs, softmax_scale=None, is_causal=True, window_size=(-1, -1), softcap=0.0,
                                    deterministic=False, unique_indices=True)
    packed = as_mask_problem(problem)
    assert packed.attn_bias is None or packed.attn_bias.dim() == 4 and packed.attn_bias.shape[2] == 1
    _assert_attends_as_the_indices(problem, packed, leaves)
