"""Fake result rows for the report and target tests, and a set of rows that meets every target."""

from __future__ import annotations

from dataclasses import replace

from flash_dma.benchmark.results import Result
from flash_dma.benchmark.suites import LLM_SHAPE, SEED_SHAPE, Case


def case(suite: str, kind: str, seqlen_k: int, keep: float = 1.0, methods=("flash-dma",), bias: str = "key") -> Case:
    shape = SEED_SHAPE if suite == "seed" else LLM_SHAPE
    seqlen_q = 1 if kind == "decode" else seqlen_k
    modes = ("fwd",) if kind == "decode" else ("fwd", "fwdbwd")
    window = 2048 if kind == "window" else None
    return Case(suite, kind, **shape, seqlen_q=seqlen_q, seqlen_k=seqlen_k, keep=keep, methods=methods,
                modes=modes, bias=bias, window=window)


def row(case: Case, method: str, mode: str, ms: float = 1.0, **numbers) -> Result:
    numbers = {"tflops": 100.0, "peak_gib": 1.0, "setup_s": 0.5, "active_pairs": 1000, **numbers}
    return Result(case, method, mode, ms=ms, **numbers)


def skipped(case: Case, method: str, mode: str, note: str) -> Result:
    return Result(case, method, mode, status="skipped", note=note)


def passing_results() -> list[Result]:
    """Rows for every target, each comfortably inside its limit."""
    rows = []
    for s in (16384, 32768):
        sparse = case("llm", "prefill", s, 1 / 8)
        dense = case("llm", "prefill", s, 1.0)
        rows += [
            row(sparse, "flash-dma", "fwd", ms=0.5, peak_gib=0.5),
            row(sparse, "flex", "fwd", ms=1.0),
            row(sparse, "flash-dma", "fwdbwd", ms=1.0, peak_gib=1.0),
            row(sparse, "flex", "fwdbwd", ms=4.0, peak_gib=1.1),
            row(dense, "flash-dma", "fwd", ms=3.0, tflops=400.0),
            row(dense, "flash-dma", "fwdbwd", ms=12.0, tflops=300.0),
            row(dense, "sdpa-flash", "fwd", ms=3.3, tflops=332.0, peak_gib=0.5),
            row(dense, "sdpa-flash", "fwdbwd", ms=12.3, tflops=330.0, peak_gib=1.0),
        ]
    rows += [
        row(case("seed", "decode", 524288, 1.0), "flash-dma", "fwd", ms=0.1, gbps=2000.0),
        row(case("seed", "decode", 524288, 1 / 8), "flash-dma", "fwd", ms=0.02, gbps=1300.0),
    ]
    for s in (256, 512, 1024, 2048, 4096, 8192, 16384):
        prefill = case("seed", "prefill", s, min(1.0, 2048 / s))
        rows += [row(prefill, "flash-dma", "fwdbwd", ms=1.0), row(prefill, "sdpa-additive", "fwdbwd", ms=2.0)]
    return rows


def with_ms(results: list[Result], method: str, mode: str, ms: float, **case_fields) -> list[Result]:
    """``results`` with the time of the matching rows replaced."""
    def matches(r: Result) -> bool:
        return r.method == method and r.mode == mode and all(getattr(r.case, k) == v for k, v in case_fields.items())

    return [replace(r, ms=ms) if matches(r) else r for r in results]
