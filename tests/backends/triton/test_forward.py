"""The Triton forward kernel against the float64 reference, error relative to PyTorch's own."""

import pytest
import torch

from flash_dma import build_block_mask, flash_dma_func
from flash_dma.backends.triton.forward import attention_forward
from tests.helpers import (
    DEVICE,
    DTYPE_IDS,
    KERNEL_DTYPES,
    Case,
    assert_close,
    broadcast_cases,
    case_dtypes,
    kernel_call,
    listed_variants,
    make_fp8_inputs,
    make_inputs,
    packed_variants,
    reference_outputs,
    triton_call,
)

BLOCKS = (16, 16)
FORWARD_CASES = [
    # Every mask and bias broadcast shape, with whole tiles empty, full or mixed.
    *broadcast_cases(Case(seqlen_q=17, seqlen_k=63, mask_kind="blocks", block_size=BLOCKS)),
    # Causal with Sq > Sk (top rows see nothing), MQA, some rows fully masked, default summary blocks.
    *broadcast_cases(Case(seqlen_q=130, seqlen_k=63, heads=3, kv_heads=1, causal=True, mask_kind="rows"))[::2],
    # Head dims, padded internally to the next power of two.
    *(
        Case(seqlen_q=63, seqlen_k=130, head_dim=d, mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True, block_size=(32, 32))
        for d in (16, 40, 64, 96, 128, 192, 256)
    ),
    # Ragged lengths both ways.
    Case(seqlen_q=1, seqlen_k=1, mask="B,H,Sq,Sk", bias="B,H,Sq,Sk"),
    Case(seqlen_q=1, seqlen_k=130, mask="B,H,Sq,Sk", bias="1,1,1,Sk", causal=True),
    Case(seqlen_q=130, seqlen_k=1, bias="B,H,Sq,Sk", causal=True),
    Case(seqlen_q=239, seqlen_k=17, mask="B,H,Sq,Sk", mask_kind="blocks", block_size=(32, 16)),
    Case(seqlen_q=17, seqlen_k=239, mask="1,Hkv,Sq,Sk", mask_kind="blocks", causal=True, block_size=(16, 64)),
    Case(seqlen_q=113, seqlen_k=113, heads=4, kv_heads=4, mask="B,H,Sq,Sk", mask_kind="blocks", causal=True, block_size=BLOCKS),
    # Windows (bottom-right aligned), alone and with causal; windows wider than the keys.
    Case(seqlen_q=63, seqlen_k=130, mask="B,Hkv,1,Sk", window=(7, 3), block_size=BLOCKS),
    Case(seqlen_q=130, seqlen_k=63, bias="B,H,Sq,Sk", window=(0, 0)),
    Case(seqlen_q=63, seqlen_k=63, mask="B,H,Sq,Sk", mask_kind="blocks", window=(20, -1), causal=True, block_size=BLOCKS),
    Case(seqlen_q=40, seqlen_k=63, bias="1,H,1,Sk", window=(-1, 5)),
    Case(seqlen_q=17, seqlen_k=20, mask="B,H,Sq,Sk", window=(1000, 1000)),
    # Softcap, with and without a bias.
    Case(seqlen_q=63, seqlen_k=63, softcap=5.0, causal=True),
    Case(seqlen_q=63, seqlen_k=130, mask="B,Hkv,1,Sk", bias="B,Hkv,Sq,Sk", softcap=2.0, block_size=BLOCKS),
    # No mask and no bias at all: plain (causal) attention.
    Case(seqlen_q=130, seqlen_k=130, heads=8, kv_heads=2, causal=True),
]
# Every broadcast shape as a BitMask (the kernels read its bits), and the rows-mask cases.
FORWARD_CASES += packed_variants(FORWARD_CASES[:18]) + packed_variants(FORWARD_CASES[18:27])
FORWARD_CASES += listed_variants(FORWARD_CASES)


@pytest.mark.parametrize("case, dtype", case_dtypes(FORWARD_CASES))
def test_forward_matches_reference(case, dtype, poison_outputs):
    inputs = make_inputs(case, dtype)
    out, lse = triton_call(case, inputs, return_lse=True)
    oracle_out, oracle_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, inputs, None, dtype)
    assert out.dtype == dtype
    assert_close("out", out, oracle_out, baseline_out)
    assert_close("lse", lse, oracle_lse, baseline_lse)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_rows_with_no_visible_key(dtype, poison_outputs):
    case = Case(seqlen_q=70, seqlen_k=40, mask="B,H,Sq,Sk", mask_kind="rows", causal=True, block_size=BLOCKS)
    inputs = make_inputs(case, dtype)
    out, lse = triton_call(case, inputs, return_lse=True)
    _, oracle_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    empty = torch.isneginf(oracle_lse)  # [B, H, Sq]
    assert empty.any() and (~empty).any()
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.equal(out.transpose(1, 2)[empty], torch.zeros_like(out.transpose(1, 2)[empty]))
    assert not out.isnan().any()


