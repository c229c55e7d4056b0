"""KeyIntervals: its builders, its summary, the plain-torch versions of its kernels, and its use
wherever a mask is taken (the reference and Flex backends, a KV cache), with the errors it raises."""

import pytest
import torch

from flash_dma import (
    KeyIntervals,
    causal_topk_intervals,
    create_mask,
    flash_dma_func,
    flash_dma_with_kvcache,
    interval_mask,
    pack_mask,
)
from flash_dma.backends import flex
from flash_dma.block_mask import summarize_mask
from flash_dma.inputs import normalize_inputs
from tests.backends.triton.test_key_intervals import causal_topk_brute_force, random_intervals
from tests.helpers import DEVICE, Case, make_inputs, seeded_generator


def _cpu(t):
    return None if t is None else t.cpu()


@pytest.mark.parametrize("block_size", [(16, 32), (64, 128), (128, 256)], ids=str)
@pytest.mark.parametrize("lengths", [(1, 1), (17, 63), (130, 17), (239, 113)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_a_mask_of_runs_of_query_rows_and_its_exact_summary(monkeypatch, lengths, block_size):
    query_len, key_len = lengths
    start, end = random_intervals(2, 3, query_len, key_len, f"mask{lengths}")
    rows = torch.arange(query_len, device=DEVICE)[:, None]
    for begin in (start, None):
        intervals = interval_mask(end, begin, query_len=query_len, block_size=block_size)
        expected = (rows < end[:, :, None, :]) & (True if begin is None else begin[:, :, None, :] <= rows)
        assert intervals.shape == (2, 3, query_len, key_len) and intervals.device == end.device
        assert torch.equal(intervals.dense(), expected)
        assert torch.equal(intervals.rows(query_len // 2, query_len), expected[:, :, query_len // 2 :])
        assert torch.equal(intervals.summary.state, summarize_mask(expected, *block_size))
        assert intervals.summary.needs_mask and intervals.summary.block_size == block_size
        with monkeypatch.context() as plain:  # the plain-torch summary: CPU tensors, the interpreter off
            plain.setenv("TRITON_INTERPRET", "0")
            on_cpu = interval_mask(end.cpu(), _cpu(begin), query_len=query_len, block_size=block_size)
        assert torch.equal(on_cpu.summary.state, intervals.summary.state.cpu())
        assert torch.equal(on_cpu.summary.kv_lists, intervals.summary.kv_lists.cpu())


@pytest.mark.parametrize("lengths", [(17, 17), (63, 113), (130, 63), (1, 130)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_the_torch_causal_top_k_is_the_kernels(monkeypatch, lengths):
    """Without the interpreter, on the CPU, the same intervals come from plain torch: ties,
    a NaN and padding included."""
    query_len, key_len = lengths
    gen = seeded_generator(f"torch{lengths}")
    scores = torch.randint(0, 5, (2, 2, key_len), generator=gen).float()
    scores[0, 1, key_len // 2] = float("nan")
    padding = torch.rand(2, key_len, generator=gen) < 0.8
    kernels = causal_topk_intervals(scores.to(DEVICE), 6, padding.to(DEVICE), query_len=query_len)
    with monkeypatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        plain = causal_topk_intervals(scores, 6, padding, query_len=query_len)
    assert torch.equal(plain.end, kernels.end.cpu()) and torch.equal(plain.start, kernels.start.cpu())
    assert torch.equal(plain.summary.state, kernels.summary.state.cpu())
    assert torch.equal(plain.dense(), causal_topk_brute_force(scores, padding[:, None, :], 6, query_len))


def _causal_top_k_case(case: Case, keep: int = 7) -> tuple[dict, KeyIntervals]:
    inputs = make_inputs(case, torch.float32)
    scores = torch.randn(case.batch, case.kv_heads, case.seqlen_k, generator=case.generator("scores")).to(DEVICE)
    return inputs, causal_topk_intervals(scores, keep, query_len=case.seqlen_q)


@pytest.mark.parametrize(
    "case",
    [
        Case(seqlen_q=63, seqlen_k=113, heads=4, kv_heads=2, bias="B,Hkv,1,Sk"),
        Case(seqlen_q=130, seqlen_k=17, heads=3, kv_heads=1, bias="1,H,Sq,Sk"),
    ],
    ids=str,
)
def test_the_reference_and_flex_attend_what_the_bool_mask_attends(case):
    inputs, intervals = _causal_top_k_case(case)
    dense = {**inputs, "attn_mask": intervals.dense()}
    for causal in (True, False):  # the intervals hold the causal rule: the same either way
        expected = flash_dma_func(**dense, is_causal=True, backend="reference")
        assert torch.equal(flash_dma_func(**inputs | {"attn_mask": intervals}, is_causal=causal, backend="reference"), expected)
        out, _ = flex.attention(normalize_inputs(**inputs | {"attn_mask": intervals}, is_causal=causal))
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_a_kv_cache_takes_it_as_its_rows():
    gen = seeded_generator("cache")
    q = torch.randn(2, 3, 4, 16, generator=gen).to(DEVICE)
    k_cache, v_cache = (torch.randn(2, 40, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    lengths = torch.tensor([40, 40], dtype=torch.int32, device=DEVICE)
    intervals = causal_topk_intervals(torch.randn(2, 2, 40, generator=gen).to(DEVICE), 9, query_len=3)
    out = flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, attn_mask=intervals, is_causal=True)
    expected = flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, attn_mask=intervals.dense(), is_causal=True)
    assert torch.equal(out, expected)


def test_bad_intervals_are_refused():
    end = torch.full((1, 2, 40), 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="end: expected dtype torch.int32"):
        interval_mask(end.long(), query_len=8)
    with pytest.raises(ValueError, match="end: expected a 3-D tensor"):
        interval_mask(end[0], query_len=8)
    with pytest.raises(ValueError, match="start: expected the shape of end"):
        interval_mask(end, end[:, :1], query_len=8)
    with pytest.raises(ValueError, match="query_len"):
        interval_mask(end, query_len=0)
    with pytest.raises(ValueError, match="block_size"):
        interval_mask(end, query_len=8, block_size=(16, 24))
    scores = torch.randn(1, 2, 40, device=DEVICE)
    with pytest.raises(TypeError, match="scores: expected a floating-point tensor"):
        causal_topk_intervals(end, 4, query_len=8)
    with pytest.raises(ValueError, match="keep"):
        causal_topk_intervals(scores, -1, query_len=8)
    with pytest.raises(ValueError, match="key_mask: expected a padding mask"):
        causal_topk_intervals(scores, 4, torch.ones(1, 39, dtype=torch.bool, device=DEVICE), query_len=8)
    with pytest.raises(TypeError, match="key_mask"):
        causal_topk_intervals(scores, 4, torch.ones(1, 40, device=DEVICE), query_len=8)


def test_attention_refuses_intervals_of_another_problem():
    case = Case(batch=1, seqlen_q=8, seqlen_k=40, heads=2, kv_heads=2)
    inputs, intervals = _causal_top_k_case(case)
    one_row = causal_topk_intervals(torch.randn(1, 2, 40, device=DEVICE), 4, query_len=1)  # rows do not broadcast
    with pytest.raises(ValueError, match=r"must span the call's \[Sq, Sk\] = \[8, 40\]"):
        flash_dma_func(**inputs | {"attn_mask": one_row})
    with pytest.raises(ValueError, match="dimension 1"):
        flash_dma_func(**inputs | {"attn_mask": causal_topk_intervals(torch.randn(1, 3, 40, device=DEVICE), 4, query_len=8)})
    with pytest.raises(ValueError, match="block_mask: attn_mask is a KeyIntervals"):
        flash_dma_func(**inputs | {"attn_mask": intervals}, block_mask=pack_mask(intervals.dense()).summary)
    wrong = KeyIntervals(intervals.start, intervals.end.long(), intervals.shape, intervals.summary)
    with pytest.raises(ValueError, match="KeyIntervals.end must be int32"):
        flash_dma_func(**inputs | {"attn_mask": wrong})


def _today(bias, padding, query_len: int, key_len: int, **kwargs) -> torch.Tensor:
    """create_mask's bool mask for the same selection without is_causal: the per-key bias made per
    pair, the causal rule and the padding as one 4-D mask."""
    rows = torch.arange(query_len, device=bias.device)[:, None]
    causal = torch.arange(key_len, device=bias.device) <= rows + key_len - query_len
    mask = causal[None, None] & (True if padding is None else padding[:, None, None, :])
    return create_mask(bias.expand(*bias.shape[:2], query_len, key_len), mask, bias.shape[0], **kwargs)


@pytest.mark.parametrize("lengths", [(40, 40), (17, 63), (63, 17)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_create_mask_of_a_per_key_bias_under_the_causal_rule_is_key_intervals(lengths):
    query_len, key_len = lengths
    gen = seeded_generator(f"create{lengths}")
    bias = torch.randint(0, 6, (2, 3, 1, key_len), generator=gen).float().to(DEVICE)  # ties
    bias[1, 2, 0, 5] = -1e30  # at min_dtype: masked
    padding = (torch.rand(2, key_len, generator=gen) < 0.8).to(DEVICE)
    for mask, window in ((None, 3), (padding, 7), (padding, 1000)):
        intervals = create_mask(bias, mask, window_size=window, query_len=query_len, min_dtype=-1e30, is_causal=True)
        expected = _today(bias, mask, query_len, key_len, window_size=window, min_dtype=-1e30)
        assert isinstance(intervals, KeyIntervals) and torch.equal(intervals.dense(), expected)
        packed = create_mask(bias, mask, window_size=window, query_len=query_len, min_dtype=-1e30, is_causal=True, packed=True)
        assert isinstance(packed, KeyIntervals) and torch.equal(packed.end, intervals.end)


def test_create_mask_padding_of_the_newest_keys_under_the_causal_rule():
    """A [B, Sq] padding mask covers the queries' own keys, the earlier ones a cache of real tokens."""
    gen = seeded_generator("newest")
    bias = torch.randn(2, 2, 1, 50, generator=gen).to(DEVICE)
    padding = torch.ones(2, 10, dtype=torch.int64, device=DEVICE)
    padding[1, 4] = 0
    intervals = create_mask(bias, padding, query_len=10, window_size=6, is_causal=True)
    keys = torch.cat([torch.ones(2, 40, dtype=torch.bool, device=DEVICE), padding.bool()], dim=1)
    assert torch.equal(intervals.dense(), _today(bias, keys, 10, 50, window_size=6))


def test_create_mask_other_inputs_under_the_causal_rule_stay_bool():
    """Block smoothing, kind="relu" and a per-pair bias select per query: a bool mask (or its
    BitMask) holding the causal rule, as today's mask with the rule in a 4-D mask."""
    gen = seeded_generator("other")
    bias = torch.randn(1, 2, 1, 70, generator=gen).to(DEVICE)
    for kwargs in (dict(window_size=20, block_size=16), dict(kind="relu")):
        mask = create_mask(bias, query_len=30, is_causal=True, **kwargs)
        assert mask.dtype == torch.bool and torch.equal(mask, _today(bias, None, 30, 70, **kwargs))
    pairs = torch.randn(1, 2, 30, 70, generator=gen).to(DEVICE)
    packed = create_mask(pairs, window_size=9, is_causal=True, packed=True)
    assert torch.equal(packed.dense(), _today(pairs, None, 30, 70, window_size=9))
    with pytest.raises(TypeError, match="is_causal"):
        create_mask(bias, window_size=4, is_causal=1)
