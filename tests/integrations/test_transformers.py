"""attn_implementation="flash_dma" in transformers: tiny random models (no downloads) against SDPA."""

import copy
import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DogeConfig, DynamicCache, GenerationConfig, LlamaConfig, modeling_utils
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.masking_utils import create_causal_mask, sliding_window_causal_mask_function
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

import flash_dma.integrations.transformers as hf_integration
from flash_dma import flash_dma_varlen_func
from flash_dma.integrations.transformers import (
    ATTENTION_NAME,
    _packed_attention,
    _packed_documents,
    _split_additive_mask,
    flash_dma_attention_forward,
    flash_dma_mask,
    register,
)
from tests.helpers import DEVICE


def twin_models(config):
    """The same random weights behind attn_implementation="sdpa" and "flash_dma", in eval mode."""
    register()
    torch.manual_seed(0)
    # from_config writes the implementation into the config it is given: one copy per model, or both
    # models would end up running the last one named.
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ATTENTION_NAME).eval()
    ours.load_state_dict(reference.state_dict())
    assert (reference.config._attn_implementation, ours.config._attn_implementation) == ("sdpa", ATTENTION_NAME)
    return reference, ours


# A tiny random model: no downloads, milliseconds per forward.
TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


@pytest.fixture(scope="module")
def llama_pair():
    return twin_models(LlamaConfig(**TINY, max_position_embeddings=128))


@pytest.fixture(scope="module")
def served_pair():
    """``llama_pair`` on the test device: where CUDA is present, continuous batching serves only a
    model on it (transformers 5.17 opens its CUDA streams on the model's device)."""
    return tuple(model.to(DEVICE) for model in twin_models(LlamaConfig(**TINY, max_position_embeddings=128)))


def token_batch(seqlen: int = 21, pads: tuple[int, ...] = (0, 6, 3)):
    """Random prompts, one per entry of ``pads``, each left-padded (as for generation) by that many tokens."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 97, (len(pads), seqlen), generator=gen)
    attention_mask = torch.ones(len(pads), seqlen, dtype=torch.long)
    for row, pad in enumerate(pads):
        attention_mask[row, :pad] = 0
        input_ids[row, :pad] = 0  # pad_token_id, as a tokenizer would pad
    return input_ids, attention_mask


def test_logits_match_sdpa(llama_pair):
    reference, ours = llama_pair
    input_ids, _ = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids).logits, reference(input_ids).logits, atol=2e-5, rtol=1e-4)


def test_logits_match_sdpa_with_padding(llama_pair):
    reference, ours = llama_pair
    input_ids, attention_mask = token_batch()
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=attention_mask).logits
        actual = ours(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(actual[real], expected[real], atol=2e-5, rtol=1e-4)


def generate_logits(model, input_ids, attention_mask, cache: str):
    """Greedy generation: the tokens and the logits of every step, ``[steps, B, vocab]``."""
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation=cache,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("pads", [(0, 0, 0), (0, 6, 3)], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("cache", ["dynamic", "static"], ids=["DynamicCache", "StaticCache"])
def test_generate_matches_sdpa_at_every_step(llama_pair, cache, pads):
    reference, ours = llama_pair
    input_ids, attention_mask = token_batch(pads=pads)
    expected_tokens, expected_logits = generate_logits(reference, input_ids, attention_mask, cache)
    actual_tokens, actual_logits = generate_logits(ours, input_ids, attention_mask, cache)
    assert actual_logits.shape == (6, 3, 97)
    torch.testing.assert_close(actual_logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(actual_tokens, expected_tokens)


def batching_config(page: int, **batching) -> ContinuousBatchingConfig:
    """``ContinuousBatchingConfig`` with pages of ``page`` tokens, under the field's name in the
    installed transformers (``page_size`` from 5.23, ``block_size`` before), and a small static
    budget, so that tests sharing one GPU do not each size the cache from its free memory.

    Batching is synchronous: transformers' asynchronous batching, its default for flash-named
    implementations on a GPU, sometimes hands requests that join a running batch wrong tokens,
    whatever the attention computes (``docs/transformers.md``, "Continuous batching")."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    batching.setdefault("max_batch_tokens", 64)
    if "use_async_batching" in fields:
        batching.setdefault("use_async_batching", False)
    return ContinuousBatchingConfig(**{page_field: page}, **batching)


