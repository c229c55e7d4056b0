"""The key-interval kernels (``backends/triton/key_intervals.py``) against plain torch and brute force,
and attention over ``KeyIntervals`` on the Triton backend against the float64 reference.

The kernels' outputs start poisoned (``poison_outputs``), so an element they fail to write shows up.
"""

import pytest
import torch

from flash_dma import flash_dma_func, interval_mask
from flash_dma.backends.reference import visible_positions
from flash_dma.backends.triton.key_intervals import build_causal_topk_ends, build_interval_state
from flash_dma.block_mask import summarize_mask
from flash_dma.key_intervals import causal_topk_ends, interval_rows, interval_states
from flash_dma.masks import _keep_largest, causal_topk_intervals
from tests.helpers import (
    DEVICE,
    DTYPE_IDS,
    KERNEL_DTYPES,
    ON_GPU,
    SUMMARY_BLOCK_SIZES,
    Case,
    assert_close,
    assert_gradients_close,
    case_dtypes,
    make_inputs,
    reference_outputs,
    seeded_generator,
)

LENGTHS = [(1, 17), (17, 1), (17, 17), (63, 113), (130, 63), (113, 239), (239, 130)]


def random_intervals(batch: int, heads: int, query_len: int, key_len: int, label: str):
    """``(start, end)`` int32 ``[batch, heads, Sk]`` on ``DEVICE``: runs of every kind, empty ones and
    ones reaching past the rows included."""
    gen = seeded_generator(label)
    start = torch.randint(-3, query_len + 3, (batch, heads, key_len), generator=gen)
    end = start + torch.randint(-2, query_len + 2, (batch, heads, key_len), generator=gen)
    whole = torch.rand(batch, heads, key_len, generator=gen) < 0.3  # every row: FULL blocks occur
    start, end = torch.where(whole, 0, start), torch.where(whole, query_len, end)
    return start.to(DEVICE, torch.int32), end.to(DEVICE, torch.int32)


