"""Triton varlen (packed sequences) against the float64 reference, forward and backward, on every walk."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest
import torch

import flash_dma.backends.triton as triton_backend
from flash_dma import build_block_mask, flash_dma_varlen_func, topk_block_mask
from flash_dma.backends.reference import packed_attention
from flash_dma.packed import normalize_varlen_inputs, sequence_rows
from tests.helpers import (
    DEVICE, KERNEL_DTYPES, REPEATS_ON_GPU, assert_close, assert_gradients_close, case_dtypes, guarded, seeded_generator,
)


@dataclass(frozen=True)
class VarlenCase:
    lens_q: tuple[int, ...] = (5, 0, 33, 1, 17)
    lens_k: tuple[int, ...] = (9, 3, 33, 1, 40)
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mask: str | None = None  # "packed" [Hkv, total_k], "sequence" [N, Hkv, max_k], or None
    bias: str | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    # "small": the mask read element-wise; "keys": a key list; "summary": build_block_mask;
    # "topk": topk_block_mask from the bias (no element mask).
    walk: str = "small"

    def __str__(self) -> str:
        parts = [f"q{'-'.join(map(str, self.lens_q))}", f"k{'-'.join(map(str, self.lens_k))}"]
        parts.append(f"H{self.heads}-Hkv{self.kv_heads}-D{self.head_dim}")
        parts += [f"mask-{self.mask}"] if self.mask else []
        parts += [f"bias-{self.bias}"] if self.bias else []
        parts += ["causal"] if self.causal else []
        parts += [f"win{self.window[0]},{self.window[1]}"] if self.window != (-1, -1) else []
        parts += [f"cap{self.softcap:g}"] if self.softcap else []
        return "-".join(parts + [self.walk])

    @property
    def cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(
            torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
            for lens in (self.lens_q, self.lens_k)
        )

    def per_key(self, form: str | None, gen, dtype) -> torch.Tensor | None:
        if form is None:
            return None
        shape = (self.kv_heads, sum(self.lens_k)) if form == "packed" else (len(self.lens_k), self.kv_heads, max(self.lens_k))
        values = torch.randn(shape, generator=gen)
        return (values > -0.5).to(DEVICE) if dtype == torch.bool else values.to(DEVICE, dtype)


def make_varlen_inputs(case: VarlenCase, dtype: torch.dtype) -> dict:
    gen = seeded_generator(str(case))
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    q = torch.randn(tq, case.heads, case.head_dim, generator=gen)
    k, v = (torch.randn(tk, case.kv_heads, case.head_dim, generator=gen) for _ in range(2))
    bias = case.per_key(case.bias, gen, dtype)
    cu_q, cu_k = case.cu_seqlens
    return {
        "q": guarded(q.to(DEVICE, dtype)).requires_grad_(),
        "k": guarded(k.to(DEVICE, dtype)).requires_grad_(),
        "v": guarded(v.to(DEVICE, dtype)).requires_grad_(),
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": max(case.lens_q),
        "max_seqlen_k": max(case.lens_k),
        "attn_mask": case.per_key(case.mask, gen, torch.bool),
        "attn_bias": None if bias is None else guarded(bias).requires_grad_(),
    }


def settings(case: VarlenCase) -> dict:
    return {"is_causal": case.causal, "window_size": case.window, "softcap": case.softcap}


def triton_varlen(case: VarlenCase, inputs: dict, **kwargs):
    """The Triton backend, walking the case's way."""
    blocks = {"cu_seqlens_k": inputs["cu_seqlens_k"], "max_seqlen_k": inputs["max_seqlen_k"], "block_size": (16, 16)}
    if case.walk == "summary":
        kwargs["block_mask"] = build_block_mask(inputs["attn_mask"], **blocks)
    if case.walk == "topk":
        kwargs["block_mask"] = topk_block_mask(inputs["attn_bias"].detach(), 24, **blocks)
    small = triton_backend.SMALL_PROBLEM
    triton_backend.SMALL_PROBLEM = 0 if case.walk == "keys" else small
    try:
        return flash_dma_varlen_func(**inputs, **settings(case), backend="triton", **kwargs)
    finally:
        triton_backend.SMALL_PROBLEM = small


