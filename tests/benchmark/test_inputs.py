import pytest
import torch

from flash_dma import create_mask
from flash_dma.benchmark.inputs import (
    CacheInputs,
    TokenInputs,
    block_topk_mask,
    make_inputs,
    pad_documents,
    query_block_topk_mask,
    unpad_documents,
)
from flash_dma.benchmark.llama import LLAMA_CONFIG
from flash_dma.benchmark.suites import Case, kept_block_count
from flash_dma.block_mask import EMPTY, FULL
from flash_dma.key_intervals import KeyIntervals
from flash_dma.masks import causal_topk_intervals

BLOCK = 128


def _block_view(mask: torch.Tensor) -> torch.Tensor:
    """``[1, H, 1, Sk]`` -> ``[H, n_blocks, BLOCK]`` (Sk padded with False)."""
    sk = mask.shape[-1]
    padded = torch.nn.functional.pad(mask[:, :, 0], (0, -sk % BLOCK))
    return padded[0].unflatten(-1, (-1, BLOCK))


@pytest.mark.parametrize("seqlen_k", [128, 1000, 4096])
@pytest.mark.parametrize("keep", [1.0, 1 / 2, 1 / 8, 1 / 32, 0.001])
def test_keeps_the_right_number_of_whole_blocks_including_block_zero(seqlen_k, keep):
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 3, 1, seqlen_k, generator=gen)
    mask = block_topk_mask(scores, keep)
    assert mask.shape == scores.shape and mask.dtype == torch.bool
    blocks = _block_view(mask)
    num_blocks = -(-seqlen_k // BLOCK)
    kept = blocks[:, :, 0]
    # Whole blocks: every key of a block shares the block's state (the ragged last block only over real keys).
    for h in range(3):
        for b in range(num_blocks):
            real = min(BLOCK, seqlen_k - b * BLOCK)
            assert bool((blocks[h, b, :real] == kept[h, b]).all())
    assert kept.sum(-1).tolist() == [kept_block_count(keep, num_blocks)] * 3
    assert bool(kept[:, 0].all())


def test_kept_blocks_are_the_best_rated_and_block_zero_replaces_the_lowest():
    # Block b's keys all score b: block 0 is the worst, so it must displace the lowest of the top 4.
    scores = torch.arange(16).repeat_interleave(BLOCK).float().view(1, 1, 1, -1)
    kept = _block_view(block_topk_mask(scores, 4 / 16))[0, :, 0]
    assert kept.nonzero().flatten().tolist() == [0, 13, 14, 15]


def test_blocks_are_rated_by_their_largest_score():
    scores = torch.zeros(1, 1, 1, 4 * BLOCK)
    scores[..., 2 * BLOCK + 5] = 10.0  # one large key makes block 2 the best after block 0
    scores[..., 3 * BLOCK :] = 1.0  # uniformly higher, but a lower maximum
    kept = _block_view(block_topk_mask(scores, 2 / 4))[0, :, 0]
    assert kept.tolist() == [True, False, True, False]


def _case(**changes) -> Case:
    fields = dict(suite="llm", kind="prefill", batch=2, heads=4, kv_heads=2, head_dim=16, seqlen_q=256,
                  seqlen_k=256, keep=1 / 2, methods=("flash-dma",), modes=("fwd", "fwdbwd"))
    return Case(**{**fields, **changes})


def test_make_inputs_shapes_dtypes_and_grad():
    inputs = make_inputs(_case(), "cpu")
    assert inputs.query.shape == (2, 256, 4, 16)
    assert inputs.key.shape == inputs.value.shape == (2, 256, 2, 16)
    assert inputs.mask.shape == inputs.bias.shape == (1, 2, 1, 256)
    assert inputs.mask.dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 and t.requires_grad for t in inputs.leaves)
    # The mask is the block top-k of the per-key bias itself.
    assert torch.equal(inputs.mask, block_topk_mask(inputs.bias.detach(), 1 / 2))

    decode = make_inputs(_case(seqlen_q=1, modes=("fwd",)), "cpu")
    assert not any(t.requires_grad for t in decode.leaves)

    full = make_inputs(_case(bias="full"), "cpu")
    assert full.bias.shape == (1, 4, 256, 256) and full.mask.shape == (1, 2, 1, 256)


def test_make_inputs_is_deterministic_per_seed():
    case = _case(seqlen_q=2048, seqlen_k=2048, keep=1 / 4)  # 4 of 16 blocks: room for the seeds to differ
    a, b, c = make_inputs(case, "cpu"), make_inputs(case, "cpu"), make_inputs(case, "cpu", seed=1)
    for name in ("query", "key", "value", "mask", "bias"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.mask, c.mask)
    assert not torch.equal(a.query, c.query)


