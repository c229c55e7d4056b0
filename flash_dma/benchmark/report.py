"""results.json and results.md: the environment, the target checks and every row."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.results import Result, select
from flash_dma.benchmark.suites import MASK_BLOCK, MODES, SUITES
from flash_dma.benchmark.targets import Check

KINDS = ("prefill", "decode", "window")
MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward"}
ENVIRONMENT_FIELDS = (("gpu", "GPU"), ("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                      ("date", "date"), ("command", "command"))
COUNTING = (
    f"TFLOP/s are effective: 4·D FLOPs per visible (q, k) pair for the forward (visible: causal, "
    f"bottom-right aligned, and kept by the mask), 3.5x that for forward + backward; dense methods "
    f"count every causal pair. GB/s (decode) counts the K/V bytes the method reads: the kept keys for "
    f"methods that skip masked blocks, every key otherwise. Peak GiB is the memory one call allocates "
    f"beyond its inputs. 'time / flash-dma' is the row's time over flash-dma's in the same case and pass. "
    f"Masks keep whole {MASK_BLOCK}-key blocks: the block top-k of the per-key bias, always with block 0."
)


def write_json(path: Path, environment: dict, results: list[Result], checks: list[Check]) -> None:
    payload = {
        "environment": environment,
        "targets": [asdict(c) for c in checks],
        "results": [r.to_dict() for r in results],
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")


def _num(x: float | None) -> str:
    """Three significant digits, without exponents for the magnitudes that occur here."""
    if x is None:
        return ""
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}" if abs(x) >= 0.001 else f"{x:.2e}"


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _environment_table(environment: dict) -> str:
    rows = []
    for key, title in ENVIRONMENT_FIELDS:
        value = str(environment.get(key, "unknown"))
        rows.append([title, f"`{value}`" if key == "command" else value])
    return _markdown_table(["", ""], rows)


def checks_table(checks: list[Check]) -> str:
    rows = [
        [c.name, c.target, "" if c.value is None else f"{c.value:.2f}x", f"**{c.status}**", c.detail]
        for c in checks
    ]
    return _markdown_table(["target", "goal", "value", "status", "detail"], rows)


def _rows_table(rows: list[Result]) -> str:
    """One suite/kind/mode group; the GB/s column only where some row has it (decode)."""
    flash_dma_ms = {r.case: r.ms for r in rows if r.method == "flash-dma" and r.ok}
    with_bandwidth = any(r.gbps is not None for r in rows)
    header = ["case", "kept blocks", "method", "ms", "TFLOP/s", *(["GB/s"] if with_bandwidth else []),
              "peak GiB", "time / flash-dma", "setup s", "note"]
    table = []
    for r in rows:
        kept = f"{r.case.kept_blocks}/{r.case.key_blocks}" if METHODS[r.method].applies_mask else "all"
        baseline = flash_dma_ms.get(r.case)
        relative = f"{r.ms / baseline:.2f}x" if r.ok and baseline else ""
        table.append([
            r.case.label, kept, r.method, _num(r.ms), _num(r.tflops), *([_num(r.gbps)] if with_bandwidth else []),
            _num(r.peak_gib), relative, "" if r.setup_s is None else f"{r.setup_s:.1f}",
            r.note if r.ok else f"skipped: {r.note}",
        ])
    return _markdown_table(header, table)


def render_markdown(environment: dict, results: list[Result], checks: list[Check]) -> str:
    parts = ["# flash-dma benchmark", "", _environment_table(environment)]
    parts += ["", "## Targets", "", checks_table(checks), "", "## Methods", ""]
    parts += [f"- `{name}`: {method.description}." for name, method in METHODS.items()]
    parts += ["", COUNTING]
    for suite in SUITES:
        for kind in KINDS:
            for mode in MODES:
                rows = select(results, mode=mode, ok_only=False, suite=suite, kind=kind)
                if not rows:
                    continue
                first = rows[0].case
                parts += ["", f"## {suite} · {kind} · {MODE_TITLES[mode]}", "",
                          f"{first.shape_text()}, bf16, causal.", "", _rows_table(rows)]
    return "\n".join(parts) + "\n"


def write_markdown(path: Path, environment: dict, results: list[Result], checks: list[Check]) -> None:
    path.write_text(render_markdown(environment, results, checks))
