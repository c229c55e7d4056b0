"""results.png: the headline comparisons of the suites that ran, one panel each.

Panels, each drawn only where the run has its rows: llm keep 1/8 forward and forward + backward
time vs S (dense ceilings dashed); llm S=16K forward + backward time vs the fraction of blocks
kept; seed decode bandwidth vs Sk (keep 1 solid, keep 1/8 dotted) against the copy ceiling; the
seed window sweep, time vs window.

Every measured point has a marker, and a line joins two points only when they are neighbours on
the axes' doubling grid: a line never crosses an x that was not measured. The figure holds the
panels and nothing else, the last row centred when it has fewer panels than the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.metrics import HBM_COPY_GBPS
from flash_dma.benchmark.results import Result, select
from flash_dma.benchmark.suites import SEED_SWEEP_LENGTH, format_fraction

PALETTE = ("tab:red", "tab:orange", "tab:blue", "tab:purple", "tab:pink", "tab:gray", "tab:green", "tab:brown",
           "tab:olive", "tab:cyan", "black", "gold", "darkred", "darkorange", "teal", "slateblue", "darkkhaki",
           "navy", "crimson", "indigo", "olivedrab", "maroon", "darkviolet", "peru", "darkgoldenrod", "lightseagreen",
           "rosybrown", "darkslategray", "mediumvioletred", "steelblue", "darkseagreen")
COLORS = dict(zip(METHODS, PALETTE, strict=True))
LLM_PLOT_KEEP = 1 / 8
LLM_KEEP_PLOT_LENGTH = 16384
# The x axes are logarithmic in base 2: a line joins two points at most one doubling apart, so a
# line never stands for an x that was not measured (the llm suite skips 64K between 32K and 128K).
LINE_SPAN = 2
PANELS_PER_ROW = 3


@dataclass(frozen=True)
class Line:
    method: str
    label: str
    xs: list
    ys: list
    style: str = "-"


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    ceiling: tuple[float, str] | None = None  # a horizontal line: (value, label)

    def add(self, rows: list[Result], x: str, y: str, method: str, label: str, style: str = "-") -> None:
        """A line through ``rows``' (x, y) points, in order of x; none without rows."""
        if rows:
            points = sorted((getattr(r.case, x), getattr(r, y)) for r in rows)
            self.lines.append(Line(method, label, [px for px, _ in points], [py for _, py in points], style))


def _llm_time(results: list[Result], mode: str, title: str) -> Panel:
    panel, shape = Panel("", "S", "ms"), ""
    for name, method in METHODS.items():
        # Dense methods ignore the mask and run under keep 1 only.
        keep = LLM_PLOT_KEEP if method.applies_mask else None
        rows = select(results, name, mode, suite="llm", kind="prefill", bias="key", keep=keep)
        panel.add(rows, "seqlen_k", "ms", name, name, "-" if method.applies_mask else "--")
        shape = shape or (rows[0].case.shape_text() if rows else "")
    panel.title = f"llm {shape}, keep {format_fraction(LLM_PLOT_KEEP)}: {title}"
    return panel


def _llm_keep(results: list[Result]) -> Panel:
    panel = Panel(f"llm S={LLM_KEEP_PLOT_LENGTH}: forward + backward time vs blocks kept",
                  "fraction of key blocks kept", "ms")
    for name, method in METHODS.items():
        if method.applies_mask:
            rows = select(results, name, "fwdbwd", suite="llm", kind="prefill", bias="key",
                          seqlen_k=LLM_KEEP_PLOT_LENGTH)
            panel.add(rows, "keep", "ms", name, name)
    return panel


def _decode_bandwidth(results: list[Result]) -> Panel:
    panel = Panel("seed decode (Sq=1, CUDA graphs): K/V bandwidth", "Sk", "GB/s",
                  ceiling=(HBM_COPY_GBPS, "copy ceiling"))
    for name in METHODS:
        for keep, style in ((1.0, "-"), (1 / 8, ":")):
            rows = select(results, name, "fwd", suite="seed", kind="decode", keep=keep)
            panel.add(rows, "seqlen_k", "gbps", name, f"{name} keep {format_fraction(keep)}", style)
    return panel


def _window_sweep(results: list[Result]) -> Panel:
    panel = Panel(f"seed window sweep at S={SEED_SWEEP_LENGTH}", "window W (keys kept per row)", "ms")
    for name in METHODS:
        for mode, style in (("fwd", "-"), ("fwdbwd", "--")):
            rows = select(results, name, mode, suite="seed", kind="window")
            panel.add(rows, "window", "ms", name, f"{name} {mode}", style)
    return panel


def panels(results: list[Result]) -> list[Panel]:
    """The panels that have rows in ``results``, in a fixed order."""
    every = [
        _llm_time(results, "fwd", "forward"),
        _llm_time(results, "fwdbwd", "forward + backward"),
        _llm_keep(results),
        _decode_bandwidth(results),
        _window_sweep(results),
    ]
    return [panel for panel in every if panel.lines]


def broken_at_gaps(xs: list, ys: list) -> tuple[list, list]:
    """``xs`` and ``ys`` (ascending x) with a NaN point between two points more than ``LINE_SPAN``
    times apart in x: matplotlib ends a line at NaN, so the line stops at the gap and the points on
    either side keep their markers."""
    out_x, out_y = [], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i and x > xs[i - 1] * LINE_SPAN:
            out_x.append(math.nan)
            out_y.append(math.nan)
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


def _draw(ax, panel: Panel) -> None:
    for line in panel.lines:
        xs, ys = broken_at_gaps(line.xs, line.ys)
        ax.plot(xs, ys, line.style, marker="o", ms=3, color=COLORS[line.method], label=line.label)
    if panel.ceiling is not None:
        ax.axhline(panel.ceiling[0], color="black", lw=0.8, ls="--", label=panel.ceiling[1])
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def figure(results: list[Result]) -> Figure | None:
    """The panels that have rows in ``results``, one axes each and no empty one: up to
    ``PANELS_PER_ROW`` a row, the rows as even as possible and a shorter last row centred. None
    when no panel has rows."""
    drawn = panels(results)
    if not drawn:
        return None
    rows = math.ceil(len(drawn) / PANELS_PER_ROW)
    columns = math.ceil(len(drawn) / rows)
    result = Figure(figsize=(6.5 * columns, 4.5 * rows), layout="constrained")
    # Two grid columns per panel, so that a row of fewer panels can start half a panel in.
    grid = result.add_gridspec(rows, 2 * columns)
    for i, panel in enumerate(drawn):
        row, place = divmod(i, columns)
        in_row = min(columns, len(drawn) - row * columns)
        start = columns - in_row + 2 * place
        _draw(result.add_subplot(grid[row, start:start + 2]), panel)
    return result


def plot_results(path: Path, results: list[Result]) -> bool:
    """Write the panels that have rows to ``path``; with none, write nothing (and remove an earlier
    plot there, which would show another run). Returns whether a plot was written."""
    drawn = figure(results)
    if drawn is None:
        path.unlink(missing_ok=True)
        return False
    drawn.savefig(path, dpi=110)
    return True
