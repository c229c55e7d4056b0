from dataclasses import replace

import pytest

from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.runner import count_rows
from flash_dma.benchmark.llama import BATCH_PROMPT_LENGTHS
from flash_dma.benchmark.suites import (
    DENSE_METHODS,
    batching_cases,
    SUITES,
    build_cases,
    first_call_cases,
    document_lengths,
    host_cases,
    kvcache_cases,
    llama_cases,
    llm_cases,
    seed_cases,
    token_cases,
    topk_cases,
    topkq_cases,
    varlen_cases,
)


def _by_kind(cases, kind):
    return [c for c in cases if c.kind == kind]


def test_seed_prefill_keeps_a_2048_key_window():
    prefill = _by_kind(seed_cases(), "prefill")
    assert [c.seqlen_k for c in prefill] == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    for c in prefill:
        assert (c.batch, c.heads, c.kv_heads, c.head_dim, c.seqlen_q) == (1, 2, 1, 64, c.seqlen_k)
        assert c.kept_blocks * 128 == min(2048, c.seqlen_k)
        assert c.modes == ("fwd", "fwdbwd")
        assert set(c.methods) == {"flash-dma", "flex", "sdpa-additive", "sdpa-flash", "sdpa-cudnn"}


def test_seed_decode_is_forward_only_with_dense_rows_once_per_length():
    decode = _by_kind(seed_cases(), "decode")
    lengths = [256, 1024, 4096, 16384, 65536, 131072, 262144, 524288]
    assert [(c.seqlen_k, c.keep) for c in decode] == [(s, k) for s in lengths for k in (1.0, 1 / 8)]
    for c in decode:
        assert c.seqlen_q == 1 and c.modes == ("fwd",) and c.is_decode
        assert any(m in c.methods for m in DENSE_METHODS) == (c.keep == 1.0)
    assert decode[-1].kept_blocks == 4096 // 8


