"""results.png: the headline comparisons, one panel each.

1. llm suite, keep 1/8, forward time vs S; 2. the same for forward + backward (dense
ceilings dashed); 3. seed decode bandwidth vs Sk (keep 1 solid, keep 1/8 dotted) against the
copy ceiling; 4. the seed window sweep, time vs window.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.metrics import HBM_COPY_GBPS
from flash_dma.benchmark.results import Result, select
from flash_dma.benchmark.suites import SEED_SWEEP_LENGTH, format_fraction

PALETTE = ("tab:red", "tab:orange", "tab:blue", "tab:purple", "tab:pink", "tab:gray", "tab:green", "tab:brown",
           "tab:olive", "tab:cyan", "black", "gold", "darkred")
COLORS = dict(zip(METHODS, PALETTE, strict=True))
LLM_PLOT_KEEP = 1 / 8


def _line(ax, rows: list[Result], x: str, y: str, method: str, label: str, style: str = "-") -> None:
    if rows:
        xs = [getattr(r.case, x) for r in rows]
        ax.plot(xs, [getattr(r, y) for r in rows], style, marker="o", ms=3, color=COLORS[method], label=label)


def _finish(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _llm_time(ax, results: list[Result], mode: str, title: str) -> None:
    shape = ""
    for name, method in METHODS.items():
        # Dense methods ignore the mask and run under keep 1 only.
        keep = LLM_PLOT_KEEP if method.applies_mask else None
        rows = select(results, name, mode, suite="llm", kind="prefill", bias="key", keep=keep)
        _line(ax, rows, "seqlen_k", "ms", name, name, "-" if method.applies_mask else "--")
        shape = shape or (rows[0].case.shape_text() if rows else "")
    _finish(ax, f"llm {shape}, keep {format_fraction(LLM_PLOT_KEEP)}: {title}", "S", "ms")


def _decode_bandwidth(ax, results: list[Result]) -> None:
    for name in METHODS:
        for keep, style in ((1.0, "-"), (1 / 8, ":")):
            rows = select(results, name, "fwd", suite="seed", kind="decode", keep=keep)
            _line(ax, rows, "seqlen_k", "gbps", name, f"{name} keep {format_fraction(keep)}", style)
    if ax.lines:
        ax.axhline(HBM_COPY_GBPS, color="black", lw=0.8, ls="--", label="copy ceiling")
    _finish(ax, "seed decode (Sq=1, CUDA graphs): K/V bandwidth", "Sk", "GB/s")


def _window_sweep(ax, results: list[Result]) -> None:
    for name in METHODS:
        for mode, style in (("fwd", "-"), ("fwdbwd", "--")):
            rows = select(results, name, mode, suite="seed", kind="window")
            _line(ax, rows, "window", "ms", name, f"{name} {mode}", style)
    _finish(ax, f"seed window sweep at S={SEED_SWEEP_LENGTH}", "window W (keys kept per row)", "ms")


def plot_results(path: Path, results: list[Result]) -> None:
    figure = Figure(figsize=(13, 9), layout="constrained")
    axes = figure.subplots(2, 2)
    _llm_time(axes[0, 0], results, "fwd", "forward")
    _llm_time(axes[0, 1], results, "fwdbwd", "forward + backward")
    _decode_bandwidth(axes[1, 0], results)
    _window_sweep(axes[1, 1], results)
    figure.savefig(path, dpi=110)