DECODE_CASES = [
    Case(batch=1, seqlen_q=1, seqlen_k=700, heads=4, kv_heads=2, mask="B,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True, block_size=(64, 64)),
    Case(batch=2, seqlen_q=3, seqlen_k=300, heads=6, kv_heads=2, mask="1,1,Sq,Sk", bias="B,H,Sq,Sk"),
    Case(batch=1, seqlen_q=2, seqlen_k=300, heads=4, kv_heads=1, mask="B,H,1,Sk", window=(50, 0), block_size=(16, 32)),
    Case(batch=1, seqlen_q=1, seqlen_k=257, heads=2, kv_heads=2, bias="1,1,1,Sk", softcap=3.0),
]


@pytest.mark.parametrize("num_splits", [1, 2, 5], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_split_kv_decode(case, num_splits, poison_outputs):
    """Short queries split the keys across programs and merge the parts through their LSEs."""
    dtype = KERNEL_DTYPES[0]
    inputs = make_inputs(case, dtype)
    window = (case.window[0], 0) if case.causal else case.window
    summary = None
    if inputs["attn_mask"] is not None:
        summary = build_block_mask(inputs["attn_mask"], block_size=case.block_size or (128, 128))
    call = kernel_call(inputs, summary, softmax_scale=case.head_dim**-0.5, window=window, softcap=case.softcap)
    out, lse = attention_forward(call, num_splits=num_splits)
    oracle_out, oracle_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, inputs, None, dtype)
    assert_close("out", out, oracle_out, baseline_out)
    assert_close("lse", lse, oracle_lse, baseline_lse)


@pytest.mark.parametrize("case", DECODE_CASES[:2], ids=str)
def test_split_kv_is_chosen_for_decode(case, poison_outputs):
    # Through the public function: the heuristic splits these (few programs, many keys).
    dtype = KERNEL_DTYPES[0]
    inputs = make_inputs(case, dtype)
    oracle_out, _, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, _, _ = reference_outputs(case, inputs, None, dtype)
    assert_close("out", triton_call(case, inputs), oracle_out, baseline_out)


def test_block_mask_is_reusable():
    case = Case(seqlen_q=63, seqlen_k=90, mask="B,Hkv,Sq,Sk", bias="1,H,1,Sk", mask_kind="blocks", causal=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    summary = build_block_mask(inputs["attn_mask"], block_size=(16, 32))
    first = triton_call(case, inputs, block_mask=summary)
    other = make_inputs(case.with_(bias="B,H,Sq,Sk"), KERNEL_DTYPES[0])
    triton_call(case, {**other, "attn_mask": inputs["attn_mask"]}, block_mask=summary)
    assert torch.equal(triton_call(case, inputs, block_mask=summary), first)
    # The summary built per call (default blocks) gives the same attention.
    oracle, _, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline, _, _ = reference_outputs(case, inputs, None, KERNEL_DTYPES[0])
    assert_close("out", triton_call(case, inputs), oracle, baseline)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(batch=1, seqlen_q=32768, seqlen_k=32768, heads=2, kv_heads=1, head_dim=64, mask="B,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True),
        Case(batch=1, seqlen_q=8192, seqlen_k=8192, heads=4, kv_heads=2, head_dim=128, mask="B,H,Sq,Sk", mask_kind="blocks", bias="1,H,1,Sk", causal=True),
        Case(batch=1, seqlen_q=1, seqlen_k=524288, heads=2, kv_heads=1, head_dim=64, mask="B,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True),
    ],
    ids=str,
)
def test_long_sequences(case, poison_outputs):
    dtype = KERNEL_DTYPES[0]
    inputs = make_inputs(case, dtype)
    out, lse = triton_call(case, inputs, return_lse=True)
    oracle_out, oracle_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, inputs, None, dtype)
    assert_close("out", out, oracle_out, baseline_out)
    assert_close("lse", lse, oracle_lse, baseline_lse)


@pytest.mark.parametrize(
    "case",
    [
        Case(seqlen_q=70, seqlen_k=90, heads=4, kv_heads=2, head_dim=32, mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True),
        Case(seqlen_q=1, seqlen_k=300, heads=4, kv_heads=1, head_dim=64, bias="1,H,1,Sk", bias_fp32=True),  # decode: split
    ],
    ids=str,
)
def test_fp8_inputs_match_reference(case, poison_outputs):
    """FP8 inputs through ``flash_dma_func``: the Hopper forward where it serves them, else the
    float32 kernel on their dequantized values. Oracle: float64 on the dequantized inputs; baseline:
    float32 with Hopper's FP8 tensor-core products modelled (``fp8_tensor_cores``), output in
    bfloat16."""
    quantized, exact, descale = make_fp8_inputs(case)
    descales = dict(zip(("q_descale", "k_descale", "v_descale"), descale.unbind(-1)))
    out, lse = flash_dma_func(
        quantized["query"], quantized["key"], quantized["value"], quantized["attn_mask"], quantized["attn_bias"],
        is_causal=case.causal, return_lse=True, backend="triton", **descales,
    )
    oracle_out, oracle_lse, _ = reference_outputs(case, exact, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, exact, None, torch.float32, fp8_tensor_cores=True)
    assert out.dtype == torch.bfloat16
    assert_close("out", out, oracle_out, baseline_out.to(torch.bfloat16))
    assert_close("lse", lse, oracle_lse, baseline_lse)


@pytest.mark.gpu_only
def test_bias_larger_than_two_to_the_31_elements():
    """Head offsets into a full bias past 2^31 elements are 64-bit (they overflowed into an illegal
    memory access): the last head's last row matches that row computed on its own (a one-row
    call splits the keys differently, hence a bf16 tolerance)."""
    heads, seqlen, head_dim = 16, 12288, 64  # 16 * 12288^2 = 2.4e9 bias elements
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, seqlen, heads, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, seqlen, 1, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    bias = torch.randn(1, heads, seqlen, seqlen, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    out = flash_dma_func(q, k, v, attn_bias=bias, is_causal=True, backend="triton")
    last = flash_dma_func(q[:, -1:], k, v, attn_bias=bias[:, :, -1:], is_causal=True, backend="triton")
    torch.testing.assert_close(out[:, -1:, -1:], last[:, :, -1:], rtol=1e-2, atol=1e-2)
