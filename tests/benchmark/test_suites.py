import pytest

from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.runner import count_rows
from flash_dma.benchmark.suites import DENSE_METHODS, build_cases, llm_cases, seed_cases


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
    ]
    for c in cases:
        assert (c.batch, c.heads, c.kv_heads, c.head_dim) == (1, 16, 4, 128)
        assert c.seqlen_q == c.seqlen_k
    for c in per_key:
        assert "flash-dma-percall" in c.methods
        assert all(m in c.methods for m in DENSE_METHODS) == (c.keep == 1.0)
    (full,) = [c for c in cases if c.bias == "full"]
    assert (full.seqlen_k, full.keep, full.modes) == (4096, 1 / 8, ("fwd", "fwdbwd"))


def test_every_method_named_by_a_suite_exists():
    assert {m for c in build_cases() for m in c.methods} == set(METHODS)


def test_quick_is_a_small_subset_of_the_full_run():
    full, quick = build_cases(), build_cases(quick=True)
    assert set(quick) <= set(full)
    assert {c.suite for c in quick} == {"seed", "llm"}
    assert count_rows(quick) <= 40 < count_rows(full)


def test_filters_on_modes_and_methods():
    backward_only = build_cases(modes=("fwdbwd",))
    assert backward_only and all(c.modes == ("fwdbwd",) and not c.is_decode for c in backward_only)
    flex_only = build_cases("llm", methods=("flex",))
    assert len(flex_only) == 17 and all(c.methods == ("flex",) for c in flex_only)
    dense_only = build_cases("seed", methods=("sdpa-flash",))
    assert all(c.keep == 1.0 or c.kind == "prefill" for c in dense_only)
    with pytest.raises(ValueError, match="suite"):
        build_cases("gpt")


def test_labels():
    seed = seed_cases()
    assert seed[4].label == "S=4096 keep=1/2"
    assert _by_kind(seed, "decode")[1].label == "Sk=256 keep=1/8"
    assert _by_kind(seed, "window")[0].label == "S=32768 W=32"
    assert llm_cases()[-1].label == "S=4096 keep=1/8 bias[1,16,Sq,Sk]"
