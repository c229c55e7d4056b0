"""The Hopper forward (warp-specialised Gluon kernel) against the float64 reference.

It runs on sm90 only; elsewhere these tests skip, and ``test_compiles_for_gpu`` compiles it.
Cases reach the kernel directly (``hopper_forward``), whatever the dispatch would pick for them.
"""

import pytest
import torch

from flash_dma import build_block_mask
from flash_dma.backends.triton import forward as forward_module
from flash_dma.backends.triton.forward import attention_forward
from flash_dma.backends.triton.forward_hopper import hopper_forward, hopper_forward_supported
from flash_dma.backends.triton.key_list import build_key_list
from tests.helpers import DTYPE_IDS, HOPPER_ONLY, KERNEL_DTYPES, Case, assert_close, make_inputs, reference_outputs

pytestmark = HOPPER_ONLY

PER_KEY = "B,Hkv,1,Sk"
CASES = [
    # A per-key mask in 16-key runs: 128-key tiles are PARTIAL, some FULL or EMPTY.
    Case(seqlen_q=130, seqlen_k=239, head_dim=64, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    Case(seqlen_q=1023, seqlen_k=1023, head_dim=128, mask=PER_KEY, bias="1,H,1,Sk", mask_kind="blocks", causal=True, block_size=(128, 128)),
    Case(seqlen_q=239, seqlen_k=1023, heads=6, kv_heads=2, head_dim=128, mask="1,1,1,Sk", bias="B,1,1,Sk", mask_kind="blocks", block_size=(128, 128)),
    # Summary blocks of two tiles, and summary rows of two row blocks.
    Case(seqlen_q=600, seqlen_k=777, head_dim=64, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(256, 256)),
    # Causal with Sq > Sk: the top rows see nothing (out 0, lse -inf).
    Case(seqlen_q=300, seqlen_k=63, heads=3, kv_heads=1, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True, block_size=(128, 128)),
    # Ragged lengths, no summary: the dense walk, with and without a bias.
    Case(seqlen_q=1, seqlen_k=1, head_dim=64, bias=PER_KEY),
    Case(seqlen_q=17, seqlen_k=1023, head_dim=128, bias="1,H,1,Sk", bias_fp32=True, causal=True),
    Case(seqlen_q=1023, seqlen_k=17, head_dim=64, causal=True),
    Case(seqlen_q=113, seqlen_k=113, heads=8, kv_heads=8, head_dim=128),
    # Windows: narrow, both sides, and wider than the keys.
    Case(seqlen_q=500, seqlen_k=700, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", window=(100, 3), block_size=(128, 128)),
    Case(seqlen_q=130, seqlen_k=130, head_dim=64, bias=PER_KEY, window=(0, 0)),
    Case(seqlen_q=63, seqlen_k=90, head_dim=128, bias=PER_KEY, window=(5000, 5000), causal=True),
    # Many work items per program (the persistent grid wraps around several times).
    Case(batch=3, seqlen_q=2048, seqlen_k=2048, heads=16, kv_heads=4, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
]


# Per-key masks walked as key lists: kept keys scattered one by one, so every tile gathers them.
KEY_LIST_CASES = [
    Case(seqlen_q=130, seqlen_k=239, head_dim=64, mask=PER_KEY, bias=PER_KEY, causal=True),
    Case(seqlen_q=1023, seqlen_k=1023, heads=6, kv_heads=2, head_dim=128, mask="1,1,1,Sk", bias="1,H,1,Sk", causal=True),
    Case(seqlen_q=300, seqlen_k=777, head_dim=128, mask=PER_KEY, bias="B,1,1,Sk", bias_fp32=True),
    Case(seqlen_q=500, seqlen_k=700, head_dim=64, mask=PER_KEY, window=(100, 3)),
    # Causal with Sq > Sk: the top rows see nothing; windows wider than the keys.
    Case(seqlen_q=300, seqlen_k=63, heads=3, kv_heads=1, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True),
    Case(seqlen_q=63, seqlen_k=90, head_dim=128, mask=PER_KEY, bias=PER_KEY, window=(5000, 5000), causal=True),
    Case(batch=3, seqlen_q=2048, seqlen_k=2048, heads=16, kv_heads=4, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True),
]


def _summary(case: Case, mask: torch.Tensor | None):
    if mask is None or case.block_size is None:
        return None, 0, 0
    summary = build_block_mask(mask, block_size=case.block_size)
    block_q = summary.block_size[0] if summary.state.shape[2] > 1 else 0
    block_k = summary.block_size[1] if summary.state.shape[3] > 1 else 0
    return summary.kv_lists, block_q, block_k


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_hopper_forward_matches_reference(case, dtype):
    inputs = make_inputs(case, dtype)
    q, k, v, mask, bias = (inputs[n] for n in ("query", "key", "value", "attn_mask", "attn_bias"))
    lists, block_q, block_k = _summary(case, mask)
    assert hopper_forward_supported(q, k, v, mask, bias, lists, None, block_q, block_k, 0.0)
    window = (case.window[0], 0) if case.causal else case.window
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    before = [t.clone() for t in (q, k, v) + ((bias,) if bias is not None else ())]
    hopper_forward(q, k, v, mask, bias, lists, None, block_q, block_k, case.head_dim**-0.5, *window, out, lse)
    oracle_out, oracle_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, inputs, None, dtype)
    assert_close("out", out, oracle_out, baseline_out)
    assert_close("lse", lse, oracle_lse, baseline_lse)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v) + ((bias,) if bias is not None else ())))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", KEY_LIST_CASES, ids=str)
