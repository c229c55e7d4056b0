"""Fake result rows for the report and target tests, and a set of rows that meets every target."""

from __future__ import annotations

from dataclasses import replace

from flash_dma.benchmark.results import Result
from flash_dma.benchmark.suites import (
    LLM_SHAPE,
    SEED_SHAPE,
    Case,
    doge_cases,
    forms_cases,
    kvcache_cases,
    layer_cases,
    pqtoken_cases,
    seedtable_cases,
    topkfit_cases,
    topk_cases,
    varlen_cases,
)

MODES_OF_KIND = {"decode": ("fwd",), "generate": ("fwd",), "train": ("fwdbwd",)}


def case(suite: str, kind: str, seqlen_k: int, keep: float = 1.0, methods=("flash-dma",), bias: str = "key",
         mask: str = "block", cache: str | None = None) -> Case:
    shape = SEED_SHAPE if suite in ("seed", "host") else LLM_SHAPE
    seqlen_q = 1 if kind == "decode" else seqlen_k
    modes = MODES_OF_KIND.get(kind, ("fwd", "fwdbwd"))
    window = 2048 if kind == "window" or mask == "token" else None
    return Case(suite, kind, **shape, seqlen_q=seqlen_q, seqlen_k=seqlen_k, keep=keep, methods=methods,
                modes=modes, bias=bias, window=window, mask=mask, cache=cache)


def row(case: Case, method: str, mode: str, ms: float = 1.0, **numbers) -> Result:
    numbers = {"tflops": 100.0, "peak_gib": 1.0, "setup_s": 0.5, "active_pairs": 1000, **numbers}
    return Result(case, method, mode, ms=ms, **numbers)


def skipped(case: Case, method: str, mode: str, note: str) -> Result:
    return Result(case, method, mode, status="skipped", note=note)


