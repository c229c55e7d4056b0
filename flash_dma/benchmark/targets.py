"""The project's performance targets, checked against one run's rows: PASS, MISS or NO DATA.

Each target is a ratio taken within the run (absolute times drift between machines, ratios
within one process do not), compared with a limit. A target whose rows are missing or were
skipped is NO DATA, with the reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from flash_dma.benchmark.metrics import HBM_COPY_GBPS
from flash_dma.benchmark.results import Result, select
from flash_dma.benchmark.suites import SEED_PREFILL_LENGTHS, format_fraction

DECODE_LENGTH = 524288
PREFILL_CHECK_LENGTHS = tuple(s for s in SEED_PREFILL_LENGTHS if s <= 16384)
_COMPARE = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}


class _Missing(Exception):
    """A row a target needs is not in the results (or was skipped)."""


def _row(results: list[Result], method: str, mode: str, **case_fields) -> Result:
    ok = select(results, method, mode, **case_fields)
    if ok:
        return ok[0]
    tried = select(results, method, mode, ok_only=False, **case_fields)
    where = " ".join(
        f"{k}={format_fraction(v) if isinstance(v, float) else v}" for k, v in case_fields.items() if v is not None
    )
    raise _Missing(f"{method} {mode} {where}: {tried[0].note if tried else 'not run'}")


def _llm(results, method, mode, seqlen, keep=None) -> Result:
    """An llm-suite per-key-bias row; ``keep=None`` for dense methods, which run under one keep only."""
    return _row(results, method, mode, suite="llm", kind="prefill", bias="key", seqlen_k=seqlen, keep=keep)


def _time_ratio(seqlen: int, keep: float, mode: str, method: str, baseline: str):
    def measure(results):
        a, b = _llm(results, method, mode, seqlen, keep), _llm(results, baseline, mode, seqlen, keep)
        return a.ms / b.ms, f"{method} {a.ms:.3g} ms, {baseline} {b.ms:.3g} ms"

    return measure


def _tflops_ratio(seqlen: int, keep: float, mode: str, method: str, baseline: str):
    def measure(results):
        a, b = _llm(results, method, mode, seqlen, keep), _llm(results, baseline, mode, seqlen)
        return a.tflops / b.tflops, f"{method} {a.tflops:.0f} TFLOP/s, {baseline} {b.tflops:.0f} TFLOP/s"

    return measure


def _peak_ratio(seqlen: int, keep: float, mode: str, method: str, baseline: str, baseline_keep: float | None):
    def measure(results):
        a = _llm(results, method, mode, seqlen, keep)
        b = _llm(results, baseline, mode, seqlen, baseline_keep)
        return a.peak_gib / b.peak_gib, f"{method} {a.peak_gib:.3g} GiB, {baseline} {b.peak_gib:.3g} GiB"

    return measure


def _decode(results, keep: float) -> Result:
    return _row(results, "flash-dma", "fwd", suite="seed", kind="decode", seqlen_k=DECODE_LENGTH, keep=keep)


def _decode_bandwidth(results):
    row = _decode(results, 1.0)
    return row.gbps / HBM_COPY_GBPS, f"{row.gbps:.0f} GB/s of {HBM_COPY_GBPS:.0f}"


def _decode_sparse_speedup(results):
    dense, sparse = _decode(results, 1.0), _decode(results, 1 / 8)
    return sparse.ms / dense.ms, f"keep 1/8 {sparse.ms * 1e3:.1f} us, keep 1 {dense.ms * 1e3:.1f} us"


def _prefill_worst_ratio(results):
    """Largest flash-dma / sdpa-additive fwd+bwd time over the seed prefill lengths up to 16K."""
    ratios = {}
    for s in PREFILL_CHECK_LENGTHS:
        ours = _row(results, "flash-dma", "fwdbwd", suite="seed", kind="prefill", seqlen_k=s)
        theirs = _row(results, "sdpa-additive", "fwdbwd", suite="seed", kind="prefill", seqlen_k=s)
        ratios[s] = ours.ms / theirs.ms
    worst = max(ratios, key=ratios.get)
    return ratios[worst], f"worst at S={worst}; all: " + ", ".join(f"{s}: {r:.2f}" for s, r in ratios.items())


@dataclass(frozen=True)
class Target:
    """``measure(results) -> (value, detail)`` must satisfy ``value <op> limit``."""

    name: str
    op: str
    limit: float
    measure: Callable[[list[Result]], tuple[float, str]]


@dataclass(frozen=True)
class Check:
    name: str
    target: str  # e.g. "<= 0.80x"
    value: float | None
    status: str  # "PASS" | "MISS" | "NO DATA"
    detail: str


TARGETS = (
    *(
        Target(f"llm keep 1/8 S={s // 1024}K {label}: flash-dma / flex time", "<=", limit,
               _time_ratio(s, 1 / 8, mode, "flash-dma", "flex"))
        for mode, label, limit in (("fwd", "fwd", 0.8), ("fwdbwd", "fwd+bwd", 0.5))
        for s in (16384, 32768)
    ),
    Target("llm keep 1 S=16K fwd: flash-dma / sdpa-flash TFLOP/s", ">=", 1.0,
           _tflops_ratio(16384, 1.0, "fwd", "flash-dma", "sdpa-flash")),
    Target("llm keep 1 S=16K fwd+bwd: flash-dma / sdpa-flash TFLOP/s", ">=", 0.8,
           _tflops_ratio(16384, 1.0, "fwdbwd", "flash-dma", "sdpa-flash")),
    Target("seed decode Sk=512K keep 1: flash-dma GB/s / 3.0 TB/s", ">=", 0.6, _decode_bandwidth),
    Target("seed decode Sk=512K: flash-dma time keep 1/8 / keep 1", "<=", 0.3, _decode_sparse_speedup),
    Target("seed prefill fwd+bwd S=256..16K: flash-dma / sdpa-additive time (worst S)", "<", 1.0,
           _prefill_worst_ratio),
    Target("llm S=32K keep 1/8 fwd: flash-dma / sdpa-flash peak memory", "<=", 1.2,
           _peak_ratio(32768, 1 / 8, "fwd", "flash-dma", "sdpa-flash", None)),
    Target("llm S=32K keep 1/8 fwd+bwd: flash-dma / sdpa-flash peak memory", "<=", 1.2,
           _peak_ratio(32768, 1 / 8, "fwdbwd", "flash-dma", "sdpa-flash", None)),
    Target("llm S=32K keep 1/8 fwd+bwd: flash-dma / flex peak memory", "<=", 1.0,
           _peak_ratio(32768, 1 / 8, "fwdbwd", "flash-dma", "flex", 1 / 8)),
)


def evaluate(results: list[Result], targets: tuple[Target, ...] = TARGETS) -> list[Check]:
    checks = []
    for target in targets:
        wanted = f"{target.op} {target.limit:.2f}x"
        try:
            value, detail = target.measure(results)
        except _Missing as missing:
            checks.append(Check(target.name, wanted, None, "NO DATA", str(missing)))
            continue
        status = "PASS" if _COMPARE[target.op](value, target.limit) else "MISS"
        checks.append(Check(target.name, wanted, value, status, detail))
    return checks
