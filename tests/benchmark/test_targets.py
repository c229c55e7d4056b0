from dataclasses import replace

import pytest

from flash_dma.benchmark.targets import TARGETS, Target, evaluate, format_amount
from tests.benchmark.fakes import case, passing_results, row, skipped, with_ms

SEED_NAME = "seed prefill fwd+bwd S=1K..16K: flash-dma / sdpa-additive time (worst S)"
HOST_NAME = "host S=128 mask+bias fwd: flash-dma host time per call"


def _by_name(checks):
    return {c.name: c for c in checks}


def test_every_target_passes_on_good_numbers():
    checks = evaluate(passing_results())
    assert len(checks) == len(TARGETS) == 104
    assert len({c.name for c in checks}) == 104
    assert [c.status for c in checks] == ["PASS"] * 104, [c for c in checks if c.status != "PASS"]
    values = _by_name(checks)
    assert values["llm keep 1/8 S=16K fwd: flash-dma / flex time"].value == 0.5
    assert values["llm keep 1/8 S=128K fwd+bwd: flash-dma / flex time"].value == 0.25
    assert values["llm keep 1 S=16K fwd: flash-dma / sdpa-cudnn TFLOP/s"].value == 600 / 550
    assert values["llm keep 1 S=32K fwd+bwd: flash-dma / sdpa-cudnn TFLOP/s"].value == 540 / 520
    assert values["topkq S=16K fwd+bwd: flash-dma / flex time"].value == 0.25
    assert values["topk S=32K fwd+bwd: flash-dma-topk / flash-dma time"].value == 2.0 / 5.0
    assert values["topk S=128K fwd+bwd: flash-dma-topk / flash-dma-nomask (dense causal) time"].value == 0.1
    assert values["token S=16K fwd+bwd: flash-dma top-2048 keys / bias only time"].value == 0.3 / 2.0
    assert values["llama S=16K train step: llama-flash-dma / llama-sdpa time"].value == 50 / 60
    assert values["seed decode Sk=512K keep 1: flash-dma TB/s over bytes read"].value == 2.8
    assert values["seed decode Sk=512K keep 1/8: flash-dma time"].value == pytest.approx(10.0)
    assert values["seed decode Sk=512K: flash-dma time keep 1/8 / keep 1"].value == 0.01 / 0.05
    assert values["llm keep 1/32 S=16K fwd+bwd: flash-dma time"].value == 0.4
    # FlashAttention-3 at 32K: out, dQ 128 MiB each, dK, dV 32 MiB each, LSE 2 MiB, its fp32 scratch
    # (the LSE in log2 units and dO.O 2 MiB each, dQ 256 MiB, dK and dV 64 MiB each): 710 MiB.
    assert values["llm S=32K keep 1/8 fwd+bwd: flash-dma / FlashAttention-3 peak memory"].value == 0.5 / (710 / 1024)
    assert values["llm keep 1/8 fwd S>=4K: flash-dma-percall / flash-dma time (worst S)"].value == 0.52 / 0.5
    assert values["forms S=16K keep 1/8 fwd+bwd: flash-dma softcap=30 / plain time"].value == pytest.approx(1.1)
    assert values["forms S=16K keep 1/8 fwd+bwd: flash-dma deterministic / plain time"].value == pytest.approx(1.12)
    assert values["forms S=16K keep 1 fwd: flash-dma-fp8 / flash-dma time"].value == pytest.approx(1 / 1.6)
    assert values["forms S=16K keep 1/8 fwd: flash-dma-fp8 / flash-dma time"].value == pytest.approx(1 / 1.6)
    assert values["forms S=4K keep 1/8 fwd: flash-dma-fp8 / flash-dma time"].value == pytest.approx(0.8)
    assert values["llama S=8K train step: llama-flash-dma / llama-sdpa time"].value == 50 / 60


def test_absolute_targets_keep_their_unit():
    checks = _by_name(evaluate(passing_results()))
    host = checks[HOST_NAME]
    assert (host.target, host.unit, host.value) == ("<= 40 µs", "µs", pytest.approx(20.0))
    assert host.detail == "wall 20 µs, CPU 18 µs per call"
    warm = checks["new process, warm cache: first fwd+bwd, llm S=4K keep 1/8"]
    assert (warm.target, warm.value, warm.status) == ("<= 10 s", 5.0, "PASS")
    assert warm.detail.startswith("flash-dma-percall; 3 s in the new process before it")
    assert checks["new process, cold caches: first fwd+bwd, llm S=4K keep 1/8"].target == "<= 5 s"
    assert checks["llm keep 1/8 S=16K fwd: flash-dma / flex time"].target == "<= 0.50x"

    slow = with_ms(passing_results(), "flash-dma", "fwd", 0.041, suite="host")
    assert _by_name(evaluate(slow))[HOST_NAME].status == "MISS"