def aligned_intervals(batch: int, heads: int, query_len: int, key_len: int, label: str):
    """``(start, end)`` as ``random_intervals``, with runs that start and end on multiples of 128 rows
    (some off them, some over every row): on the Hopper kernels many PARTIAL tiles are then per
    key, each key keeping all of a tile's rows or none (``hopper/common.rows_kept_whole``)."""
    gen = seeded_generator(label)
    shape = (batch, heads, key_len)
    start = 128 * torch.randint(-1, query_len // 128 + 2, shape, generator=gen)
    end = start + 128 * torch.randint(0, query_len // 128 + 2, shape, generator=gen)
    start = torch.where(torch.rand(shape, generator=gen) < 0.01, start + torch.randint(1, 128, shape, generator=gen), start)
    whole = torch.rand(shape, generator=gen) < 0.3
    start, end = torch.where(whole, 0, start), torch.where(whole, query_len, end)
    return start.to(DEVICE, torch.int32), end.to(DEVICE, torch.int32)


@pytest.mark.parametrize("block_size", SUMMARY_BLOCK_SIZES, ids=lambda b: f"block{b[0]}x{b[1]}")
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_block_states_are_those_of_the_dense_mask(lengths, block_size, poison_outputs):
    query_len, key_len = lengths
    start, end = random_intervals(2, 1, query_len, key_len, f"state{lengths}")
    for begin in (start, None):
        dense = interval_rows(begin, end, 0, query_len)
        expected = summarize_mask(dense, *block_size)
        assert torch.equal(build_interval_state(begin, end, query_len, *block_size), expected)
        assert torch.equal(interval_states(begin, end, query_len, block_size), expected)


def test_broadcast_strides(poison_outputs):
    """Intervals shared by the batch (stride 0)."""
    start, end = random_intervals(1, 1, 300, 70, "broadcast")
    start, end = start.expand(2, 1, 70), end.expand(2, 1, 70)
    dense = interval_rows(start, end, 0, 300)
    assert torch.equal(build_interval_state(start, end, 300, 64, 32), summarize_mask(dense, 64, 32))


def causal_topk_brute_force(scores, allowed, keep: int, query_len: int) -> torch.Tensor:
    """bool ``[Bm, Hm, Sq, Sk]``: each query row's ``keep`` best visible keys, as ``create_mask``
    selects them over a per-pair bias (ties to the lower key, NaN never)."""
    batch, heads, key_len = scores.shape
    visible = visible_positions(torch.arange(query_len, device=scores.device), query_len, key_len, (-1, 0))
    if allowed is not None:
        visible = visible & allowed[:, :, None, :]
    return _keep_largest(scores[:, :, None, :].expand(batch, heads, query_len, key_len), visible, keep)


def _scores(shape, label: str, dtype=torch.float32, ties: bool = False):
    gen = seeded_generator(label)
    scores = torch.randint(0, 4, shape, generator=gen).float() if ties else torch.randn(shape, generator=gen)
    return scores.to(DEVICE, dtype)


def _check_causal_topk(scores, keep: int, query_len: int) -> None:
    ends = build_causal_topk_ends(scores, None, keep, query_len)
    assert torch.equal(ends, causal_topk_ends(scores, None, keep, query_len))
    intervals = causal_topk_intervals(scores, keep, query_len=query_len)
    assert torch.equal(intervals.dense(), causal_topk_brute_force(scores, None, keep, query_len))


@pytest.mark.parametrize("keep", [1, 8, 300], ids=lambda k: f"keep{k}")
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_causal_topk_ends_are_the_prefix_top_k(lengths, keep, poison_outputs):
    """Distinct scores, and few distinct values (ties everywhere) with keep = 8."""
    query_len, key_len = lengths
    _check_causal_topk(_scores((1, 2, key_len), f"topk{lengths}{keep}", ties=keep == 8), keep, query_len)


@pytest.mark.parametrize("lengths", [(63, 113), (239, 130)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_half_precision_scores_are_compared_as_they_are(lengths, poison_outputs):
    """fp16 scores (Doge's dt in a half-precision model): ties where they round together."""
    query_len, key_len = lengths
    _check_causal_topk(_scores((2, 1, key_len), f"half{lengths}", torch.float16), 5, query_len)


def test_ties_nan_infinities_and_padding(poison_outputs):
    scores = _scores((2, 1, 239), "special", ties=True)
    scores[0, 0, 7] = float("nan")  # never kept, never outranks
    scores[0, 0, 100:140] = float("-inf")  # kept only by queries seeing fewer than keep others
    scores[1, 0, 3] = float("inf")
    padding = torch.rand(2, 239, generator=seeded_generator("padding")).to(DEVICE) < 0.7
    padding[1, :60] = False  # left padding
    allowed = padding[:, None, :]
    for query_len, keep in ((239, 16), (130, 5), (239, 0)):
        ends = build_causal_topk_ends(scores, allowed, keep, query_len)
        assert torch.equal(ends, causal_topk_ends(scores, allowed, keep, query_len))
        intervals = causal_topk_intervals(scores, keep, padding, query_len=query_len)
        assert torch.equal(intervals.dense(), causal_topk_brute_force(scores, allowed, keep, query_len))


def test_heads_broadcast_through_the_key_mask(poison_outputs):
    """A per-head key mask and scores shared by the batch: both broadcast to [B, H, Sk] by strides."""
    scores = _scores((1, 2, 130), "gqa")
    key_mask = (torch.rand(2, 2, 130, generator=seeded_generator("gqa-mask")) < 0.8).to(DEVICE, torch.int32)
    intervals = causal_topk_intervals(scores, 9, key_mask, query_len=63)
    assert intervals.shape == (2, 2, 63, 130)
    expected = causal_topk_brute_force(scores.expand(2, 2, 130), key_mask != 0, 9, 63)
    assert torch.equal(intervals.dense(), expected)


ATTENTION_CASES = [
    Case(seqlen_q=17, seqlen_k=17, heads=2, kv_heads=2, bias="B,H,1,Sk", causal=True),
    Case(batch=1, seqlen_q=63, seqlen_k=113, heads=4, kv_heads=2, bias="B,Hkv,1,Sk", causal=True),
    Case(batch=1, seqlen_q=130, seqlen_k=63, heads=4, kv_heads=2, bias="1,H,Sq,Sk"),
    Case(seqlen_q=1, seqlen_k=239, heads=4, kv_heads=1, bias="B,Hkv,1,Sk", causal=True),
]


@pytest.mark.parametrize("case, dtype", case_dtypes(ATTENTION_CASES))
def test_attention_over_intervals_matches_the_reference(case, dtype, poison_outputs):
    """Forward and backward on the Triton backend, intervals of a causal top-k per key/value head
    (case.causal) or of runs of any kind per query head, against the float64 reference over the
    same mask as bool."""
    _check_attention(case, dtype, keep=11, block_size=(16, 16))


# Long enough for several tiles of every kind, at the head dims the Hopper kernels take.
GPU_CASES = [
    Case(seqlen_q=1000, seqlen_k=1000, heads=8, kv_heads=2, head_dim=128, bias="B,Hkv,1,Sk", causal=True),
    Case(batch=1, seqlen_q=700, seqlen_k=2048, heads=4, kv_heads=2, head_dim=64, bias="B,H,1,Sk", causal=True),
    Case(batch=1, seqlen_q=1023, seqlen_k=1000, heads=4, kv_heads=1, head_dim=64, bias="1,H,Sq,Sk"),
    Case(batch=1, seqlen_q=1000, seqlen_k=1000, heads=2, kv_heads=1, head_dim=256, bias="B,Hkv,1,Sk", causal=True),
]


@pytest.mark.gpu_only
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_long_intervals_on_the_gpu(case, dtype, poison_outputs):
    """bf16 and fp16 on the GPU (on sm90 the Hopper kernels' own test of the intervals), a Doge-like keep of 128."""
    _check_attention(case, dtype, keep=128, block_size=(128, 128))


@pytest.mark.gpu_only
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("key_len", [1000, 4099], ids=lambda n: f"Sk{n}")
def test_bf16_scores_on_the_gpu(key_len, poison_outputs):
    """bf16 scores (the interpreter has no bf16), where rounding makes ties common, over many tiles
    of keys: the kernel's ends are plain torch's, padding included."""
    scores = _scores((2, 2, key_len), f"bf16{key_len}", torch.bfloat16)
    allowed = (torch.rand(2, 1, key_len, generator=seeded_generator("bf16-padding")) < 0.9).to(DEVICE).expand(2, 2, key_len)
    for query_len, keep in ((key_len, 128), (key_len // 3, 1024)):
        assert torch.equal(build_causal_topk_ends(scores, allowed, keep, query_len), causal_topk_ends(scores, allowed, keep, query_len))


# Runs on 128-row boundaries: many tiles per key on the Hopper kernels, with and without a bias to
# carry the dropped keys' -inf, and rows that end past the last full tile.
ALIGNED_CASES = [
    Case(seqlen_q=1000, seqlen_k=777, heads=4, kv_heads=2, head_dim=128, bias="B,Hkv,1,Sk"),
    Case(batch=1, seqlen_q=1000, seqlen_k=1000, heads=4, kv_heads=2, head_dim=64, causal=True),
    Case(batch=1, seqlen_q=700, seqlen_k=900, heads=2, kv_heads=1, head_dim=256, bias="B,H,1,Sk"),
]


@pytest.mark.gpu_only
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ALIGNED_CASES, ids=str)
def test_runs_on_tile_boundaries_on_the_gpu(case, dtype, poison_outputs):
    _check_attention(case, dtype, keep=0, block_size=(128, 128), runs=aligned_intervals)


def _check_attention(case: Case, dtype, keep: int, block_size, runs=None) -> None:
    """``runs``: how to draw runs of rows per query head; None takes a causal top-k per key/value
    head where ``case.causal``, else ``random_intervals``."""
    inputs = make_inputs(case, dtype, requires_grad=True)
    topk = case.causal and runs is None
    shape = (case.batch, case.kv_heads if topk else case.heads, case.seqlen_k)
    if topk:
        intervals = causal_topk_intervals(_scores(shape, str(case)), keep, query_len=case.seqlen_q, block_size=block_size)
    else:
        start, end = (runs or random_intervals)(*shape[:2], case.seqlen_q, case.seqlen_k, str(case))
        intervals = interval_mask(end, start, query_len=case.seqlen_q, block_size=block_size)
    dout = torch.randn(inputs["query"].shape, generator=case.generator("dout")).to(DEVICE, dtype)
    out, lse = flash_dma_func(**{**inputs, "attn_mask": intervals}, is_causal=case.causal, return_lse=True, backend="triton")
    out.backward(dout)
    dense = {**inputs, "attn_mask": intervals.dense()}
    oracle_out, oracle_lse, oracle_grads = reference_outputs(case, dense, dout, torch.float64)
    baseline_out, baseline_lse, baseline_grads = reference_outputs(case, dense, dout, dtype)
    assert_close("out", out, oracle_out, baseline_out)
    assert_close("lse", lse, oracle_lse, baseline_lse)
    assert_gradients_close(inputs, oracle_grads, baseline_grads)