def test_seed_window_sweep_keeps_at_least_one_block():
    sweep = _by_kind(seed_cases(), "window")
    assert [c.window for c in sweep] == [2**p for p in range(5, 16)]
    assert all(c.seqlen_q == c.seqlen_k == 32768 for c in sweep)
    assert [c.kept_blocks for c in sweep] == [1, 1, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert all(c.methods == ("flash-dma", "flex") for c in sweep)


def test_llm_suite():
    cases = llm_cases()
    per_key = [c for c in cases if c.bias == "key"]
    assert [(c.seqlen_k, c.keep) for c in per_key] == [
        (s, k) for s in (4096, 8192, 16384, 32768) for k in (1.0, 1 / 2, 1 / 8, 1 / 32)
    ] + [(131072, 1 / 8)]
    for c in cases:
        assert (c.batch, c.heads, c.kv_heads, c.head_dim) == (1, 16, 4, 128)
        assert c.seqlen_q == c.seqlen_k and c.mask == "block" and c.cache is None
    for c in per_key[:-1]:
        assert "flash-dma-percall" in c.methods
        assert all(m in c.methods for m in DENSE_METHODS) == (c.keep == 1.0)
        assert ("flash-dma-nobias" in c.methods) == (c.keep == 1.0)
    (full,) = [c for c in cases if c.bias == "full"]
    assert (full.seqlen_k, full.keep, full.modes) == (4096, 1 / 8, ("fwd", "fwdbwd"))
    # 128K: keep 1/8 only, with cuDNN as the dense ceiling (sdpa-additive is skipped by its budget).
    long = per_key[-1]
    assert long.methods == ("flash-dma", "flash-dma-percall", "flash-dma-flex", "flex", "sdpa-additive", "sdpa-cudnn")
    assert long.kept_blocks == 128 and long.modes == ("fwd", "fwdbwd")


def test_topkq_suite_keeps_one_eighth_of_the_blocks_per_query_block():
    (c,) = topkq_cases()
    assert (c.suite, c.mask, c.bias, c.seqlen_q, c.seqlen_k) == ("topkq", "query-block", "key", 16384, 16384)
    assert (c.batch, c.heads, c.kv_heads, c.head_dim) == (1, 16, 4, 128)
    assert c.methods == ("flash-dma", "flash-dma-bits", "flex", "sdpa-cudnn") and c.modes == ("fwd", "fwdbwd")
    assert c.kept_text == "16/128 per q-block" and c.label == "S=16384 keep=1/8 per q-block"


def test_topk_suite_compares_indices_with_the_packed_mask_dense_causal_and_flex():
    c, overlap, long, long_overlap, wide = topk_cases()
    assert (long_overlap.seqlen_k, long_overlap.mask, long_overlap.methods) == (131072, "query-index-overlap", ("flash-dma-topk", "flash-dma-nomask"))
    for case in (c, overlap, long, wide):
        assert (case.suite, case.bias, case.window, case.modes) == ("topk", "key", 2048, ("fwd", "fwdbwd"))
        assert (case.batch, case.kv_heads, case.head_dim) == (1, 4, 128)
        assert case.mask == ("query-index-overlap" if case is overlap else "query-index")
    assert (overlap.seqlen_k, overlap.heads, overlap.methods) == (32768, 16, ("flash-dma-topk", "flash-dma"))
    assert overlap.label == "S=32768 top-2048 keys per query (indices, overlapping)"
    assert (c.seqlen_q, c.seqlen_k, c.heads) == (32768, 32768, 16)
    assert c.methods == ("flash-dma-topk", "flash-dma", "flash-dma-nomask", "flex")
    assert c.kept_text == "2048/32768 keys per query" and c.label == "S=32768 top-2048 keys per query (indices)"
    assert (long.seqlen_q, long.seqlen_k, long.heads) == (131072, 131072, 16)
    assert long.methods == ("flash-dma-topk", "flash-dma-nomask", "flex")
    assert (wide.seqlen_k, wide.heads, wide.methods) == (131072, 64, ("flash-dma-topk",))
    assert wide.shape_text() == "B=1 H=64 Hkv=4 D=128"
    assert topk_cases(quick=True) == [c]


def test_token_suite_has_the_mask_and_a_bias_only_reference():
    token, bias_only = token_cases()
    assert (token.mask, token.window, token.keep, token.kept_keys) == ("token", 2048, 1 / 8, 2048)
    assert token.methods == ("flash-dma", "flex") and token.label == "S=16384 top-2048 keys"
    assert (bias_only.mask, bias_only.bias, bias_only.keep) == ("none", "key", 1.0)
    assert bias_only.methods == ("flash-dma", "sdpa-cudnn") and bias_only.label == "S=16384 bias only"
    for c in (token, bias_only):
        assert (c.heads, c.kv_heads, c.head_dim, c.seqlen_k, c.modes) == (16, 4, 128, 16384, ("fwd", "fwdbwd"))
        assert c.counts_work and not c.is_host and not c.is_model


def test_host_suite_is_tiny_with_and_without_mask_and_bias():
    seeds, bare = host_cases()
    for c in (seeds, bare):
        shape = (c.batch, c.heads, c.kv_heads, c.head_dim, c.seqlen_q, c.seqlen_k)
        assert c.kind == "host" and shape == (1, 2, 1, 64, 128, 128)
        assert c.is_host and not c.counts_work
        assert c.methods == ("flash-dma", "flex", "sdpa") and c.modes == ("fwd", "fwdbwd")
    assert (seeds.mask, seeds.bias, seeds.kept_keys) == ("token", "key", 128)  # the seeds' window keeps all 128
    assert (bare.mask, bare.bias, bare.label) == ("none", "none", "S=128 no mask, no bias")


def test_batching_suite_serves_requests_of_many_lengths():
    (c,) = batching_cases()
    assert (c.kind, c.batch, c.seqlen_k, c.modes) == ("serve", 16, 2048, ("fwd",)) and c.is_model and not c.counts_work
    assert c.methods == ("batch-flash-dma", "batch-sdpa") and c.generated_tokens == 16 * 32
    assert sorted(set(BATCH_PROMPT_LENGTHS)) == [128, 256, 512, 1024, 2048]
    assert c.label == "16 requests, prompts up to 2048, 32 new tokens each"


def test_llama_suite_times_train_steps():
    cases = llama_cases()
    assert [c.seqlen_k for c in cases] == [4096, 8192, 16384]
    for c in cases:
        assert c.kind == "train" and c.is_model and not c.counts_work
        assert c.methods == ("llama-flash-dma", "llama-sdpa") and c.modes == ("fwdbwd",)
        assert c.shape_text().startswith("transformers Llama, 4 layers, hidden 2048")
    assert [c.seqlen_k for c in llama_cases(quick=True)] == [4096]


def test_first_call_suite():
    warm, cold, generate, train = first_call_cases()
    for c in (warm, cold):
        assert (c.kind, c.seqlen_k, c.keep, c.mask, c.heads) == ("prefill", 4096, 1 / 8, "block", 16)
        assert c.methods == ("flash-dma-percall",) and c.modes == ("fwd", "fwdbwd") and not c.counts_work
    assert (warm.cache, cold.cache) == ("warm", "cold")
    assert cold.label == "S=4096 keep=1/8, new process, cold caches"
    assert (generate.kind, generate.seqlen_k, generate.modes, generate.cache) == ("generate", 128, ("fwd",), "warm")
    assert generate.label == "prompt=128 generate 8, new process, warm cache"
    assert (train.kind, train.seqlen_k, train.modes, train.cache) == ("train", 4096, ("fwdbwd",), "warm")
    assert generate.methods == train.methods == ("llama-flash-dma",)
    assert first_call_cases(quick=True) == [warm]


def test_every_method_named_by_a_suite_exists():
    assert {m for c in build_cases() for m in c.methods} == set(METHODS)


def test_quick_is_a_small_subset_of_the_full_run():
    full, quick = build_cases(), build_cases(quick=True)
    assert set(quick) <= set(full)
    assert {c.suite for c in quick} == set(SUITES)
    assert count_rows(quick) <= 134 < count_rows(full)


def test_all_runs_every_suite_in_order_and_each_suite_runs_alone():
    cases = build_cases()
    order = list(dict.fromkeys(c.suite for c in cases))
    assert order == list(SUITES) and order[0] == "llm"
    assert cases == [c for suite in SUITES for c in build_cases(suite)]


def test_filters_on_modes_and_methods():
    backward_only = build_cases(modes=("fwdbwd",))
    assert backward_only and all(c.modes == ("fwdbwd",) and not c.is_decode for c in backward_only)
    flex_only = build_cases("llm", methods=("flex",))
    assert len(flex_only) == 18 and all(c.methods == ("flex",) for c in flex_only)
    assert all(c.kind == "train" for c in build_cases(modes=("fwdbwd",), methods=("llama-sdpa",)))
    assert not build_cases("llama", modes=("fwd",))
    dense_only = build_cases("seed", methods=("sdpa-flash",))
    assert all(c.keep == 1.0 or c.kind == "prefill" for c in dense_only)
    with pytest.raises(ValueError, match="suite"):
        build_cases("gpt")


def test_filters_on_lengths_and_keeps():
    picked = build_cases("llm", lengths=(16384, 32768), keeps=(1 / 8,))
    assert [(c.seqlen_k, c.keep) for c in picked] == [(16384, 1 / 8), (32768, 1 / 8)]
    assert {c.seqlen_k for c in build_cases("llm", lengths=(131072,))} == {131072}
    assert not build_cases("llm", lengths=(12345,))


def test_labels():
    seed = seed_cases()
    assert seed[4].label == "S=4096 keep=1/2"
    assert _by_kind(seed, "decode")[1].label == "Sk=256 keep=1/8"
    assert _by_kind(seed, "window")[0].label == "S=32768 W=32"
    assert llm_cases()[-2].label == "S=4096 keep=1/8 bias[1,16,Sq,Sk]"
    assert llm_cases()[-1].label == "S=131072 keep=1/8"


def test_document_lengths_are_drawn_once_and_fill_the_total():
    documents = document_lengths()
    assert documents == document_lengths()  # fixed seed
    assert len(documents) == 8 and sum(documents) == 32768
    assert all(512 <= n <= 8192 for n in documents)
    assert document_lengths(seed=1) != documents
    assert sum(document_lengths(count=4, total=8192, low=1000, high=3000, seed=3)) == 8192


def test_varlen_suite_packs_eight_documents_into_32k():
    (c,) = varlen_cases()
    assert (c.suite, c.kind, c.batch, c.heads, c.kv_heads, c.head_dim) == ("varlen", "prefill", 1, 16, 4, 128)
    assert c.documents == document_lengths() and c.seqlen_q == c.seqlen_k == 32768
    assert (c.keep, c.mask, c.bias, c.modes) == (1 / 8, "block", "key", ("fwd", "fwdbwd"))
    assert c.methods == ("flash-dma-varlen", "flex", "flash-dma-padded")
    # Each document keeps 1/8 of its own blocks (at least one): summed, not 1/8 of the total's.
    blocks = [-(-n // 128) for n in c.documents]
    assert c.key_blocks == sum(blocks)
    assert c.kept_blocks == sum(max(1, round(b / 8)) for b in blocks)
    assert c.kept_text == f"{c.kept_blocks}/{c.key_blocks} per doc"
    assert c.label == "S=32768 8 docs keep=1/8" and c.counts_work and not c.is_decode
    assert c.shape_text().startswith("8 documents packed (lengths ") and c.shape_text().endswith("H=16 Hkv=4 D=128")
    assert varlen_cases(quick=True) == [c]  # already one Flex compilation


def test_kvcache_suite_decodes_over_full_caches():
    cases = kvcache_cases()
    assert [(c.batch, c.seqlen_k, c.keep, c.kv_layout) for c in cases] == [
        (8, 32768, 1.0, "contiguous"), (8, 32768, 1.0, "paged"), (8, 32768, 1 / 8, "contiguous"),
        (8, 32768, 1 / 8, "paged"), (1, 524288, 1 / 8, "contiguous"),
    ]
    for c in cases:
        assert c.kind == "decode" and c.is_decode and c.uses_kv_cache and c.counts_work
        assert (c.seqlen_q, c.mask, c.bias, c.modes) == (1, "random", "key", ("fwd",))
        assert c.methods == ("flash-dma-kvcache",)
        assert c.page_size == (256 if c.kv_layout == "paged" else None)
    assert all((c.heads, c.kv_heads, c.head_dim) == (32, 8, 128) for c in cases[:4])
    assert (cases[-1].heads, cases[-1].kv_heads, cases[-1].head_dim) == (2, 1, 64)
    assert [c.label for c in cases[1:4]] == ["Sk=32768 keep=1 paged 256", "Sk=32768 keep=1/8 random contiguous",
                                             "Sk=32768 keep=1/8 random paged 256"]
    assert cases[2].kept_text == "4096/32768 keys" and cases[-1].kept_keys == 65536
    assert kvcache_cases(quick=True) == cases[2:]
    assert not build_cases("kvcache", modes=("fwdbwd",))


def test_forms_suite_is_the_plain_call_then_each_form():
    plain, keep_all, softcap, deterministic, intervals, prefill, prefill_all, paged_all, short, *head_dims = build_cases("forms")
    assert (plain.seqlen_k, plain.keep, plain.softcap, plain.deterministic) == (16384, 1 / 8, 0.0, False)
    assert plain.methods == ("flash-dma", "flash-dma-fp8") and keep_all == replace(plain, keep=1, modes=("fwd",))
    assert softcap == replace(plain, softcap=30.0, methods=("flash-dma",)) and softcap.label == "S=16384 keep=1/8 softcap=30"
    assert deterministic.deterministic and deterministic.modes == ("fwdbwd",)
    assert deterministic.label == "S=16384 keep=1/8 deterministic"
    assert intervals == replace(plain, mask="intervals", methods=("flash-dma",)) and intervals.kept_keys == 2048
    assert intervals.label == "S=16384 top-2048 keys per query, key intervals" and intervals.kept_text == "2048/16384 keys per query"
    assert [c.head_dim for c in head_dims] == [96, 192, 256] and all(c.methods == ("flash-dma", "flex") for c in head_dims)
    assert head_dims[0] == replace(plain, head_dim=96, methods=("flash-dma", "flex")) and head_dims[0].label == "S=16384 keep=1/8 D=96"
    assert (prefill.seqlen_q, prefill.seqlen_k, prefill.kv_layout, prefill.methods) == (
        4096, 65536, "contiguous", ("flash-dma-kvcache", "flash-dma-nocache"))
    assert prefill.label == "Sq=4096 Sk=65536 keep=1/8 random contiguous"
    assert prefill_all == replace(prefill, keep=1, methods=("flash-dma-nocache",))
    assert paged_all == replace(prefill, keep=1, methods=("flash-dma-kvcache",), kv_layout="paged")
    assert short == replace(plain, seqlen_q=4096, seqlen_k=4096, modes=("fwd",)) and short.label == "S=4096 keep=1/8"
    assert build_cases("forms", quick=True) == [plain, keep_all, softcap, deterministic, intervals, prefill, prefill_all, paged_all]