def reference_varlen(case, inputs, block_mask, dout, compute_dtype):
    """``(out, lse, grads)`` of the reference in ``compute_dtype`` (inputs cast for float64)."""
    cast = (lambda t: t.detach().double()) if compute_dtype == torch.float64 else (lambda t: t.detach())
    leaves = {name: cast(inputs[name]).requires_grad_() for name in ("q", "k", "v", "attn_bias") if inputs[name] is not None}
    problem = normalize_varlen_inputs(
        *(inputs[name].detach() for name in ("q", "k", "v")), inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
        inputs["max_seqlen_q"], inputs["max_seqlen_k"], inputs["attn_mask"], None,
        softmax_scale=None, block_mask=block_mask, deterministic=False, **settings(case),
    )
    bias = leaves.get("attn_bias")
    if bias is not None:
        bias = sequence_rows("attn_bias", bias, problem.cu_seqlens_k, problem.max_seqlen_k, sum(case.lens_k), 0.0)
    problem = replace(problem, query=leaves["q"][None], key=leaves["k"][None], value=leaves["v"][None], attn_bias=bias)
    out, lse = packed_attention(problem, compute_dtype=compute_dtype)
    out[0].backward(cast(dout))
    return out[0].detach(), lse[0], {name: t.grad for name, t in leaves.items()}


CASES = [
    VarlenCase(mask="packed", bias="packed"),
    VarlenCase(mask="packed", bias="packed", causal=True),
    VarlenCase(mask="sequence", bias="packed", window=(6, 2)),
    VarlenCase(bias="sequence", causal=True, softcap=4.0, heads=3, kv_heads=1),
    VarlenCase(lens_q=(1, 1, 1), lens_k=(70, 3, 40), mask="packed", bias="packed", causal=True),
    VarlenCase(lens_q=(40, 70), lens_k=(40, 70), heads=2, kv_heads=2, head_dim=40, causal=True),
]
CASES += [replace(case, walk=walk) for case in CASES if case.mask for walk in ("keys", "summary")]
CASES += [VarlenCase(bias="packed", causal=True, walk="topk"), VarlenCase(mask="packed", bias="packed", causal=True, walk="topk")]


@pytest.mark.parametrize("case, dtype", case_dtypes(CASES))
def test_varlen_matches_reference(case, dtype, poison_outputs):
    inputs = make_varlen_inputs(case, dtype)
    out, lse = triton_varlen(case, inputs, return_lse=True)
    block_mask = None
    if case.walk == "topk":  # the same summary for the reference
        block_mask = topk_block_mask(
            inputs["attn_bias"].detach(), 24, cu_seqlens_k=inputs["cu_seqlens_k"],
            max_seqlen_k=inputs["max_seqlen_k"], block_size=(16, 16),
        )
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    out.backward(dout)
    oracle_out, oracle_lse, oracle = reference_varlen(case, inputs, block_mask, dout, torch.float64)
    base_out, base_lse, baseline = reference_varlen(case, inputs, block_mask, dout, dtype)
    assert out.shape == inputs["q"].shape and lse.shape == (case.heads, sum(case.lens_q))
    assert_close("out", out, oracle_out, base_out)
    assert_close("lse", lse, oracle_lse, base_lse)
    assert_gradients_close(inputs, oracle, baseline)


@REPEATS_ON_GPU
def test_varlen_deterministic_gradients_are_bitwise_reproducible():
    case = VarlenCase(mask="packed", bias="packed", causal=True, walk="keys")
    grads = []
    for _ in range(2):
        inputs = make_varlen_inputs(case, KERNEL_DTYPES[0])
        triton_varlen(case, inputs, deterministic=True).sum().backward()
        grads.append([inputs[name].grad for name in ("q", "k", "v", "attn_bias")])
    for first, second in zip(*grads):
        assert torch.equal(first, second)
