import pytest
import torch

from flash_dma import topk_block_mask
from flash_dma.benchmark.metrics import (
    active_pairs,
    attention_flops,
    block_active_pairs,
    document_active_pairs,
    fa3_fwdbwd_bytes,
    gbps,
    kv_bytes,
    kvcache_bytes,
    selection_active_pairs,
    tflops,
)
from flash_dma.block_mask import FULL
from flash_dma.masks import causal_topk_intervals


def _brute_force_pairs(seqlen_q, seqlen_k, batch, num_heads, mask):
    """Count over the dense [B, H, Sq, Sk] visibility: bottom-right causal and the per-key mask."""
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    visible = (i >= j + seqlen_q - seqlen_k).expand(batch, num_heads, seqlen_q, seqlen_k)
    if mask is not None:
        heads = mask.shape[1]
        per_head = mask[:, torch.arange(num_heads) // (num_heads // heads)]  # query head h reads mask head h // G
        visible = visible & per_head.expand(batch, num_heads, 1, seqlen_k)
    return int(visible.sum())


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 40), (5, 40), (17, 17), (40, 17), (63, 130)])
@pytest.mark.parametrize("mask_shape", [None, (1, 2, 1), (2, 2, 1), (1, 1, 1), (1, 4, 1)])
def test_active_pairs_match_brute_force(seqlen_q, seqlen_k, mask_shape):
    batch, num_heads = 2, 4
    mask = None
    if mask_shape is not None:
        gen = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k)
        mask = torch.rand(*mask_shape, seqlen_k, generator=gen) < 0.4
    expected = _brute_force_pairs(seqlen_q, seqlen_k, batch, num_heads, mask)
    assert active_pairs(seqlen_q, seqlen_k, batch, num_heads, mask) == expected


def test_active_pairs_dense_causal_square_is_the_triangle():
    assert active_pairs(1000, 1000, 1, 3) == 3 * 1000 * 1001 // 2


