"""flash_dma_topk_func on the Triton kernels against the float64 gather-based reference: output,
LSE and every gradient, with -1 entries, duplicates, out-of-range entries, rows with no counting
entry, causal and window rules on the indices, both bias forms, GQA and MQA; each through the
index kernels and through the packed per-query mask that short calls run as."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flash_dma import flash_dma_func, flash_dma_topk_func, topk_mask
from flash_dma.backends import triton as triton_backend
from tests.helpers import DEVICE, DTYPE_IDS, KERNEL_DTYPES, Case, assert_close, call_kwargs, guarded, topk_reference_outputs


@dataclass(frozen=True)
class TopkCase(Case):
    """A top-k problem: ``bias`` is ``"pairs:<b>,<h>"`` or ``"keys:<b>,<h>"`` (b in {1, B}, h in {1, Hkv, H}) or None."""

    seqlen_k: int = 63
    width: int = 5
    # Keys drawn from the first `hot` keys only (0: all), so that many queries pick the same keys.
    hot: int = 0

    def __str__(self) -> str:
        return super().__str__() + f"-W{self.width}" + (f"-hot{self.hot}" if self.hot else "")


def make_indices(case: TopkCase, gen: torch.Generator) -> torch.Tensor:
    """Random keys with -1 entries, entries past Sk, repeats, and one query row listing nothing."""
    shape = (case.batch, case.seqlen_q, case.kv_heads, case.width)
    high = case.hot or max(case.seqlen_k, 1)  # with no key at all, key 0 is out of range too
    indices = torch.randint(0, high, shape, generator=gen)
    draw = torch.rand(shape, generator=gen)
    indices = torch.where(draw < 0.15, -1, indices)
    indices = torch.where(draw > 0.95, case.seqlen_k + torch.randint(0, 3, shape, generator=gen), indices)
    repeat = torch.rand(shape, generator=gen) < 0.2
    indices = torch.where(repeat, indices.roll(1, dims=-1), indices)
    indices[:, case.seqlen_q // 2 :][:, :1] = -1
    return indices.to(DEVICE, torch.int32)


def make_topk_inputs(case: TopkCase, dtype: torch.dtype, requires_grad: bool = True) -> dict:
    gen = case.generator()
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, generator=gen)
    k = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, generator=gen)
    v = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, generator=gen)
    bias = None
    if case.bias:
        form, dims = case.bias.split(":")
        b, h = (int({"B": case.batch, "H": case.heads, "Hkv": case.kv_heads}.get(d, d)) for d in dims.split(","))
        shape = (b, case.seqlen_q, h, case.width) if form == "pairs" else (b, h, case.seqlen_k)
        bias = guarded(torch.randn(shape, generator=gen).to(DEVICE, torch.float32 if case.bias_fp32 else dtype))
        bias.requires_grad_(requires_grad)
    q, k, v = (guarded(t.to(DEVICE, dtype)).requires_grad_(requires_grad) for t in (q, k, v))
    return {"query": q, "key": k, "value": v, "indices": make_indices(case, gen), "attn_bias": bias}


def reference(case: TopkCase, inputs: dict, dout: torch.Tensor, compute_dtype: torch.dtype):
    """``(out, lse, grads)`` of the reference in ``compute_dtype`` (inputs cast to it in float64)."""
    window = (case.window[0], 0) if case.causal else case.window
    return topk_reference_outputs(inputs, dout, compute_dtype, window, softcap=case.softcap)


def run_triton(case: TopkCase, inputs: dict, **kwargs):
    out, lse = flash_dma_topk_func(**inputs, **call_kwargs(case), return_lse=True, backend="triton", **kwargs)
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    out.backward(dout)
    return out, lse, dout


def check_against_reference(case: TopkCase, dtype: torch.dtype, deterministic: bool = False) -> None:
    """Output, LSE and every gradient (in its input's dtype and shape) against the float64 reference."""
    inputs = make_topk_inputs(case, dtype)
    out, lse, dout = run_triton(case, inputs, deterministic=deterministic)
    oracle_out, oracle_lse, oracle = reference(case, inputs, dout, torch.float64)
    base_out, base_lse, baseline = reference(case, inputs, dout, dtype)
    assert_close("out", out, oracle_out, base_out)
    assert_close("lse", lse, oracle_lse, base_lse)
    for name, expected in oracle.items():
        grad = inputs[name].grad
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        assert_close(name, grad, expected, baseline[name])


TOPK_CASES = [
    TopkCase(bias="pairs:B,H", causal=True),
    TopkCase(batch=1, seqlen_q=63, seqlen_k=17, heads=3, kv_heads=1, head_dim=40, width=64, bias="keys:1,1", window=(8, 2)),
    TopkCase(seqlen_q=1, seqlen_k=130, heads=2, kv_heads=2, head_dim=64, width=64, softcap=2.0),
    TopkCase(batch=1, seqlen_q=130, seqlen_k=130, heads=8, kv_heads=2, width=1, bias="keys:B,H", causal=True),
    TopkCase(seqlen_q=17, seqlen_k=1, heads=4, kv_heads=4, width=5, bias="pairs:1,Hkv"),
    TopkCase(batch=1, seqlen_q=63, seqlen_k=63, head_dim=64, width=64, bias="pairs:1,1", bias_fp32=True, softcap=3.0, causal=True, hot=6),
    TopkCase(batch=2, seqlen_q=17, seqlen_k=63, heads=4, kv_heads=1, width=5, bias="keys:B,Hkv", bias_fp32=True, causal=True, hot=3),
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", TOPK_CASES, ids=str)
def test_topk_matches_reference(case, dtype, topk_walk, poison_outputs):
    """dK and dV added by atomics in the dQ walk (the index kernels), or a packed per-query mask."""
    check_against_reference(case, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", TOPK_CASES, ids=str)
def test_deterministic_topk_matches_reference(case, dtype, poison_outputs, monkeypatch):
    """deterministic=True on the index kernels: dK and dV key-outer, over the sorted inverse map."""
    monkeypatch.setattr(triton_backend, "TOPK_PACKED_KEYS_PER_ENTRY", 0)
    check_against_reference(case, dtype, deterministic=True)


@pytest.mark.parametrize("seqlen_k, packed", [(32, True), (33, False)])
def test_calls_whose_lists_cover_a_quarter_of_the_keys_run_as_the_packed_mask(seqlen_k, packed, monkeypatch):
    converted, convert = [], triton_backend.as_mask_problem
    monkeypatch.setattr(triton_backend, "as_mask_problem", lambda problem: convert(converted.append(problem) or problem))
    case = TopkCase(seqlen_q=9, seqlen_k=seqlen_k, width=8, bias="pairs:B,Hkv")
    check_against_reference(case, KERNEL_DTYPES[0])
    assert triton_backend.TOPK_PACKED_KEYS_PER_ENTRY == 4 and len(converted) == packed


def test_rows_with_no_counting_entry_give_zero_and_no_gradient(topk_walk):
    case = TopkCase(batch=1, seqlen_q=20, seqlen_k=10, heads=2, kv_heads=1, width=4, bias="pairs:1,H", causal=True)
    inputs = make_topk_inputs(case, KERNEL_DTYPES[-1])
    inputs["indices"][:, :12] = 9  # above the diagonal for queries 0..10 (Sq > Sk): none counts
    inputs["indices"][:, 15] = -1
    out, lse, _ = run_triton(case, inputs)
    empty = torch.tensor([i for i in range(20) if i < 11 or i == 15])
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()
    for name in ("query", "attn_bias"):
        assert not inputs[name].grad.isnan().any()
        assert torch.equal(inputs[name].grad[:, empty], torch.zeros_like(inputs[name].grad[:, empty]))


@pytest.mark.parametrize("bias", ["pairs:1,1", "keys:1,H"])
def test_gradients_are_bitwise_reproducible(bias, topk_walk):
    # Many queries pick the same few keys: the dK/dV sums are longest there.
    case = TopkCase(seqlen_q=24, seqlen_k=30, width=8, bias=bias, causal=True, hot=4)
    runs = []
    for _ in range(2):
        inputs = make_topk_inputs(case, KERNEL_DTYPES[0])
        run_triton(case, inputs, deterministic=True)
        runs.append([inputs[n].grad for n in ("query", "key", "value", "attn_bias")])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_equals_flash_dma_func_with_the_bit_mask_of_distinct_indices():
    case = TopkCase(batch=1, seqlen_q=33, seqlen_k=70, width=12, causal=True)
    inputs = make_topk_inputs(case, KERNEL_DTYPES[0], requires_grad=False)
    gen = case.generator("distinct")
    inputs["indices"] = torch.rand(1, 33, 2, 70, generator=gen).argsort(-1)[..., :12].to(DEVICE, torch.int32)
    top = flash_dma_topk_func(**inputs, is_causal=True, backend="triton")
    dense = flash_dma_func(
        inputs["query"], inputs["key"], inputs["value"], topk_mask(inputs["indices"], 70, block_size=(16, 32)),
        is_causal=True, backend="triton",
    )
    # Two kernels, each rounding its output to the dtype: they may differ by an ulp (bf16: eps = 2**-7).
    tolerance = max(2e-3, 2 * torch.finfo(KERNEL_DTYPES[0]).eps)
    torch.testing.assert_close(top, dense, atol=tolerance, rtol=tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_topk_long_llm_shape(dtype):
    case = TopkCase(batch=1, seqlen_q=1023, seqlen_k=1500, heads=16, kv_heads=4, head_dim=128, width=256, bias="keys:1,Hkv", causal=True)
    check_against_reference(case, dtype)