def batch_tokens(model, prompts, **batching):
    """Greedy tokens of ``generate_batch`` (continuous batching over a paged cache), one list per prompt."""
    generation = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = model.generate_batch(
        inputs=prompts, generation_config=generation, continuous_batching_config=batching_config(**batching),
        warmup=False,
    )
    assert [r.error for r in results.values()] == [None] * len(prompts)
    return [results[f"req_{i}"].generated_tokens for i in range(len(prompts))]


@pytest.mark.parametrize(
    "batching",
    [dict(page=256, num_blocks=8), dict(page=16, num_blocks=32, max_batch_tokens=24)],
    ids=["one-page-each", "small-pages-chunked-prefill"],
)
def test_continuous_batching_matches_sdpa(served_pair, batching):
    # Small pages and batches: requests span pages, and long prompts are prefilled in chunks after
    # their first part is cached (queries then see more keys than themselves: bottom-right causal).
    reference, ours = served_pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (n,), generator=gen).tolist() for n in (5, 2, 23, 17)]
    expected = batch_tokens(reference, prompts, **batching)
    assert batch_tokens(ours, prompts, **batching) == expected
    assert expected[0] == reference.generate(torch.tensor([prompts[0]], device=DEVICE), max_new_tokens=5, do_sample=False,
                                             pad_token_id=0)[0, 5:].tolist()


def test_a_continuous_batching_manager_serves_requests_as_they_come(served_pair):
    # The serving API under generate_batch: requests added to a running manager, results collected.
    reference, ours = served_pair
    prompts = [[5, 7, 9, 11], [3, 4, 60, 61, 62, 63]]
    generation = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = ours.init_continuous_batching(
        generation_config=generation, continuous_batching_config=batching_config(page=16, num_blocks=8)
    )
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=4) for prompt in prompts]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None, "the manager stopped before answering every request"
            results[result.request_id] = result
    finally:
        manager.stop(block=True)
    for request_id, prompt in zip(ids, prompts):
        expected = reference.generate(torch.tensor([prompt], device=DEVICE), generation_config=generation)[0, len(prompt):]
        assert results[request_id].error is None and results[request_id].generated_tokens == expected.tolist()


class PackedCache:
    """What ``PagedAttentionCache.update`` gives the attention function: every request's keys, packed."""

    def __init__(self, key, value):
        self.key, self.value = key, value

    def update(self, key_states, value_states, layer_idx, kwargs):
        return self.key, self.value


def test_padded_continuous_batches_leave_the_padding_rows_out():
    # With CUDA graphs or compiled steps transformers pads the packed row past the last request.
    q, k, v = random_qkv(batch=1, seqlen_q=8, seqlen_k=10)
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    kwargs = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=3, max_length_k=6)
    out = _packed_attention(CausalLayer(), q, None, None, PackedCache(k, v), kwargs)
    expected = flash_dma_varlen_func(
        *(t[0, :, :rows].transpose(0, 1) for t, rows in ((q, 5), (k, 9), (v, 9))), cu_q, cu_k, 3, 6, is_causal=True
    )
    assert out.shape == (1, 8, 4, 16)
    assert torch.equal(out[0, :5], expected) and not out[0, 5:].any()


def test_packed_keys_without_a_cache_are_attended_as_packed_sequences():
    # transformers 5.24 on: the layer reads the paged cache itself and hands its keys with the bounds;
    # so do packed training batches. The same result as through the cache.
    q, k, v = random_qkv(batch=1, seqlen_q=8, seqlen_k=10)
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    kwargs = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=3, max_length_k=6)
    out, _ = flash_dma_attention_forward(CausalLayer(), q, k, v, None, **kwargs)
    assert torch.equal(out, _packed_attention(CausalLayer(), q, None, None, PackedCache(k, v), dict(kwargs)))


def packed_documents(lengths=(5, 9, 3, 7)):
    """Random documents, alone ``[1, n]`` each, and packed as ``DataCollatorWithFlattening`` packs them
    by default: ``(documents, input_ids [1, S], position_ids [1, S])``, positions restarting per document."""
    gen = torch.Generator().manual_seed(4)
    documents = [torch.randint(1, 97, (1, n), generator=gen) for n in lengths]
    return documents, torch.cat(documents, 1), torch.cat([torch.arange(n) for n in lengths])[None]