def test_topk_targets_read_tflops_on_the_kept_pairs_and_the_backward_alone():
    checks = _by_name(evaluate(passing_results()))
    forward = checks["topk H=64 S=128K fwd: flash-dma-topk TFLOP/s on kept pairs"]
    backward = checks["topk H=64 S=128K bwd: flash-dma-topk TFLOP/s on kept pairs"]
    assert (forward.target, forward.value, forward.status) == (">= 400 TFLOP/s", 512.0, "PASS")
    assert (backward.target, backward.status) == (">= 150 TFLOP/s", "PASS")
    assert backward.value == pytest.approx(1000.0) and backward.detail == "1280 ms (2280 fwd+bwd less 1000 fwd)"
    slow = with_ms(passing_results(), "flash-dma-topk", "fwdbwd", 10000.0, suite="topk", heads=64)
    assert _by_name(evaluate(slow))["topk H=64 S=128K bwd: flash-dma-topk TFLOP/s on kept pairs"].status == "MISS"


def test_a_target_in_any_unit():
    target = Target("tokens", ">=", 2.5, lambda results: (3.0, "three"), unit="tokens/s")
    (check,) = evaluate([], (target,))
    assert (check.target, check.status, check.unit) == (">= 2.5 tokens/s", "PASS", "tokens/s")
    assert format_amount(0.456, "x") == "0.46x" and format_amount(150.0, "µs") == "150 µs"


def test_a_slow_row_is_a_miss():
    results = with_ms(passing_results(), "flex", "fwd", 0.55, suite="llm", seqlen_k=32768, keep=1 / 8)
    check = _by_name(evaluate(results))["llm keep 1/8 S=32K fwd: flash-dma / flex time"]
    assert check.status == "MISS" and check.value == 0.5 / 0.55
    assert check.detail == "flash-dma 0.5 ms, flex 0.55 ms"


def test_a_ratios_sides_name_the_sm_clocks_they_were_timed_at():
    case_fields = dict(suite="llm", seqlen_k=32768, keep=1 / 8)

    def clocked(r):
        if r.mode == "fwd" and all(getattr(r.case, k) == v for k, v in case_fields.items()):
            return replace(r, sm_clock={"flash-dma": "1800 MHz (power cap)", "flex": "1980 MHz (none)"}.get(r.method, ""))
        return r

    check = _by_name(evaluate([clocked(r) for r in passing_results()]))["llm keep 1/8 S=32K fwd: flash-dma / flex time"]
    assert check.detail == "flash-dma 0.5 ms at 1800 MHz (power cap), flex 1 ms at 1980 MHz (none)"


def test_worst_length_checks_report_the_worst_length():
    slow = with_ms(passing_results(), "flash-dma", "fwdbwd", 3.0, suite="seed", seqlen_k=2048)
    check = _by_name(evaluate(slow))[SEED_NAME]
    assert check.status == "MISS" and check.value == 1.5 and check.detail.startswith("worst at S=2048")
    tie = with_ms(passing_results(), "flash-dma", "fwdbwd", 2.0, suite="seed", seqlen_k=1024)
    assert _by_name(evaluate(tie))[SEED_NAME].status == "PASS"  # "no slower than": equal time passes
    # S=256 and 512 are outside the checked range.
    short = with_ms(passing_results(), "flash-dma", "fwdbwd", 5.0, suite="seed", seqlen_k=512)
    assert _by_name(evaluate(short))[SEED_NAME].status == "PASS"

    percall = with_ms(passing_results(), "flash-dma-percall", "fwd", 0.6, suite="llm", seqlen_k=131072)
    check = _by_name(evaluate(percall))["llm keep 1/8 fwd S>=4K: flash-dma-percall / flash-dma time (worst S)"]
    assert check.status == "MISS" and check.detail.startswith("worst at S=131072")


def test_skipped_rows_give_no_data_with_the_reason():
    results = [r for r in passing_results() if not (r.method == "flex" and r.case.seqlen_k == 16384)]
    results.append(skipped(case("llm", "prefill", 16384, 1 / 8), "flex", "fwdbwd", "OutOfMemoryError: boom"))
    checks = _by_name(evaluate(results))
    bwd = checks["llm keep 1/8 S=16K fwd+bwd: flash-dma / flex time"]
    assert bwd.status == "NO DATA" and bwd.value is None and bwd.detail.endswith("OutOfMemoryError: boom")
    assert checks["llm keep 1/8 S=32K fwd: flash-dma / flex time"].status == "PASS"


def test_targets_whose_rows_were_not_run_are_left_out():
    # The forward Flex row at 16K was never run (--methods, --lengths, or another suite): no target about it.
    dropped = case("llm", "prefill", 16384, 1 / 8)
    results = [r for r in passing_results() if not (r.method == "flex" and r.case == dropped and r.mode == "fwd")]
    names = [c.name for c in evaluate(results)]
    assert "llm keep 1/8 S=16K fwd: flash-dma / flex time" not in names
    assert "llm keep 1/8 S=16K fwd+bwd: flash-dma / flex time" in names and len(names) == len(TARGETS) - 1
    # One suite alone (--suite seed): only its targets, and every one of them with data.
    seed_only = [r for r in passing_results() if r.case.suite == "seed"]
    checks = evaluate(seed_only)
    assert [c.name for c in checks] == [t.name for t in TARGETS if t.name.startswith("seed ")]
    assert len(checks) == 9 and {c.status for c in checks} == {"PASS"}
    # A worst-over-S target needs every S: a run that left one out does not report it.
    no_prefill = [r for r in passing_results() if not (r.case.kind == "prefill" and r.case.seqlen_k == 8192)]
    assert SEED_NAME not in _by_name(evaluate(no_prefill))
    assert evaluate([]) == []


