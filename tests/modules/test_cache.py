"""Generation with DynamicMaskAttention: the caches, and prefill plus decoding against forwards without cache.

What "the same selection" means (see the DynamicMaskAttention docstring): a call over a cache of L
tokens with S new ones equals the last S rows of a forward over the L + S tokens, selection
included, for every kind of selection; dense and per-query-block selection also equal one forward
over the whole sequence, while the per-key selections of such a forward depend on later keys.
"""

import pytest
import torch

from flash_dma.block_mask import effective_mask_rows
from flash_dma.modules import KVCache, PagedKVCache
from flash_dma.modules import attention as attention_module
from tests.helpers import DEVICE
from tests.modules.test_attention import HEADS, HIDDEN, KV_HEADS, make_inputs, make_layer

HEAD_DIM = HIDDEN // HEADS
SEQLEN, PREFILL, PAGE = 40, 29, 16  # decoding crosses position 32: a new key block, a new page

SELECTIONS = {
    "dense": dict(window_size=None),
    "token": dict(window_size=8),
    "block": dict(window_size=16, block_size=16, sink_blocks=1),
    "block-local": dict(window_size=16, block_size=16, local_blocks=1),
}
CACHES = {
    "contiguous": lambda batch=2: KVCache(batch, SEQLEN, KV_HEADS, HEAD_DIM, device=DEVICE),
    "paged": lambda batch=2: PagedKVCache(batch, SEQLEN, KV_HEADS, HEAD_DIM, page_size=PAGE, device=DEVICE),
}


def run_cached(layer, x: torch.Tensor, cache, chunks: list[int]) -> list[tuple[int, torch.Tensor, dict]]:
    """Feed ``x`` through ``layer`` in chunks of these lengths: ``(end, output, selection)`` per call."""
    results, end = [], 0
    with torch.no_grad():
        for length in chunks:
            out, selection = layer(x[:, end : end + length], cache=cache, return_selection=True)
            end += length
            results.append((end, out, selection))
    return results


def prefill_then_decode(prefill: int = PREFILL, total: int = SEQLEN) -> list[int]:
    return [prefill] + [1] * (total - prefill)


def selection_rows(selection: dict, start: int, stop: int, key_len: int) -> torch.Tensor | None:
    """What a forward without cache lets queries ``[start, stop)`` attend among keys ``[0, key_len)``."""
    rows = effective_mask_rows(selection["attn_mask"], selection["block_mask"], start, stop, key_len)
    return None if rows is None else rows[..., :key_len]


def assert_same_selection(cached: torch.Tensor | None, expected: torch.Tensor | None, end: int, causal: bool = True):
    """Equal over the keys each query can see (causal: key <= query, bottom-right at ``end``)."""
    if expected is None:
        assert cached is None
        return
    cached, expected = torch.broadcast_tensors(cached, expected)
    rows = cached.shape[2]
    visible = torch.ones(rows, end, dtype=torch.bool, device=cached.device)
    visible = visible.tril(end - rows) if causal else visible
    assert torch.equal(cached & visible, expected & visible)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("cache_kind", CACHES)
@pytest.mark.parametrize("selection", SELECTIONS)
def test_decoding_equals_the_forward_over_the_tokens_so_far(selection, cache_kind, backend):
    layer = make_layer(backend=backend, **SELECTIONS[selection])
    oracle = make_layer(backend="reference", **SELECTIONS[selection])
    x, _ = make_inputs(seqlen=SEQLEN)
    for end, out, cached_selection in run_cached(layer, x, CACHES[cache_kind](), prefill_then_decode()):
        with torch.no_grad():
            expected_out, expected_selection = oracle(x[:, :end], return_selection=True)
        new = out.shape[1]
        torch.testing.assert_close(out, expected_out[:, -new:], atol=1e-5, rtol=1e-4)
        assert_same_selection(cached_selection["attn_mask"], selection_rows(expected_selection, end - new, end, end), end)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("cache_kind", CACHES)
@pytest.mark.parametrize("selection", ["dense", "block-local"])
def test_decoding_equals_one_forward_over_the_whole_sequence(selection, cache_kind, backend):
    layer = make_layer(backend=backend, **SELECTIONS[selection])
    x, _ = make_inputs(seqlen=SEQLEN)
    with torch.no_grad():
        whole_out, whole_selection = make_layer(backend="reference", **SELECTIONS[selection])(x, return_selection=True)
    for end, out, cached_selection in run_cached(layer, x, CACHES[cache_kind](), prefill_then_decode()):
        new = out.shape[1]
        torch.testing.assert_close(out, whole_out[:, end - new : end], atol=1e-5, rtol=1e-4)
        assert_same_selection(cached_selection["attn_mask"], selection_rows(whole_selection, end - new, end, end), end)