def passing_results() -> list[Result]:
    """Rows for every target, each comfortably inside its limit."""
    rows = []
    for s in (4096, 8192, 16384, 32768, 131072):
        sparse = case("llm", "prefill", s, 1 / 8)
        rows += [
            row(sparse, "flash-dma", "fwd", ms=0.5, peak_gib=0.5),
            row(sparse, "flash-dma-percall", "fwd", ms=0.52),
            row(sparse, "flex", "fwd", ms=1.0),
            row(sparse, "flash-dma", "fwdbwd", ms=1.0, peak_gib=0.5),
            row(sparse, "flash-dma-percall", "fwdbwd", ms=1.05),
            row(sparse, "flex", "fwdbwd", ms=4.0, peak_gib=1.5),
        ]
    for s in (16384, 32768):
        dense = case("llm", "prefill", s, 1.0)
        rows += [
            row(dense, "flash-dma", "fwd", ms=1.6, tflops=600.0),
            row(dense, "flash-dma", "fwdbwd", ms=6.5, tflops=540.0),
            row(dense, "sdpa-flash", "fwd", ms=3.3, tflops=332.0, peak_gib=0.5),
            row(dense, "sdpa-flash", "fwdbwd", ms=12.3, tflops=330.0, peak_gib=1.0),
            row(dense, "sdpa-cudnn", "fwd", ms=1.72, tflops=550.0),
            row(dense, "sdpa-cudnn", "fwdbwd", ms=6.8, tflops=520.0),
        ]
    rows.append(row(case("llm", "prefill", 16384, 1 / 32), "flash-dma", "fwdbwd", ms=0.4))
    topkq = case("topkq", "prefill", 16384, 1 / 8, mask="query-block")
    rows += [row(topkq, "flex", "fwdbwd", ms=4.0)]
    rows += [row(topkq, method, mode, ms=ms) for mode in ("fwd", "fwdbwd")
             for method, ms in (("flash-dma", 1.0), ("flash-dma-bits", 1.05))]
    token = case("token", "prefill", 16384, 1 / 8, mask="token")
    bias_only = case("token", "prefill", 16384, mask="none")
    for mode, ours, flex, unmasked in (("fwd", 0.1, 1.0, 1.0), ("fwdbwd", 0.3, 1.0, 2.0)):
        rows += [row(token, "flash-dma", mode, ms=ours), row(token, "flex", mode, ms=flex),
                 row(bias_only, "flash-dma", mode, ms=unmasked)]
    for s in (4096, 8192, 16384):
        step = case("llama", "train", s, methods=("llama-flash-dma", "llama-sdpa"), mask="none", bias="none")
        rows += [row(step, "llama-flash-dma", "fwdbwd", ms=50.0, tflops=None),
                 row(step, "llama-sdpa", "fwdbwd", ms=60.0, tflops=None)]
    rows += [
        row(case("seed", "decode", 524288, 1.0), "flash-dma", "fwd", ms=0.05, gbps=2800.0),
        row(case("seed", "decode", 524288, 1 / 8), "flash-dma", "fwd", ms=0.01, gbps=1300.0),
    ]
    for s in (256, 512, 1024, 2048, 4096, 8192, 16384):
        prefill = case("seed", "prefill", s, min(1.0, 2048 / s))
        rows += [row(prefill, method, mode, ms=ms) for method, ms in (("flash-dma", 1.0), ("sdpa-additive", 2.0),
                                                                      ("flex", 2.0)) for mode in ("fwd", "fwdbwd")]
    no_work = {"tflops": None, "peak_gib": None}  # host and first-call rows time no attention kernel
    host = case("host", "host", 128, mask="token")
    rows += [row(host, "flash-dma", "fwd", ms=0.02, cpu_ms=0.018, **no_work),
             row(host, "flash-dma", "fwdbwd", ms=0.1, cpu_ms=0.09, **no_work)]
    for cache, seconds in (("warm", 5.0), ("cold", 4.0)):
        first = case("firstcall", "prefill", 4096, 1 / 8, methods=("flash-dma-percall",), cache=cache)
        rows.append(row(first, "flash-dma-percall", "fwdbwd", ms=seconds * 1e3, setup_s=3.0, **no_work))
    generate = case("firstcall", "generate", 128, methods=("llama-flash-dma",), mask="none", bias="none",
                    cache="warm")
    rows.append(row(generate, "llama-flash-dma", "fwd", ms=3000.0, setup_s=6.0, **no_work))
    for seedtable in seedtable_cases():
        for mode, ours, unmasked in (("fwd", 0.8, 0.9), ("fwdbwd", 3.0, 3.5)):
            rows += [row(seedtable, "flash-dma", mode, ms=ours), row(seedtable, "flash-dma-nomask", mode, ms=unmasked),
                     row(seedtable, "flash-dma-v1", mode, ms=ours * 1.02)]
        if "pack-dense" in seedtable.methods:
            rows.append(row(seedtable, "pack-dense", "fwd", ms=0.4))
    for fit in topkfit_cases():
        if "flash-dma-topk" in fit.methods and "flash-dma-topk-indices" in fit.methods:
            for mode in fit.modes:
                rows += [row(fit, method, mode, ms=ms) for method, ms in
                         (("flash-dma-topk", 1.0), ("flash-dma-topk-indices", 1.0), ("flash-dma-topk-packed", 2.0))]
    (pqtoken,) = pqtoken_cases()
    for mode, ours, unmasked, flex in (("fwd", 1.0, 1.0, 4.0), ("fwdbwd", 4.0, 4.0, 16.0)):
        rows += [row(pqtoken, method, mode, ms=ms) for method, ms in (("flash-dma", ours), ("flash-dma-nomask", unmasked), ("flex", flex))]
    topk, topk_overlap, topk_long, _, topk_wide = topk_cases()
    rows += [row(topk, "flash-dma-topk", "fwdbwd", ms=2.0), row(topk, "flash-dma", "fwdbwd", ms=5.0)]
    # Overlapping selections: no target of their own, and not the random rows' (a slower row here).
    rows += [row(topk_overlap, "flash-dma-topk", "fwdbwd", ms=9.0), row(topk_overlap, "flash-dma", "fwdbwd", ms=5.0)]
    rows += [row(topk_long, "flash-dma-topk", "fwdbwd", ms=10.0), row(topk_long, "flash-dma-nomask", "fwdbwd", ms=100.0)]
    # 1e12 kept pairs at D=128: 512 PFLOP forward, 1280 more in the backward (1280 ms: 1000 TFLOP/s).
    rows += [row(topk_wide, "flash-dma-topk", "fwd", ms=1000.0, tflops=512.0, active_pairs=10**12),
             row(topk_wide, "flash-dma-topk", "fwdbwd", ms=2280.0, tflops=786.0, active_pairs=10**12)]
    for step in doge_cases():
        rows += [row(step, "doge-flash-dma", "fwdbwd", ms=40.0, tflops=None, peak_gib=2.0),
                 row(step, "doge-sdpa", "fwdbwd", ms=100.0, tflops=None, peak_gib=5.0)]
    train, select = layer_cases()
    rows += [row(train, "layer-flash-dma", "fwdbwd", ms=20.0, tflops=None),
             row(train, "layer-dense-bias", "fwdbwd", ms=50.0, tflops=None),
             row(select, "layer-select", "fwd", ms=0.2, tflops=None)]
    (varlen,) = varlen_cases()
    for mode, ours, flex, padded in (("fwd", 0.5, 0.8, 0.7), ("fwdbwd", 1.5, 4.0, 2.5)):
        rows += [row(varlen, "flash-dma-varlen", mode, ms=ours), row(varlen, "flex", mode, ms=flex),
                 row(varlen, "flash-dma-padded", mode, ms=padded)]
    for kv in kvcache_cases():
        if kv.batch == 8:  # 3.0 TB/s contiguous; paged 4% slower
            ms, tbps = (0.05, 3.0) if kv.kv_layout == "contiguous" else (0.052, 2.9)
        else:
            ms, tbps = 0.01, 1.75
        rows.append(row(kv, "flash-dma-kvcache", "fwd", ms=ms, gbps=tbps * 1e3))
    plain, keep_all, softcap, deterministic, intervals, prefill, prefill_all, paged_all, short, *head_dims = forms_cases()
    rows += [row(prefill, "flash-dma-kvcache", "fwd", ms=0.5), row(prefill, "flash-dma-nocache", "fwd", ms=0.48)]
    rows += [row(prefill_all, "flash-dma-nocache", "fwd", ms=4.0), row(paged_all, "flash-dma-kvcache", "fwd", ms=4.1)]
    for fp8_case, bf16_ms in ((plain, 0.3), (keep_all, 1.5)):  # FP8 at 1.6x the bfloat16 speed
        rows.append(row(fp8_case, "flash-dma-fp8", "fwd", ms=bf16_ms / 1.6))
    rows.append(row(keep_all, "flash-dma", "fwd", ms=1.5))
    rows += [row(short, "flash-dma", "fwd", ms=0.1), row(short, "flash-dma-fp8", "fwd", ms=0.08)]  # FP8 at 0.8x at 4K
    for mode, plain_ms in (("fwd", 0.3), ("fwdbwd", 1.4)):
        rows += [row(plain, "flash-dma", mode, ms=plain_ms), row(softcap, "flash-dma", mode, ms=plain_ms * 1.1),
                 row(intervals, "flash-dma", mode, ms=plain_ms * 1.3)]
        for other in head_dims:  # 0.55x / 0.35x of Flex
            rows += [row(other, "flash-dma", mode, ms=plain_ms * 2), row(other, "flex", mode, ms=plain_ms * 2 / (0.55 if mode == "fwd" else 0.35))]
    rows.append(row(deterministic, "flash-dma", "fwdbwd", ms=1.4 * 1.12))
    return rows


def with_ms(results: list[Result], method: str, mode: str, ms: float, **case_fields) -> list[Result]:
    """``results`` with the time of the matching rows replaced."""
    def matches(r: Result) -> bool:
        return r.method == method and r.mode == mode and all(getattr(r.case, k) == v for k, v in case_fields.items())

    return [replace(r, ms=ms) if matches(r) else r for r in results]
