"""Bad input gets a TypeError/ValueError naming the argument, the expectation and what was given."""

import gc
import weakref

import pytest
import torch

from flash_dma import build_block_mask, flash_dma_func, flash_dma_varlen_func, flash_dma_with_kvcache, memo
from flash_dma import inputs as inputs_module
from tests.helpers import DEVICE

B, SQ, SK, H, HKV, D = 2, 8, 12, 4, 2, 16


def _inputs(**overrides):
    kwargs = {
        "query": torch.randn(B, SQ, H, D, device=DEVICE),
        "key": torch.randn(B, SK, HKV, D, device=DEVICE),
        "value": torch.randn(B, SK, HKV, D, device=DEVICE),
    }
    kwargs.update(overrides)
    return kwargs


def _mask(*shape, dtype=torch.bool):
    return torch.ones(shape, dtype=dtype, device=DEVICE)


FP8 = torch.float8_e4m3fn
_FP8_QKV = dict(query=torch.randn(B, SQ, H, D).to(FP8), key=torch.randn(B, SK, HKV, D).to(FP8), value=torch.randn(B, SK, HKV, D).to(FP8))


BAD_INPUTS = [
    ("query-rank", dict(query=torch.randn(B, SQ, H * D)), ValueError, r"query: expected a 4-D tensor .* got 3-D"),
    ("key-rank", dict(key=torch.randn(B, SK, D)), ValueError, r"key: expected a 4-D tensor"),
    ("query-not-tensor", dict(query=[[1.0]]), TypeError, r"query: expected a torch.Tensor, got list"),
    ("heads-not-multiple", dict(key=torch.randn(B, SK, 3, D), value=torch.randn(B, SK, 3, D)), ValueError,
     r"key: expected a number of heads that divides the 4 heads of query .*, got 3"),
    ("head-dim-too-large", dict(query=torch.randn(B, SQ, H, 257), key=torch.randn(B, SK, HKV, 257),
                                value=torch.randn(B, SK, HKV, 257)), ValueError, r"head dim must be between 1 and 256, got 257"),
    ("head-dim-mismatch", dict(key=torch.randn(B, SK, HKV, 8), value=torch.randn(B, SK, HKV, 8)), ValueError,
     r"key: expected head dim 16 .* got 8"),
    ("batch-mismatch", dict(key=torch.randn(1, SK, HKV, D), value=torch.randn(1, SK, HKV, D)), ValueError,
     r"key: expected batch size 2 .* got 1"),
    # A q/k/v mismatch names the two tensors that disagree and the dimension: key and value against
    # query first (a key of the wrong head dim is blamed, not the value that matches query), then value against key.
    ("key-head-dim", dict(key=torch.randn(B, SK, HKV, 8)), ValueError, r"key: expected head dim 16 \(that of query\), got 8"),
    ("value-head-dim", dict(value=torch.randn(B, SK, HKV, 8)), ValueError,
     r"value: expected head dim 16 \(that of query\), got 8"),
    ("value-batch", dict(value=torch.randn(1, SK, HKV, D)), ValueError, r"value: expected batch size 2 \(that of query\), got 1"),
    ("value-heads-not-multiple", dict(value=torch.randn(B, SK, 3, D)), ValueError,
     r"value: expected a number of heads that divides the 4 heads of query .*, got 3"),
    ("value-key-length", dict(value=torch.randn(B, SK + 1, HKV, D)), ValueError,
     r"value: expected key length 12 \(that of key\), got 13"),
    ("value-heads", dict(value=torch.randn(B, SK, 1, D)), ValueError, r"value: expected number of heads 2 \(that of key\), got 1"),
    ("mixed-dtypes", dict(key=torch.randn(B, SK, HKV, D, dtype=torch.float16)), TypeError,
     r"key: expected dtype torch.float32 \(the dtype of query\), got torch.float16"),
    ("float64", dict(query=torch.randn(B, SQ, H, D, dtype=torch.float64)), TypeError,
     r"query: expected dtype float16, bfloat16, float32 or float8_e4m3fn, got torch.float64"),
    ("mask-rank", dict(attn_mask=_mask(B, SK)), ValueError, r"attn_mask: expected a 4-D tensor .*mask\[:, None, None, :\]"),
    ("mask-batch", dict(attn_mask=_mask(3, 1, 1, SK)), ValueError, r"attn_mask: dimension 0 \(batch\) must be 1 or 2, got 3"),
    ("mask-heads", dict(attn_mask=_mask(B, 3, SQ, SK)), ValueError,
     r"attn_mask: dimension 1 \(heads\) must be 1, 2 or 4, got 3"),
    ("mask-query-len", dict(attn_mask=_mask(B, H, SQ + 1, SK)), ValueError,
     r"attn_mask: dimension 2 \(query length\) must be 1 or 8, got 9"),
    ("mask-key-len", dict(attn_mask=_mask(B, H, SQ, 5)), ValueError,
     r"attn_mask: dimension 3 \(key length\) must be 1 or 12, got 5"),
    ("mask-float", dict(attn_mask=_mask(B, H, SQ, SK, dtype=torch.float32)), TypeError,
     r"attn_mask: expected a bool .* got torch.float32; pass additive float masks as attn_bias"),
    ("mask-int-values", dict(attn_mask=2 * _mask(B, H, SQ, SK, dtype=torch.int32)), ValueError,
     r"attn_mask: an integer mask must hold only 0 and 1"),
    ("bias-dtype", dict(attn_bias=torch.zeros(B, H, SQ, SK, dtype=torch.float16)), TypeError,
     r"attn_bias: expected dtype torch.float32, got torch.float16"),  # query is float32: one choice
    ("bias-int", dict(attn_bias=torch.zeros(B, H, SQ, SK, dtype=torch.int64)), TypeError, r"attn_bias: expected dtype"),
    ("bias-heads", dict(attn_bias=torch.zeros(B, 8, SQ, SK)), ValueError,
     r"attn_bias: dimension 1 \(heads\) must be 1, 2 or 4, got 8"),
    ("bias-not-broadcastable", dict(attn_bias=torch.zeros(B, H, 2, SK)), ValueError,
     r"attn_bias: dimension 2 \(query length\) must be 1 or 8, got 2"),
    ("window-negative", dict(window_size=(-2, 0)), ValueError, r"window_size: left size must be -1 \(unbounded\) or >= 0, got -2"),
    ("window-float", dict(window_size=(4.0, 0)), TypeError, r"window_size: expected int left size, got float"),
    ("window-not-pair", dict(window_size=3), TypeError, r"window_size: expected a pair \(left, right\) of ints, got 3"),
    ("softcap-negative", dict(softcap=-1.0), ValueError, r"softcap: expected a finite float >= 0 .* got -1.0"),
    ("softcap-nan", dict(softcap=float("nan")), ValueError, r"softcap: expected a finite float >= 0"),
    ("scale-inf", dict(softmax_scale=float("inf")), ValueError, r"softmax_scale: expected a finite float or None, got inf"),
    ("causal-not-bool", dict(is_causal=1), TypeError, r"is_causal: expected a bool, got int 1"),
    ("backend-unknown", dict(backend="cuda"), ValueError, r"backend: expected one of 'triton', 'flex', 'reference' or None, got 'cuda'"),
    ("block-mask-type", dict(block_mask=_mask(B, H, SQ, SK)), TypeError, r"block_mask: expected a flash_dma.BlockMask"),
    ("block-mask-shape", dict(block_mask=build_block_mask(_mask(B, H, SQ, 20))), ValueError,
     r"block_mask: it was built for a mask of shape \(2, 4, 8, 20\), whose key length must be 1 or 12 for this call, got 20"),
    ("block-mask-without-mask", dict(block_mask=build_block_mask(_mask(B, H, SQ, SK))), ValueError,
     r"block_mask: it was built from an element-wise mask .* pass that mask as attn_mask too"),
    # FP8 inputs: descales [B, Hkv] float32, for FP8 only; a forward only; a bias of the output's dtype.
    ("fp8-mixed", dict(_FP8_QKV, value=torch.randn(B, SK, HKV, D, dtype=torch.bfloat16)), TypeError,
     r"value: expected dtype torch.float8_e4m3fn \(the dtype of query\), got torch.bfloat16"),
    ("descale-without-fp8", dict(k_descale=torch.ones(B, HKV)), ValueError,
     r"k_descale: expected None for torch.float32 inputs \(only float8_e4m3fn inputs take one\)"),
    ("descale-shape", dict(_FP8_QKV, q_descale=torch.ones(B, H)), ValueError, r"q_descale: expected shape \[B, Hkv\] = \[2, 2\], got \(2, 4\)"),
    ("descale-dtype", dict(_FP8_QKV, v_descale=torch.ones(B, HKV, dtype=torch.float16)), TypeError,
     r"v_descale: expected dtype torch.float32, got torch.float16"),
    ("descale-type", dict(_FP8_QKV, q_descale=1.0), TypeError, r"q_descale: expected a torch.Tensor or None, got float"),
    ("fp8-bias-dtype", dict(_FP8_QKV, attn_bias=torch.zeros(B, H, SQ, SK, dtype=torch.float16)), TypeError,
     r"attn_bias: expected dtype torch.float32 or torch.bfloat16 \(the dtype of the output of FP8 inputs\), got torch.float16"),
    ("fp8-bias-grad", dict(_FP8_QKV, attn_bias=torch.zeros(B, H, SQ, SK, requires_grad=True)), ValueError,
     r"attn_bias: FP8 attention has a forward only; expected a tensor that does not require grad"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), [p[1:] for p in BAD_INPUTS], ids=[p[0] for p in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(overrides, error, message):
    overrides = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in overrides.items()}
    with pytest.raises(error, match=message):
        flash_dma_func(**_inputs(**overrides))


def _kvcache_inputs(**overrides):
    """``flash_dma_with_kvcache``'s arguments: 2 new tokens appended to caches of 16 slots."""
    kwargs = dict(q=torch.randn(B, 2, H, D, device=DEVICE), k_cache=torch.randn(B, 16, HKV, D, device=DEVICE),
                  v_cache=torch.randn(B, 16, HKV, D, device=DEVICE), k=torch.randn(B, 2, HKV, D, device=DEVICE),
                  v=torch.randn(B, 2, HKV, D, device=DEVICE), cache_seqlens=4)
    return {**kwargs, **{k: v.to(DEVICE) for k, v in overrides.items()}}


def _varlen_inputs(**overrides):
    """``flash_dma_varlen_func``'s arguments: sequences of 3 and 5 queries over 4 and 8 keys."""
    kwargs = dict(q=torch.randn(8, H, D, device=DEVICE), k=torch.randn(12, HKV, D, device=DEVICE),
                  v=torch.randn(12, HKV, D, device=DEVICE), max_seqlen_q=5, max_seqlen_k=8,
                  cu_seqlens_q=torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE),
                  cu_seqlens_k=torch.tensor([0, 4, 12], dtype=torch.int32, device=DEVICE))
    return {**kwargs, **{k: v.to(DEVICE) for k, v in overrides.items()}}