def test_hopper_forward_gathers_kept_keys(case, dtype, poison_outputs):
    """A key list: K and V of the kept keys gathered (into NaN-poisoned buffers: a slot read but
    not written shows up), positions checked against the band on edge tiles."""
    inputs = make_inputs(case, dtype)
    q, k, v, mask, bias = (inputs[n] for n in ("query", "key", "value", "attn_mask", "attn_bias"))
    if mask.shape[0] * mask.shape[1] > 1:
        mask[0, 0] = False  # a (batch, kv head) that keeps no key: its rows are empty (out 0, lse -inf)
    keys = build_key_list(mask, case.seqlen_k)
    assert hopper_forward_supported(q, k, v, None, bias, None, keys, 0, 0, 0.0)
    window = (case.window[0], 0) if case.causal else case.window
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    hopper_forward(q, k, v, None, bias, None, keys, 0, 0, case.head_dim**-0.5, *window, out, lse)
    oracle_out, oracle_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, inputs, None, dtype)
    assert_close("out", out, oracle_out, baseline_out)
    assert_close("lse", lse, oracle_lse, baseline_lse)


def test_packed_query_view_is_read_through_its_strides():
    """q sliced out of a packed [B, S, 3, H, D] projection: heads and rows are strided."""
    case = Case(seqlen_q=300, seqlen_k=300, heads=4, kv_heads=4, head_dim=128, bias=PER_KEY, causal=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    packed = torch.stack([inputs["query"], inputs["key"], inputs["value"]], dim=2)  # [B, S, 3, H, D]
    q, k, v = packed.unbind(2)
    out = torch.empty_like(inputs["query"])
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    assert hopper_forward_supported(q, k, v, None, inputs["attn_bias"], None, None, 0, 0, 0.0)
    hopper_forward(q, k, v, None, inputs["attn_bias"], None, None, 0, 0, case.head_dim**-0.5, -1, 0, out, lse)
    oracle_out, _, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, _, _ = reference_outputs(case, inputs, None, KERNEL_DTYPES[0])
    assert_close("out", out, oracle_out, baseline_out)


def test_forward_dispatch(monkeypatch):
    """Large plain forwards take the Hopper kernel, with a key list too; FLASH_DMA_HOPPER=0 and softcap do not."""
    case = Case(batch=1, seqlen_q=4096, seqlen_k=4096, heads=16, kv_heads=4, head_dim=128, bias=PER_KEY, causal=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    calls = []
    monkeypatch.setattr(forward_module, "hopper_forward", lambda *args: calls.append(args))
    args = (inputs["query"], inputs["key"], inputs["value"], None, inputs["attn_bias"], None, None, 0, 0, 0.1, -1, 0)
    attention_forward(*args, 0.0)
    keys = build_key_list(torch.rand(1, 4, 1, 4096, device=inputs["query"].device) < 0.1, 4096)
    attention_forward(*args[:6], keys, *args[7:], 0.0)
    assert len(calls) == 2 and calls[1][6] is keys
    attention_forward(*args, 5.0)  # softcap
    monkeypatch.setenv("FLASH_DMA_HOPPER", "0")
    attention_forward(*args, 0.0)
    assert len(calls) == 2