def test_token_masks_are_the_seeds_create_mask_of_the_bias():
    inputs = make_inputs(_case(mask="token", window=100, keep=100 / 256), "cpu")
    assert inputs.mask.shape == inputs.bias.shape == (1, 2, 1, 256) and inputs.block_mask is None
    assert inputs.mask.sum(-1).flatten().tolist() == [100, 100]
    assert torch.equal(inputs.mask, create_mask(inputs.bias.detach(), None, 2, 256, 256, window_size=100))
    # Scattered: unlike a block top-k, kept keys are not whole blocks.
    assert not torch.equal(inputs.mask, block_topk_mask(inputs.bias.detach(), 100 / 256))


def test_interval_masks_are_each_querys_top_keys_of_the_bias():
    inputs = make_inputs(_case(mask="intervals", keep=1 / 8), "cpu")
    mask = inputs.mask
    assert isinstance(mask, KeyIntervals) and mask.shape == (1, 2, 256, 256) and inputs.block_mask is None
    expected = causal_topk_intervals(inputs.bias.detach()[:, :, 0], 32, query_len=256)
    assert torch.equal(mask.dense(), expected.dense())
    # Row i sees keys 0..i and keeps its 32 best.
    assert mask.dense().sum(-1)[0, :, 31:].eq(32).all() and mask.dense().sum(-1)[0, :, :31].eq(torch.arange(1, 32)).all()


def test_query_block_masks_keep_a_share_of_the_visible_blocks_per_query_block():
    case = _case(seqlen_q=2048, seqlen_k=2048, keep=1 / 4, mask="query-block")
    inputs = make_inputs(case, "cpu")
    assert inputs.mask is None and inputs.bias.shape == (1, 2, 1, 2048)
    bm = inputs.block_mask
    assert not bm.needs_mask and bm.state.shape == (1, 2, 16, 16)
    state = bm.state[0]
    for q_block in range(16):
        kept = (state[:, q_block] == FULL).sum(-1)
        assert kept.tolist() == [min(q_block + 1, case.kept_blocks)] * 2  # all it sees, up to 4 of 16
        assert bool((state[:, q_block, 0] == FULL).all())  # the sink block
        assert bool((state[:, q_block, q_block] == FULL).all())  # the diagonal (local) block
        assert not bool((state[:, q_block, q_block + 1 :] != EMPTY).any())  # nothing the causal rule hides
    assert bool(((state == FULL) | (state == EMPTY)).all())
    assert torch.equal(state, query_block_topk_mask(inputs.bias.detach(), case).state[0])


def test_unmasked_cases_and_cases_without_bias():
    bias_only = make_inputs(_case(mask="none"), "cpu")
    assert bias_only.mask is None and bias_only.block_mask is None and bias_only.bias.shape == (1, 2, 1, 256)
    bare = make_inputs(_case(mask="none", bias="none"), "cpu")
    assert bare.bias is None and len(bare.leaves) == 3
    assert all(t.requires_grad for t in bare.leaves)


def test_model_cases_get_token_ids():
    case = _case(kind="train", seqlen_q=64, seqlen_k=64, mask="none", bias="none", modes=("fwdbwd",))
    inputs = make_inputs(case, "cpu")
    assert isinstance(inputs, TokenInputs)
    ids = inputs.input_ids
    assert ids.shape == (2, 64) and ids.dtype == torch.int64
    assert 1 <= int(ids.min()) and int(ids.max()) < LLAMA_CONFIG["vocab_size"]
    assert torch.equal(ids, make_inputs(case, "cpu").input_ids)


def _varlen_case(documents=(100, 300, 156, 640), keep=1 / 2) -> Case:
    total = sum(documents)
    return Case("varlen", "prefill", 1, 4, 2, 16, total, total, keep, ("flash-dma-varlen",), ("fwd", "fwdbwd"),
                documents=documents)


