from flash_dma.benchmark.targets import TARGETS, evaluate
from tests.benchmark.fakes import case, passing_results, skipped, with_ms


def _by_name(checks):
    return {c.name: c for c in checks}


def test_every_target_passes_on_good_numbers():
    checks = evaluate(passing_results())
    assert len(checks) == len(TARGETS) == 12
    assert [c.status for c in checks] == ["PASS"] * 12, [c for c in checks if c.status != "PASS"]
    values = _by_name(checks)
    assert values["llm keep 1/8 S=16K fwd: flash-dma / flex time"].value == 0.5
    assert values["llm keep 1 S=16K fwd: flash-dma / sdpa-flash TFLOP/s"].value == 400 / 332
    assert values["seed decode Sk=512K keep 1: flash-dma GB/s / 3.0 TB/s"].value == 2000 / 3000
    assert values["seed decode Sk=512K: flash-dma time keep 1/8 / keep 1"].value == 0.02 / 0.1
    assert values["llm S=32K keep 1/8 fwd+bwd: flash-dma / flex peak memory"].value == 1.0 / 1.1


def test_a_slow_row_is_a_miss():
    results = with_ms(passing_results(), "flex", "fwd", 0.55, suite="llm", seqlen_k=32768, keep=1 / 8)
    check = _by_name(evaluate(results))["llm keep 1/8 S=32K fwd: flash-dma / flex time"]
    assert check.status == "MISS" and check.value == 0.5 / 0.55
    assert check.detail == "flash-dma 0.5 ms, flex 0.55 ms"


def test_prefill_check_reports_the_worst_length_and_is_strict():
    name = "seed prefill fwd+bwd S=256..16K: flash-dma / sdpa-additive time (worst S)"
    slow = with_ms(passing_results(), "flash-dma", "fwdbwd", 3.0, suite="seed", seqlen_k=512)
    check = _by_name(evaluate(slow))[name]
    assert check.status == "MISS" and check.value == 1.5 and check.detail.startswith("worst at S=512")
    tie = with_ms(passing_results(), "flash-dma", "fwdbwd", 2.0, suite="seed", seqlen_k=256)
    assert _by_name(evaluate(tie))[name].status == "MISS"  # "faster than": equal time misses


def test_missing_or_skipped_rows_give_no_data_with_the_reason():
    results = [r for r in passing_results() if not (r.method == "flex" and r.case.seqlen_k == 16384)]
    results.append(skipped(case("llm", "prefill", 16384, 1 / 8), "flex", "fwdbwd", "OutOfMemoryError: boom"))
    checks = _by_name(evaluate(results))
    fwd = checks["llm keep 1/8 S=16K fwd: flash-dma / flex time"]
    assert fwd.status == "NO DATA" and fwd.value is None and fwd.detail.endswith("not run")
    bwd = checks["llm keep 1/8 S=16K fwd+bwd: flash-dma / flex time"]
    assert bwd.status == "NO DATA" and bwd.detail.endswith("OutOfMemoryError: boom")
    assert checks["llm keep 1/8 S=32K fwd: flash-dma / flex time"].status == "PASS"

    no_prefill = [r for r in passing_results() if not (r.case.kind == "prefill" and r.case.seqlen_k == 8192)]
    name = "seed prefill fwd+bwd S=256..16K: flash-dma / sdpa-additive time (worst S)"
    assert _by_name(evaluate(no_prefill))[name].status == "NO DATA"
    assert {c.status for c in evaluate([])} == {"NO DATA"}
