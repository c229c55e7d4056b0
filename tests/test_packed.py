"""Packed (varlen) sequences: the contract's semantics on every backend, and input errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_dma import build_block_mask, flash_dma_func, flash_dma_varlen_func, get_available_backends, topk_block_mask
from flash_dma.block_mask import FULL
from tests.helpers import DEVICE

# Flex serves neither packed sequences nor caches (tests/backends/test_flex.py checks that it says so).
BACKENDS = [name for name in get_available_backends(DEVICE) if name != "flex"]
LENS = (6, 0, 20, 1)


def cu(lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)


def packed(lens_q=LENS, lens_k=LENS, heads=2, kv_heads=1, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, dim, generator=gen).to(DEVICE)
    k, v = (torch.randn(sum(lens_k), kv_heads, dim, generator=gen).to(DEVICE) for _ in range(2))
    bias = torch.randn(kv_heads, sum(lens_k), generator=gen).to(DEVICE)
    return q, k, v, bias


def varlen(q, k, v, lens_q=LENS, lens_k=LENS, **kwargs):
    return flash_dma_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_sequence_is_its_own_problem(backend):
    """Sequence by sequence, varlen equals flash_dma_func on that sequence alone (causal bottom-right)."""
    lens_q, lens_k = (3, 0, 12, 1), (7, 2, 12, 5)
    q, k, v, bias = packed(lens_q, lens_k)
    mask = torch.rand(bias.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
    out, lse = varlen(q, k, v, lens_q, lens_k, attn_mask=mask, attn_bias=bias, is_causal=True, return_lse=True, backend=backend)
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu(lens_q).tolist()), itertools.pairwise(cu(lens_k).tolist())):
        expected, expected_lse = flash_dma_func(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], mask[None, :, None, k0:k1], bias[None, :, None, k0:k1],
            is_causal=True, return_lse=True, backend="reference",
        )
        torch.testing.assert_close(out[q0:q1], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, q0:q1], expected_lse[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequences_never_see_each_other(backend):
    q, k, v, bias = packed()
    out = varlen(q, k, v, attn_bias=bias, backend=backend)
    k2, v2 = k.clone(), v.clone()
    k2[6:26], v2[6:26] = 5.0, -5.0  # the third sequence's keys (the second is empty)
    changed = varlen(q, k2, v2, attn_bias=bias, backend=backend)
    assert torch.equal(out[:6], changed[:6]) and torch.equal(out[26:], changed[26:])
    assert not torch.allclose(out[6:26], changed[6:26])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_and_keyless_rows_give_zero(backend):
    lens_q, lens_k = (4, 3), (0, 5)
    q, k, v, bias = packed(lens_q, lens_k)
    mask = torch.ones(1, 5, dtype=torch.bool, device=DEVICE)
    mask[0, :] = False
    q.requires_grad_()
    out, lse = varlen(q, k, v, lens_q, lens_k, attn_mask=mask, return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_bias_gradient_comes_back_packed():
    q, k, v, bias = packed()
    bias.requires_grad_()
    varlen(q, k, v, attn_bias=bias, is_causal=True).square().sum().backward()
    assert bias.grad.shape == bias.shape and bias.grad.abs().sum() > 0


def test_topk_block_mask_selects_per_sequence_and_treats_sequence_ends_as_bounds():
    lens = (40, 20, 33)
    _, _, _, bias = packed(lens, lens)
    block_mask = topk_block_mask(bias, 16, block_size=(16, 16), cu_seqlens_k=cu(lens), max_seqlen_k=40)
    assert block_mask.mask_shape == (3, 1, 1, 40) and not block_mask.needs_mask
    # Each sequence keeps one block (16 keys), chosen among its own blocks only.
    kept = (block_mask.state == FULL).sum(dim=-1).flatten().tolist()
    assert kept == [1, 1, 1]
    chosen = block_mask.state[1, 0, 0].tolist()
    assert chosen[2] == 0  # the second sequence has 20 keys: block 2 lies past its end
    with pytest.raises(ValueError, match="query_len"):
        topk_block_mask(bias, 16, query_len=40, cu_seqlens_k=cu(lens), max_seqlen_k=40)


def test_build_block_mask_of_a_packed_mask():
    lens = (40, 20)
    mask = torch.zeros(1, 60, dtype=torch.bool, device=DEVICE)
    mask[0, 16:32] = True  # the first sequence's second block
    summary = build_block_mask(mask, block_size=(16, 16), cu_seqlens_k=cu(lens), max_seqlen_k=40)
    assert summary.mask_shape == (2, 1, 1, 40)
    assert summary.state[:, 0, 0].tolist() == [[0, 2, 0], [0, 0, 0]]


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(cu_seqlens_q=torch.tensor([1, 6, 6, 26, 27], dtype=torch.int32)), "cu_seqlens_q: must start at 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 6, 4, 26, 27], dtype=torch.int32)), "cu_seqlens_k: must never decrease"),
        (dict(cu_seqlens_q=torch.tensor([0, 6, 6, 26, 28], dtype=torch.int32)), "must end at the total length 27"),
        (dict(max_seqlen_q=10), "longest sequence has 20 tokens, more than max_seqlen = 10"),
        (dict(cu_seqlens_k=torch.tensor([0.0, 27.0])), "cu_seqlens_k: expected dtype torch.int32"),
        (dict(cu_seqlens_k=torch.tensor([0, 10, 27], dtype=torch.int32)), "cu_seqlens_k: expected 5 entries"),
        (dict(attn_bias=torch.zeros(1, 26)),
         r"attn_bias: dimension 1 \(keys\) of a packed \[1\|Hkv\|H, total_k\] tensor must be 1 or 27, got 26 \(shape \(1, 26\)\)"),
        # Per-query biases, as a user might try them: the message quotes the shape given, not the kernels' entries.
        (dict(attn_bias=torch.zeros(27, 27)), r"attn_bias: dimension 0 \(heads\) .* got 27 \(shape \(27, 27\)\); .* never per query"),
        (dict(attn_bias=torch.zeros(4, 20, 20)),
         r"attn_bias: dimension 1 \(heads\) of a per-sequence \[1\|N, 1\|Hkv\|H, 1\|max_seqlen_k\] tensor must be 1 or .*"
         r"got 20 \(shape \(4, 20, 20\)\)"),
        (dict(attn_mask=torch.ones(3, 1, 20, dtype=torch.bool)), r"attn_mask: dimension 0 \(sequences\) .* must be 1 or 4, got 3"),
        (dict(attn_mask=torch.ones(1, 1, 1, 27, dtype=torch.bool)), "attn_mask: expected a packed"),
        (dict(q=torch.zeros(27, 2, 8, 1)), r"q: expected a 3-D tensor \[total_q, H, D\]"),
    ],
    ids=lambda x: x if isinstance(x, str) else "-".join(x),
)
def test_bad_packed_input_is_named(change, error):
    q, k, v, _ = packed()
    arguments = dict(q=q, k=k, v=v, cu_seqlens_q=cu(LENS), cu_seqlens_k=cu(LENS), max_seqlen_q=20, max_seqlen_k=20)
    arguments.update({name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in change.items()})
    with pytest.raises((ValueError, TypeError), match=error):
        flash_dma_varlen_func(**arguments)