def test_active_pairs_rejects_a_mask_per_query():
    with pytest.raises(ValueError, match="per-key"):
        active_pairs(4, 4, 1, 1, torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_flops_reproduce_the_guides_dense_throughput():
    # GUIDE.md: dense SDPA FLASH at S=16K (H=16, D=128, causal) takes 3.31 ms, about 332 TFLOP/s.
    pairs = active_pairs(16384, 16384, 1, 16)
    assert tflops(attention_flops(pairs, 128, "fwd"), 3.31) == pytest.approx(332, abs=1)
    assert attention_flops(pairs, 128, "fwdbwd") == 3.5 * attention_flops(pairs, 128, "fwd")
    assert attention_flops(10, 64, "fwd") == 4 * 64 * 10
    with pytest.raises(ValueError):
        attention_flops(10, 64, "bwd")


def test_kv_bytes_and_bandwidth():
    # GUIDE.md: decode at Sk=512K, Hkv=1, D=64 in bf16 reads 134 MB of K/V; 0.071 ms is about 1.9 TB/s.
    nbytes = kv_bytes(524288, 1, 1, 64, 2)
    assert nbytes == 524288 * 64 * 2 * 2
    assert gbps(nbytes, 0.071) == pytest.approx(1890, abs=5)

    mask = torch.zeros(1, 2, 1, 1000, dtype=torch.bool)
    mask[0, 0, 0, :100] = True
    mask[0, 1, 0, :300] = True
    # Batch 3 shares the mask; each kept key is read once per batch for K and for V.
    assert kv_bytes(1000, 3, 2, 16, 2, mask) == 3 * 400 * 16 * 2 * 2
    assert kv_bytes(1000, 3, 2, 16, 2) == 3 * 2 * 1000 * 16 * 2 * 2


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(256, 256), (200, 330), (330, 200)])
def test_block_active_pairs_match_brute_force(seqlen_q, seqlen_k):
    batch, num_heads, block = 2, 4, 64
    gen = torch.Generator().manual_seed(seqlen_q + seqlen_k)
    bias = torch.randn(1, 2, 1, seqlen_k, generator=gen)
    bm = topk_block_mask(bias, window_size=block, block_size=(block, block), query_len=seqlen_q, is_causal=True,
                         sink_blocks=1)
    state = bm.state.repeat_interleave(block, 2).repeat_interleave(block, 3)[:, :, :seqlen_q, :seqlen_k]
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    visible = (i >= j + seqlen_q - seqlen_k) & (state == FULL)  # [1, 2, Sq, Sk]: each mask head serves 2 query heads
    expected = int(visible.sum()) * batch * (num_heads // 2)
    assert block_active_pairs(bm, seqlen_q, seqlen_k, batch, num_heads) == expected
    assert expected < active_pairs(seqlen_q, seqlen_k, batch, num_heads)


def test_document_pairs_count_each_document_causally_under_its_mask():
    documents = (5, 130, 3)
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(1, 2, 1, sum(documents), generator=gen) > 0.5
    expected, start = 0, 0
    for n in documents:
        expected += _brute_force_pairs(n, n, 1, 4, mask[..., start:start + n])
        start += n
    assert document_active_pairs(documents, 4, mask) == expected
    assert document_active_pairs(documents, 4) == 4 * sum(n * (n + 1) // 2 for n in documents)
    with pytest.raises(ValueError, match="packed per-key mask"):
        document_active_pairs(documents, 4, mask[..., :-1])


def test_kvcache_bytes_count_kept_kv_every_bias_and_the_mask():
    mask = torch.zeros(2, 2, 1, 1024, dtype=torch.bool)
    mask[..., :128] = True
    kept_kv = 2 * 2 * 128 * 16 * 2 * 2  # entries x heads x kept keys x D x (K and V) x bf16
    bias = 2 * 1024 * 2 * 2  # every key's bias, per head, bf16
    assert kvcache_bytes(mask, 2, 16, 2, 2, 2) == kept_kv + bias + mask.numel()
    # One mask head for a group of K/V heads: each of them reads the kept keys.
    shared = mask[:, :1]
    assert kvcache_bytes(shared, 2, 16, 2, 1, 4) == kept_kv + 2 * 1024 * 4 + shared.numel()
    with pytest.raises(ValueError, match="heads"):
        kvcache_bytes(torch.ones(1, 3, 1, 8, dtype=torch.bool), 2, 16, 2, 1, 2)


def test_fa3_bytes_count_its_outputs_and_rounded_fp32_scratch():
    """B=1, S=100, H=2, D=72 (FlashAttention-3's kernel for D=96; rows rounded to 128 by its 64-row
    tiles, keys by its 128-key tiles): out and the gradients 2 x 72 x (2 x 100 x 2 + 2 x 100 x Hkv)
    bytes, the LSE 800, the scratch 4 x 2 x 128 x (2 + 96); GQA adds dK and dV accumulators."""
    assert fa3_fwdbwd_bytes(1, 100, 100, 2, 2, 72) == 115200 + 800 + 100352
    assert fa3_fwdbwd_bytes(1, 100, 100, 2, 1, 72) == 86400 + 800 + 100352 + 2 * 4 * 128 * 96


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 17), (40, 63)])
def test_selection_pairs_of_key_intervals_are_those_of_their_dense_mask(seqlen_q, seqlen_k):
    """Each (batch, query head) counts the causal pairs its mask head keeps (two query heads a head)."""
    scores = torch.randn(1, 2, seqlen_k, generator=torch.Generator().manual_seed(3))
    intervals = causal_topk_intervals(scores, 5, query_len=seqlen_q)
    i = torch.arange(seqlen_q)[:, None]
    causal = i >= torch.arange(seqlen_k)[None, :] + seqlen_q - seqlen_k
    expected = 2 * 2 * int((intervals.dense() & causal).sum())  # batch 2, 4 query heads over 2 mask heads
    assert selection_active_pairs(intervals, seqlen_q, seqlen_k, 2, 4) == expected