def test_each_document_keeps_its_own_fraction_of_its_blocks_including_its_first():
    case = _varlen_case()
    inputs = make_inputs(case, "cpu")
    assert inputs.cu_seqlens.tolist() == [0, 100, 400, 556, 1196] and inputs.cu_seqlens.dtype == torch.int32
    assert inputs.query.shape == (1, 1196, 4, 16) and inputs.bias.shape == inputs.mask.shape == (1, 2, 1, 1196)
    state = inputs.block_mask.state
    assert state.shape == (4, 2, 1, 5) and inputs.block_mask.mask_shape == (4, 2, 1, 640)
    assert not inputs.block_mask.needs_mask  # blocks cut by a document's end are FULL
    for i, n in enumerate(case.documents):
        blocks = -(-n // BLOCK)
        kept = state[i, :, 0]
        assert ((kept == FULL).sum(-1) == kept_block_count(1 / 2, blocks)).all()
        assert (kept[:, 0] == FULL).all() and (kept[:, blocks:] == EMPTY).all()
    assert case.kept_blocks == int((state == FULL).sum()) // 2


def test_the_packed_mask_is_the_block_selection_per_key():
    case = _varlen_case()
    inputs = make_inputs(case, "cpu")
    start = 0
    for i, n in enumerate(case.documents):
        keys = inputs.mask[0, :, 0, start:start + n]
        blocks = inputs.block_mask.state[i, :, 0] == FULL
        assert torch.equal(keys, blocks.repeat_interleave(BLOCK, -1)[:, :n])
        # The selection is the top of the document's own bias (block 0 aside).
        bias = inputs.bias[0, :, 0, start:start + n].float()
        assert (bias[keys].max() >= bias[~keys].max()) if (~keys).any() else True
        start += n


def test_pad_and_unpad_documents():
    packed = torch.arange(10.0)[:, None].expand(10, 3)
    padded = pad_documents(packed, (4, 6), fill=-1)
    assert padded.shape == (2, 6, 3) and padded[0, 4:].eq(-1).all() and padded[1, 0, 0] == 4
    assert torch.equal(unpad_documents(padded, (4, 6)), packed)


def _cache_case(layout, keep=1 / 8, batch=2, length=1024) -> Case:
    return Case("kvcache", "decode", batch, 4, 2, 16, 1, length, keep, ("flash-dma-kvcache",), ("fwd",),
                mask="random", kv_layout=layout)


def test_kvcache_inputs_hold_the_same_keys_contiguous_or_paged():
    contiguous, paged = (make_inputs(_cache_case(layout), "cpu") for layout in ("contiguous", "paged"))
    assert isinstance(paged, CacheInputs) and paged.leaves == ()
    assert contiguous.k_cache.shape == (2, 1024, 2, 16) and contiguous.block_table is None
    assert paged.k_cache.shape == (8, 256, 2, 16) and paged.bias_cache.shape == (8, 256, 2)
    assert paged.block_table.shape == (2, 4) and paged.block_table.dtype == torch.int32
    assert sorted(paged.block_table.flatten().tolist()) == list(range(8))
    assert paged.block_table.flatten().tolist() != list(range(8))  # shuffled
    assert contiguous.cache_seqlens.tolist() == [1024, 1024] and contiguous.cache_seqlens.dtype == torch.int32
    for name in ("k_cache", "v_cache", "bias_cache"):
        pages = getattr(paged, name)[paged.block_table.long()]  # [B, pages, 256, ...]
        assert torch.equal(pages.flatten(1, 2), getattr(contiguous, name)), name
    assert torch.equal(paged.mask, contiguous.mask) and torch.equal(paged.query, contiguous.query)


@pytest.mark.parametrize("keep, kept", [(1.0, 1024), (1 / 8, 128)])
def test_kvcache_mask_keeps_random_keys_per_entry_and_head(keep, kept):
    inputs = make_inputs(_cache_case("contiguous", keep=keep), "cpu")
    assert inputs.mask.shape == (2, 2, 1, 1024) and inputs.mask.dtype == torch.bool
    assert (inputs.mask.sum(-1) == kept).all()
    if keep < 1:
        assert not torch.equal(inputs.mask[0], inputs.mask[1])
        blocks = inputs.mask[0, 0, 0].view(8, 128).any(-1)
        assert blocks.all()  # scattered over every block: not a block selection


def test_a_paged_cache_needs_whole_pages():
    with pytest.raises(ValueError, match="whole pages"):
        make_inputs(_cache_case("paged", length=1000), "cpu")


@pytest.mark.parametrize("mask", ["query-index", "query-index-overlap"])
def test_query_index_cases_get_topk_indices_and_their_bit_mask(mask):
    case = _case(mask=mask, window=20, keep=20 / 256)
    inputs = make_inputs(case, "cpu")
    assert inputs.indices.shape == (case.batch, case.seqlen_q, case.kv_heads, 20) and inputs.indices.dtype == torch.int32
    assert torch.equal(inputs.indices[0], inputs.indices[1])  # the scores, and so the selection, are shared
    assert torch.equal(inputs.mask.dense().sum(-1).transpose(1, 2), (inputs.indices[:1] >= 0).sum(-1))


def test_overlapping_selections_share_more_keys_between_neighbours_than_random_ones():
    def neighbours_shared(mask: str) -> float:
        indices = make_inputs(_case(mask=mask, window=20, keep=20 / 256), "cpu").indices[0, -64:, 0]  # [64, W]
        return sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(indices[1:], indices[:-1])) / (63 * 20)

    assert neighbours_shared("query-index-overlap") > 2 * neighbours_shared("query-index")