@pytest.mark.parametrize(
    "call, overrides, message",
    [
        (flash_dma_with_kvcache, dict(k_cache=torch.randn(B, 16, HKV, 8)), r"k_cache: expected head dim 16 \(that of q\), got 8"),
        (flash_dma_with_kvcache, dict(v_cache=torch.randn(B, 15, HKV, D)),
         r"v_cache: expected key length 16 \(that of k_cache\), got 15"),
        (flash_dma_with_kvcache, dict(v=torch.randn(B, 3, HKV, D)), r"v: expected number of new keys 2 \(that of k\), got 3"),
        (flash_dma_with_kvcache, dict(k=torch.randn(B, 2, HKV, 8)), r"k: expected head dim 16 \(that of k_cache\), got 8"),
        (flash_dma_varlen_func, dict(k=torch.randn(12, HKV, 8)), r"k: expected head dim 16 \(that of q\), got 8"),
        (flash_dma_varlen_func, dict(v=torch.randn(12, 1, D)), r"v: expected number of heads 2 \(that of k\), got 1"),
    ],
    ids=["kvcache-k_cache-head-dim", "kvcache-v_cache-length", "kvcache-new-v-length", "kvcache-new-k-head-dim",
         "varlen-k-head-dim", "varlen-v-heads"],
)
def test_a_qkv_mismatch_names_the_entry_points_own_arguments(call, overrides, message):
    arguments = (_kvcache_inputs if call is flash_dma_with_kvcache else _varlen_inputs)(**overrides)
    with pytest.raises(ValueError, match=message):
        call(**arguments)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_tensors_on_different_devices_are_rejected():
    with pytest.raises(ValueError, match=r"key: expected device cuda:0 \(the device of query\), got cpu"):
        flash_dma_func(**_inputs(key=torch.randn(B, SK, HKV, D)))
    with pytest.raises(ValueError, match=r"attn_bias: expected device cuda:0 .* got cpu"):
        flash_dma_func(**_inputs(attn_bias=torch.zeros(B, H, SQ, SK)))