def test_first_call_rows_are_told_apart_by_cache():
    cold_only = [r for r in passing_results() if r.case.cache != "warm"]
    cold_only.append(skipped(case("firstcall", "prefill", 4096, 1 / 8, methods=("flash-dma-percall",), cache="warm"),
                             "flash-dma-percall", "fwdbwd", "TimeoutError: 300 s"))
    checks = _by_name(evaluate(cold_only))
    warm = checks["new process, warm cache: first fwd+bwd, llm S=4K keep 1/8"]
    assert warm.status == "NO DATA" and "cache=warm" in warm.detail
    assert checks["new process, cold caches: first fwd+bwd, llm S=4K keep 1/8"].status == "PASS"

    slow_generate = cold_only + [
        row(case("firstcall", "generate", 128, mask="none", bias="none", cache="warm"), "llama-flash-dma", "fwd",
            ms=7000.0)
    ]
    assert _by_name(evaluate(slow_generate))["new process, warm cache: Llama first generate"].status == "MISS"


VARLEN_FLEX = "varlen 8 docs S=32K keep 1/8 fwd+bwd: flash-dma-varlen / flex time"
VARLEN_PADDED = "varlen 8 docs S=32K keep 1/8 {}: flash-dma-varlen / flash-dma-padded time"
KV_TBPS = "kvcache B=8 Sk=32K keep {} {}: flash-dma-kvcache TB/s over bytes read"
KV_PAGED = "kvcache B=8 Sk=32K keep {}: flash-dma-kvcache time paged / contiguous"
KV_LONG = "kvcache B=1 H=2 Sk=512K keep 1/8: flash-dma-kvcache time"


def test_varlen_targets():
    checks = _by_name(evaluate(passing_results()))
    flex = checks[VARLEN_FLEX]
    assert (flex.target, flex.value, flex.status) == ("<= 0.50x", 1.5 / 4.0, "PASS")
    padded = checks[VARLEN_PADDED.format("fwd+bwd")]
    assert (padded.target, padded.value, padded.status) == ("< 1.00x", 1.5 / 2.5, "PASS")
    assert padded.detail == "flash-dma-varlen 1.5 ms, flash-dma-padded 2.5 ms"
    assert checks[VARLEN_PADDED.format("fwd")].value == 0.5 / 0.7

    slow = with_ms(passing_results(), "flash-dma-varlen", "fwdbwd", 2.5, suite="varlen")
    checks = _by_name(evaluate(slow))
    assert checks[VARLEN_FLEX].status == "MISS" and checks[VARLEN_FLEX].value == 2.5 / 4.0
    assert checks[VARLEN_PADDED.format("fwd+bwd")].status == "MISS"  # as fast as padded is not faster
    assert checks[VARLEN_PADDED.format("fwd")].status == "PASS"

    no_flex = [r for r in passing_results() if not (r.case.suite == "varlen" and r.method == "flex")]
    assert VARLEN_FLEX not in _by_name(evaluate(no_flex))


def test_kvcache_targets():
    checks = _by_name(evaluate(passing_results()))
    for keep in ("1", "1/8"):
        contiguous, paged = checks[KV_TBPS.format(keep, "contiguous")], checks[KV_TBPS.format(keep, "paged")]
        assert (contiguous.target, contiguous.unit, contiguous.value) == (">= 2.8 TB/s", "TB/s", 3.0)
        assert paged.value == 2.9 and paged.detail == "52 µs, 2.9 TB/s"
        ratio = checks[KV_PAGED.format(keep)]
        assert (ratio.target, ratio.value, ratio.status) == ("<= 1.10x", pytest.approx(1.04), "PASS")
        assert ratio.detail == "paged 52 µs, contiguous 50 µs"
    long = checks[KV_LONG]
    assert (long.target, long.unit, long.value, long.status) == ("<= 12 µs", "µs", pytest.approx(10.0), "PASS")
    assert long.detail == "flash-dma-kvcache 10 µs, 1.75 TB/s"

    results = [replace(r, gbps=2000.0) if r.case.kv_layout == "paged" and r.case.keep == 1 else r
               for r in passing_results()]
    results = with_ms(results, "flash-dma-kvcache", "fwd", 0.056, kv_layout="paged", keep=1 / 8)
    results = with_ms(results, "flash-dma-kvcache", "fwd", 0.0125, seqlen_k=524288)
    checks = _by_name(evaluate(results))
    assert checks[KV_TBPS.format("1", "paged")].status == "MISS"
    assert checks[KV_TBPS.format("1", "contiguous")].status == "PASS"
    assert checks[KV_PAGED.format("1/8")].status == "MISS" and checks[KV_PAGED.format("1")].status == "PASS"
    assert checks[KV_LONG].status == "MISS"