def cache_argument(model) -> str:
    """The name under which ``model``'s forward takes a cache object in the installed transformers."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def spy_on_varlen(monkeypatch) -> list:
    """The ``cu_seqlens_q`` of every flash_dma_varlen_func call the attention function makes from now on."""
    calls = []

    def spy(q, k, v, cu_seqlens_q, *args, **kwargs):
        calls.append(cu_seqlens_q.tolist())
        return flash_dma_varlen_func(q, k, v, cu_seqlens_q, *args, **kwargs)

    monkeypatch.setattr(hf_integration, "flash_dma_varlen_func", spy)
    return calls


@pytest.mark.parametrize(
    "cache", ["made-by-the-model", "passed", "off"],
    ids=["DynamicCache-by-default", "DynamicCache-passed", "use_cache-False"],
)
def test_documents_packed_by_position_ids_alone_attend_as_if_run_alone(llama_pair, cache, monkeypatch):
    # One row, no mask: with a cache, transformers' mask builders do not look for documents, and the
    # attention function finds them from position_ids; without one, their complete 4-D mask holds them apart.
    _, ours = llama_pair
    documents, input_ids, position_ids = packed_documents()
    settings = {
        "made-by-the-model": {},
        "passed": {cache_argument(ours): DynamicCache(config=ours.config)},
        "off": dict(use_cache=False),
    }[cache]
    calls = spy_on_varlen(monkeypatch)
    with torch.no_grad():
        alone = torch.cat([ours(document).logits for document in documents], 1)
        packed = ours(input_ids, position_ids=position_ids, **settings).logits
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
    assert calls == ([] if cache == "off" else [[0, 5, 14, 17, 24]] * ours.config.num_hidden_layers)


def test_packed_documents_train_as_if_run_alone(llama_pair):
    _, ours = llama_pair
    documents, input_ids, position_ids = packed_documents()
    grads = []
    for runs in ([(input_ids, position_ids)], [(document, None) for document in documents]):
        ours.zero_grad()
        sum(ours(ids, position_ids=positions).logits.square().mean(-1).sum() for ids, positions in runs).backward()
        grads.append(ours.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3], ids=["one-row", "three-rows"])
def test_ordinary_rows_with_position_ids_are_not_split(llama_pair, rows, monkeypatch):
    reference, ours = llama_pair
    input_ids, _ = token_batch(pads=(0,) * rows)
    position_ids = torch.arange(input_ids.shape[1])[None]  # unsqueezed, not expanded, as the models make it
    calls = spy_on_varlen(monkeypatch)
    with torch.no_grad():
        actual = ours(input_ids, position_ids=position_ids).logits
        expected = reference(input_ids, position_ids=position_ids).logits
    assert calls == []
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "positions",
    [[0, 1, 2, 0, 1, 0, 1, 2, 3], [2, 3, 4, 2, 3, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 0]],
    ids=["from-0", "from-2-as-roberta", "one-token-last"],
)
def test_documents_are_bounded_as_flash_attention_bounds_them(positions):
    q, k, _ = random_qkv(batch=1, seqlen_q=9, seqlen_k=9)
    cu_seqlens, longest = _packed_documents(torch.tensor([positions]), q, k)
    (expected, _), (expected_longest, _) = prepare_fa_kwargs_from_position_ids(torch.tensor([positions]))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == expected.tolist()
    assert longest == int(expected_longest)


def test_a_first_document_past_the_smallest_position_is_a_document_too():
    # flash-attention's bounds would start at 3 and leave the first three rows out.
    q, k, _ = random_qkv(batch=1, seqlen_q=7, seqlen_k=7)
    cu_seqlens, longest = _packed_documents(torch.tensor([[4, 5, 6, 0, 1, 2, 3]]), q, k)
    assert cu_seqlens.tolist() == [0, 3, 7] and longest == 4


@pytest.mark.parametrize(
    "positions, batch, seqlen_k",
    [([0, 1, 2, 3, 4, 5], 1, 6), ([3, 4, 5, 6, 7, 8], 1, 6), ([0, 1, 2, 0, 1, 2], 2, 6), ([0, 1, 2, 0, 1, 2], 1, 9)],
    ids=["one-document", "one-document-after-3", "two-rows", "keys-past-the-queries"],
)
def test_only_one_row_of_several_documents_over_its_own_keys_is_split(positions, batch, seqlen_k):
    q, k, _ = random_qkv(batch=batch, seqlen_q=6, seqlen_k=seqlen_k)
    assert _packed_documents(torch.tensor([positions]), q, k) is None


def test_positions_are_read_once_per_tensor_and_version():
    q, k, _ = random_qkv(batch=1, seqlen_q=8, seqlen_k=8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    documents = _packed_documents(positions, q, k)
    assert documents[0].tolist() == [0, 3, 5, 8] and documents[1] == 3
    assert _packed_documents(positions, q, k) is documents
    positions.copy_(torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))
    assert _packed_documents(positions, q, k)[0].tolist() == [0, 5, 8]


def test_positions_are_not_read_inside_a_trace(monkeypatch):
    # torch.compile (and a CUDA graph capture) would break on the read; there transformers' mask
    # builders hold documents apart without a cache, and cu_seq_lens do with one.
    q, k, _ = random_qkv(batch=1, seqlen_q=6, seqlen_k=6)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _packed_documents(torch.tensor([[0, 1, 2, 0, 1, 2]]), q, k) is None


class IndexedCache(PackedCache):
    """``PagedAttentionCache.update`` of transformers before 5.23: read and write indices, keys ``[total_k, Hkv, D]``."""

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        return self.key[0].transpose(0, 1), self.value[0].transpose(0, 1)


def test_continuous_batching_before_transformers_5_23_reads_its_cache_api():
    # Lengths named max_seqlen_*, and per layer type where full and sliding-window layers mix.
    q, k, v = random_qkv(batch=1, seqlen_q=8, seqlen_k=10)
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    kwargs = dict(cu_seq_lens_q=cu_q, max_seqlen_q=3, read_index=[], write_index=[],
                  cu_seq_lens_k={"full_attention": cu_k, "sliding_attention": None},
                  max_seqlen_k={"full_attention": 6, "sliding_attention": None})
    out = _packed_attention(CausalLayer(), q, None, None, IndexedCache(k, v), kwargs)
    current = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=3, max_length_k=6)
    assert torch.equal(out, _packed_attention(CausalLayer(), q, None, None, PackedCache(k, v), current))


def test_a_block_table_is_refused_rather_than_attending_without_the_cache():
    q, k, v = random_qkv(batch=1)
    kwargs = dict(block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match=r"block_table: flash_dma serves continuous batching through"):
        _packed_attention(CausalLayer(), q, k, v, PackedCache(k, v), kwargs)


def test_gradients_match_sdpa(llama_pair):
    reference, ours = llama_pair
    input_ids, attention_mask = token_batch()
    grads = []
    for model in (reference, ours):
        model.zero_grad()
        model(input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_padded_causal_mask_stays_two_dimensional(llama_pair):
    _, ours = llama_pair
    input_ids, attention_mask = token_batch()
    embeds = ours.model.embed_tokens(input_ids)
    # No cache, by position: transformers 5.24 renamed the parameter past_key_values to cache.
    mask = create_causal_mask(ours.config, embeds, attention_mask.bool(), None)
    assert mask.shape == (3, 21) and torch.equal(mask, attention_mask.bool())
    assert create_causal_mask(ours.config, embeds, torch.ones_like(attention_mask, dtype=torch.bool), None) is None


def test_other_patterns_get_the_4d_mask_of_sdpa():
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[0, :2] = False
    window = sliding_window_causal_mask_function(3)
    mask = flash_dma_mask(2, 9, 9, mask_function=window, attention_mask=padding)
    keys, queries = torch.arange(9)[None, :], torch.arange(9)[:, None]
    expected = (keys <= queries) & (keys > queries - 3) & padding[:, None, None, :]
    assert mask.shape == (2, 1, 9, 9) and torch.equal(mask, expected)


@pytest.mark.parametrize(
    "q_offset, kv_length, allow_is_causal_skip",
    [(torch.tensor(0), 8, True), (0, 5, False)],
    ids=["static-cache-prefill", "materialised-mask-requested"],
)
def test_mask_is_4d_where_none_would_be_wrong(q_offset, kv_length, allow_is_causal_skip):
    # A static cache: 5 queries, 8 key slots of which 3 are empty. SDPA may use is_causal (top-left)
    # there, flash-dma's bottom-right causal would attend the empty slots. Doge asks for the mask
    # itself (allow_is_causal_skip=False), to add its dynamic mask onto it.
    padding = torch.ones(2, 5, dtype=torch.bool)
    mask = flash_dma_mask(
        2, 5, kv_length, q_offset=q_offset, attention_mask=padding, allow_is_causal_skip=allow_is_causal_skip
    )
    keys, queries = torch.arange(kv_length)[None, :], torch.arange(5)[:, None]
    expected = (keys <= queries).expand(2, 1, 5, kv_length)
    assert mask is not None and torch.equal(mask, expected)


class CausalLayer(torch.nn.Module):
    is_causal = True
    layer_idx = 0  # what a paged cache's update is told


def random_qkv(batch=2, heads=4, kv_heads=2, seqlen_q=11, seqlen_k=11, dim=16):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(batch, heads, seqlen_q, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, dim, generator=gen) for _ in range(2))
    return q, k, v


def sdpa_reference(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def test_additive_4d_mask_becomes_mask_and_differentiable_bias():
    q, k, v = random_qkv()
    gen = torch.Generator().manual_seed(3)
    visible = (torch.rand(2, 1, 11, 11, generator=gen) < 0.6) | torch.eye(11, dtype=torch.bool)
    bias = torch.randn(2, 1, 11, 11, generator=gen)
    additive = torch.where(visible, bias, torch.finfo(torch.float32).min).requires_grad_()
    out, weights = flash_dma_attention_forward(CausalLayer(), q, k, v, additive)
    assert weights is None and out.shape == (2, 11, 4, 16)
    torch.testing.assert_close(out, sdpa_reference(q, k, v, additive.detach()), atol=1e-5, rtol=1e-4)
    out.sum().backward()
    assert additive.grad is not None and additive.grad[visible.expand_as(additive)].abs().sum() > 0
    assert not additive.grad[~visible.expand_as(additive)].any()
    # Every layer gets the same mask: its bits are packed once per version of it.
    assert _split_additive_mask(additive, q.dtype)[0] is _split_additive_mask(additive, q.dtype)[0]


def test_boolean_4d_mask_is_complete_and_not_made_causal():
    q, k, v = random_qkv(seqlen_q=5, seqlen_k=9)
    mask = torch.rand(2, 1, 5, 9, generator=torch.Generator().manual_seed(4)) < 0.7
    mask[..., 0] = True
    out, _ = flash_dma_attention_forward(CausalLayer(), q, k, v, mask)
    torch.testing.assert_close(out, sdpa_reference(q, k, v, mask), atol=1e-5, rtol=1e-4)


def test_short_padding_mask_drops_empty_cache_slots():
    # A static cache of 12 slots holding 7 real tokens: keys 7..11 are empty and must not count.
    q, k, v = random_qkv(seqlen_q=3, seqlen_k=12)
    padding = torch.ones(2, 7, dtype=torch.bool)
    out, _ = flash_dma_attention_forward(CausalLayer(), q, k, v, padding)
    causal = torch.ones(3, 7, dtype=torch.bool).tril(4)
    torch.testing.assert_close(out, sdpa_reference(q, k[:, :, :7], v[:, :, :7], causal), atol=1e-5, rtol=1e-4)


def test_dropout_is_refused():
    q, k, v = random_qkv()
    with pytest.raises(ValueError, match=r"dropout: flash_dma has no attention dropout.*got 0.1"):
        flash_dma_attention_forward(CausalLayer(), q, k, v, None, dropout=0.1)


def test_registration_exempts_only_its_own_name():
    register()
    register()
    assert modeling_utils.lazy_import_flash_attention(ATTENTION_NAME) is None
    with pytest.raises(ValueError, match="flash_nonexistent"):
        modeling_utils.lazy_import_flash_attention("flash_nonexistent")


def test_doge_dynamic_mask_runs_through_flash_dma():
    """Doge builds its own dynamic top-k mask as a 4-D additive float mask carrying the bias. The
    reference runs "eager": under "sdpa", transformers before 5.23 hands Doge no causal mask for an
    unpadded batch, and it ranks later keys too (tests/integrations/test_doge.py)."""
    reference, ours = twin_models(DogeConfig(**TINY, keep_window_size=8, is_moe=False))
    reference.set_attn_implementation("eager")
    for layer in reference.model.layers:
        torch.nn.init.normal_(layer.self_attn.A)  # away from Doge's A = 0, so that keys differ
    ours.load_state_dict(reference.state_dict())
    # Distinct tokens: a repeated one has the same dt in the first layer, a tie that flash-dma gives
    # to the earlier key and Doge's torch.topk to either.
    input_ids = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:60].view(3, 20) + 1
    expected = reference(input_ids).logits
    actual = ours(input_ids, labels=input_ids)
    torch.testing.assert_close(actual.logits, expected, atol=2e-5, rtol=1e-4)
    actual.loss.backward()
    assert ours.model.layers[0].self_attn.A.grad.abs().sum() > 0