def test_tensors_on_different_devices_are_rejected_on_meta():
    # The same check, exercised on every machine: meta tensors never run.
    with pytest.raises(ValueError, match=r"value: expected device cpu \(the device of query\), got meta"):
        inputs = _inputs()
        flash_dma_func(
            inputs["query"].cpu(), inputs["key"].cpu(), torch.empty(B, SK, HKV, D, device="meta")
        )
    with pytest.raises(ValueError, match=r"attn_mask: expected device cpu .* got meta"):
        flash_dma_func(**{k: v.cpu() for k, v in _inputs().items()}, attn_mask=torch.ones(1, 1, 1, SK, dtype=torch.bool, device="meta"))


def test_unavailable_backend_is_explained(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend: 'triton' is unavailable for tensors on cpu: it needs a CUDA device"):
        flash_dma_func(**{k: v.cpu() for k, v in _inputs().items()}, backend="triton")


def test_a_bias_may_be_float32_or_the_dtype_of_query():
    inputs = {name: t.half() for name, t in _inputs().items()}
    bias = torch.zeros(B, H, SQ, SK, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match=r"^attn_bias: expected dtype torch.float32 or torch.float16 \(the dtype of query\), got torch.float64$"):
        flash_dma_func(**inputs, attn_bias=bias)


def test_integer_masks_of_zeros_and_ones_are_accepted():
    mask = (torch.rand(B, 1, SQ, SK, device=DEVICE) < 0.5).to(torch.uint8)
    inputs = _inputs()
    expected = flash_dma_func(**inputs, attn_mask=mask.bool())
    actual = flash_dma_func(**inputs, attn_mask=mask)
    assert torch.equal(actual, expected)


def test_a_remembered_validation_still_rejects_a_call_that_differs_in_one_dtype_shape_or_device():
    """Checks are run once per signature of the tensors (types, shapes, dtypes, devices); a call
    that differs from a remembered one in any of these is checked afresh, and the values of an
    integer mask are read once per tensor and version."""
    inputs = _inputs()
    mask = _mask(B, 1, SQ, SK, dtype=torch.int32)
    expected = flash_dma_func(**inputs, attn_mask=mask)
    assert torch.equal(flash_dma_func(**inputs, attn_mask=mask), expected)  # the remembered signature
    with pytest.raises(ValueError, match=r"attn_mask: an integer mask must hold only 0 and 1"):
        flash_dma_func(**inputs, attn_mask=2 * mask)
    changed = mask.clone()
    assert torch.equal(flash_dma_func(**inputs, attn_mask=changed), expected)
    changed[0, 0, 0, 0] = 2  # changed in place after it passed: read again
    with pytest.raises(ValueError, match=r"attn_mask: an integer mask must hold only 0 and 1"):
        flash_dma_func(**inputs, attn_mask=changed)
    with pytest.raises(TypeError, match=r"key: expected dtype torch.float32 \(the dtype of query\), got torch.float16"):
        flash_dma_func(**{**inputs, "key": inputs["key"].half()}, attn_mask=mask)
    with pytest.raises(TypeError, match=r"attn_mask: expected a bool .* got torch.float32"):
        flash_dma_func(**inputs, attn_mask=mask.float())
    with pytest.raises(ValueError, match=r"attn_mask: dimension 1 \(heads\) must be 1, 2 or 4, got 3"):
        flash_dma_func(**inputs, attn_mask=_mask(B, 3, SQ, SK, dtype=torch.int32))
    cpu = {name: t.cpu() for name, t in inputs.items()}
    flash_dma_func(**cpu, attn_mask=mask.cpu())
    with pytest.raises(ValueError, match=r"attn_mask: expected device cpu .* got meta"):
        flash_dma_func(**cpu, attn_mask=torch.ones(B, 1, SQ, SK, dtype=torch.int32, device="meta"))


def test_the_validation_memo_is_bounded_and_keeps_no_tensor(monkeypatch):
    monkeypatch.setattr(memo, "MAX_ENTRIES", 3)
    for seqlen_q in range(1, 9):
        flash_dma_func(**_inputs(query=torch.randn(B, seqlen_q, H, D, device=DEVICE)))
    assert 0 < len(inputs_module._VALIDATED) <= 3
    inputs = _inputs()
    alive = [weakref.ref(t) for t in inputs.values()]
    flash_dma_func(**inputs)
    del inputs
    gc.collect()
    assert all(ref() is None for ref in alive)