@pytest.mark.parametrize("selection", ["token", "block"])
def test_per_key_selection_of_a_whole_sequence_forward_depends_on_later_keys(selection):
    """The documented difference: one forward over the whole sequence shares a single per-key choice
    among all its keys, so later keys change what earlier queries see; decoding cannot know them."""
    layer = make_layer(**SELECTIONS[selection])
    x, _ = make_inputs(seqlen=SEQLEN)
    with torch.no_grad():
        whole_out, whole_selection = layer(x, return_selection=True)
    differs = []
    for end, out, cached_selection in run_cached(layer, x, CACHES["contiguous"](), prefill_then_decode()):
        if out.shape[1] != 1:
            continue
        whole_rows = selection_rows(whole_selection, end - 1, end, end)
        if selection == "token":  # fewer competitors: every key the whole forward shows the query stays kept
            assert torch.equal(cached_selection["attn_mask"] | whole_rows, cached_selection["attn_mask"])
        differs.append(not torch.equal(cached_selection["attn_mask"], whole_rows))
    assert any(differs)


@pytest.mark.parametrize("selection", [*SELECTIONS, "block-local-bidirectional"])
def test_chunked_prefill_equals_the_forward_over_the_tokens_so_far(selection, monkeypatch):
    # Small enough that causal per-query-block masks go to flash_dma_with_kvcache 3 query rows at a time.
    monkeypatch.setattr(attention_module, "CACHED_MASK_ELEMENTS", 2 * KV_HEADS * SEQLEN * 3)
    if selection == "block-local-bidirectional":
        layer = make_layer(**SELECTIONS["block-local"], is_causal=False)
    else:
        layer = make_layer(**SELECTIONS[selection])
    x, _ = make_inputs(seqlen=SEQLEN)
    with torch.no_grad():
        whole_out = layer(x)
    for end, out, cached_selection in run_cached(layer, x, CACHES["contiguous"](), [13, 6, 1, 11, 9]):
        with torch.no_grad():
            expected_out, expected_selection = layer(x[:, :end], return_selection=True)
        new = out.shape[1]
        torch.testing.assert_close(out, expected_out[:, -new:], atol=1e-5, rtol=1e-4)
        expected_rows = selection_rows(expected_selection, end - new, end, end)
        assert_same_selection(cached_selection["attn_mask"], expected_rows, end, causal=layer.is_causal)
        if selection in ("dense", "block-local"):
            torch.testing.assert_close(out, whole_out[:, end - new : end], atol=1e-5, rtol=1e-4)


def test_paged_cache_takes_pages_as_the_sequences_grow_and_holds_what_the_contiguous_one_does():
    layer = make_layer(window_size=8)
    x, _ = make_inputs(seqlen=SEQLEN)
    contiguous, paged = CACHES["contiguous"](), CACHES["paged"]()
    run_cached(layer, x, contiguous, [PREFILL])
    run_cached(layer, x, paged, [PREFILL])
    assert paged.pages_used == 2 * 2 and paged.block_table.tolist() == [[0, 2, 0], [1, 3, 0]]
    run_cached(layer, x[:, PREFILL:], contiguous, [1] * 4)
    run_cached(layer, x[:, PREFILL:], paged, [1] * 4)
    assert paged.pages_used == 3 * 2 and paged.block_table.tolist() == [[0, 2, 4], [1, 3, 5]]
    length = PREFILL + 4
    assert contiguous.length == paged.length == length
    assert contiguous.seqlens.tolist() == paged.seqlens.tolist() == [length, length]
    positions = torch.arange(length, device=DEVICE)
    pages, slots = paged.block_table[:, positions // PAGE].long(), positions % PAGE
    assert torch.equal(paged.key[pages, slots], contiguous.key[:, :length])
    assert torch.equal(paged.value[pages, slots], contiguous.value[:, :length])
    assert torch.equal(paged.cached_bias(), contiguous.cached_bias())
    expected_bias = layer.key_importance(layer.v_proj(x[:, :length]).view(2, length, KV_HEADS, HEAD_DIM))
    torch.testing.assert_close(contiguous.cached_bias(), expected_bias)


def test_reset_empties_the_cache_for_a_new_sequence():
    layer = make_layer(window_size=16, block_size=16, local_blocks=1)
    x, _ = make_inputs(seqlen=SEQLEN)
    cache = CACHES["paged"]()
    run_cached(layer, torch.randn_like(x), cache, [SEQLEN])
    cache.reset()
    assert (cache.length, cache.pages_used, cache.seqlens.tolist()) == (0, 0, [0, 0])
    (_, out, _), = run_cached(layer, x, cache, [SEQLEN])
    with torch.no_grad():
        torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-4)


def test_overflow_names_max_len_and_leaves_the_cache_as_it_was():
    layer = make_layer(window_size=8)
    x, _ = make_inputs(seqlen=SEQLEN)
    cache = CACHES["contiguous"]()
    run_cached(layer, x, cache, [38])
    message = r"max_len: the cache holds 38 tokens per sequence, and 3 new ones need 41 positions, more than max_len = 40"
    with pytest.raises(ValueError, match=message), torch.no_grad():
        layer(x[:, :3], cache=cache)
    assert cache.length == 38 and cache.seqlens.tolist() == [38, 38]


def test_paged_cache_with_too_few_pages_names_num_pages():
    layer = make_layer(window_size=8)
    x, _ = make_inputs(seqlen=SEQLEN)
    cache = PagedKVCache(2, SEQLEN, KV_HEADS, HEAD_DIM, page_size=PAGE, num_pages=3, device=DEVICE)
    message = r"num_pages: 17 new tokens per sequence need 4 more pages of 16 tokens, and the pool has 3 of its num_pages = 3"
    with pytest.raises(ValueError, match=message), torch.no_grad():
        layer(x[:, :17], cache=cache)
    assert cache.pages_used == 0 and cache.length == 0


@pytest.mark.parametrize(
    "make_cache, message",
    [
        (
            lambda: CACHES["contiguous"](batch=3),
            r"cache: expected \(batch_size, num_kv_heads, head_dim, device\) = \(2, 2, 8, .*got \(3, 2, 8,",
        ),
        (lambda: PagedKVCache(2, SEQLEN, 4, HEAD_DIM, page_size=PAGE, device=DEVICE), r"got \(2, 4, 8,"),
        (
            lambda: KVCache(2, SEQLEN, KV_HEADS, HEAD_DIM, dtype=torch.float64, device=DEVICE),
            r"cache: expected dtype torch.float32 \(that of this layer's keys\), got torch.float64",
        ),
    ],
    ids=["batch", "kv-heads", "dtype"],
)
def test_a_cache_that_does_not_fit_the_layer_is_named(make_cache, message):
    layer = make_layer(window_size=8)
    x, _ = make_inputs(seqlen=5)
    cache = make_cache()
    with pytest.raises(ValueError, match=message), torch.no_grad():
        layer(x, cache=cache)
    assert cache.length == 0


def test_padding_and_gradients_are_refused_with_a_cache():
    layer = make_layer(window_size=8)
    x, _ = make_inputs(seqlen=5)
    padding = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match=r"attention_mask: padding is not supported with a cache"), torch.no_grad():
        layer(x, padding, cache=CACHES["contiguous"]())
    with pytest.raises(RuntimeError, match=r"cache: decoding with a cache is forward only .* torch.no_grad\(\)"):
        layer(x, cache=CACHES["contiguous"]())
    with torch.inference_mode():  # the other way to run forward only
        assert layer(x, cache=CACHES["paged"]()).shape == x.shape


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(max_len=0), ValueError, r"max_len: expected an int >= 1, got 0"),
        (dict(page_size=0), ValueError, r"page_size: expected an int >= 1, got 0"),
        (dict(num_pages=0), ValueError, r"num_pages: expected an int >= 1, got 0"),
        (dict(head_dim=8.0), TypeError, r"head_dim: expected an int, got float 8.0"),
    ],
    ids=["max-len", "page-size", "num-pages", "head-dim"],
)
def test_bad_cache_arguments_are_named(kwargs, error, message):
    arguments = dict(batch_size=2, max_len=SEQLEN, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE)
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        PagedKVCache(**arguments)


@pytest.mark.gpu_only
@pytest.mark.parametrize("cache_kind", CACHES)
@pytest.mark.parametrize("selection", SELECTIONS)
def test_bf16_decoding_on_cuda_matches_the_forward_within_bf16_tolerance(selection, cache_kind):
    """On the Triton kernels in bf16: each call against a forward over the tokens so far, outputs
    within bf16 tolerance and the same selection."""
    layer = make_layer(**SELECTIONS[selection]).to(torch.bfloat16)
    x, _ = make_inputs(seqlen=SEQLEN)
    x = x.to(torch.bfloat16)
    cache = KVCache(2, SEQLEN, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    if cache_kind == "paged":
        cache = PagedKVCache(2, SEQLEN, KV_HEADS, HEAD_DIM, page_size=PAGE, dtype=torch.bfloat16, device=DEVICE)
    for end, out, cached_selection in run_cached(layer, x, cache, prefill_then_decode()):
        with torch.no_grad():
            expected_out, expected_selection = layer(x[:, :end], return_selection=True)
        new = out.shape[1]
        torch.testing.assert_close(out, expected_out[:, -new:], atol=2e-2, rtol=2e-2)
        assert_same_selection(cached_selection["attn_mask"], selection_rows(expected_selection, end - new, end, end), end)
