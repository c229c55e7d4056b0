"""results.json and results.md: the environment, the target checks and every row."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.results import Result, select
from flash_dma.benchmark.suites import CEILING, KINDS, MASK_BLOCK, MODES, SUITES, Case
from flash_dma.benchmark.targets import TARGETS, Check, format_amount

MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward"}
KIND_TITLES = {"host": "host time per call", "train": "train step", "select": "key selection"}
ENVIRONMENT_FIELDS = (("gpu", "GPU"), ("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                      ("date", "date"), ("command", "command"))
COUNTING = (
    f"TFLOP/s are effective: 4·D FLOPs per visible (q, k) pair for the forward (visible: causal, "
    f"bottom-right aligned, and kept by the mask), 3.5x that for forward + backward; dense methods "
    f"count every causal pair. 'vs cuDNN' is the row's TFLOP/s over dense cuDNN's ({CEILING}) on the "
    f"same shape and pass in the same suite. GB/s (decode) counts the K/V bytes the method reads: the "
    f"kept keys for methods that skip masked blocks, every key otherwise. Peak GiB is the memory one "
    f"call allocates beyond its inputs. 'time / X' is the row's time over that of X (its case's first "
    f"method) in the same case and pass. Block masks keep whole {MASK_BLOCK}-key blocks: the block "
    f"top-k of the per-key bias, always with block 0 (per query block in the topkq suite, with each "
    f"query block's diagonal block too); token masks keep the keys of largest bias. Host rows: the "
    f"mean wall time per call (and CPU time per call) of many calls issued back to back, the GPU "
    f"synchronised only at the end. First-call rows: the first call in a new process, 'setup s' "
    f"being the time the process took before it (imports, inputs, the model). Packed documents "
    f"(varlen): visible pairs are each document's own causal pairs under its kept blocks, for every "
    f"method (the padded one gets no credit for its padding). KV-cache rows (kvcache): GB/s counts "
    f"the bytes of K and V of the kept keys only, plus the cached bias of every key and the mask "
    f"(1 byte a key); decode and KV-cache rows are timed as CUDA graph replays."
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
    """The target checks of the run, after a line saying how many of the targets they are."""
    scope = (
        f"All {len(TARGETS)} targets concern the rows of this run." if len(checks) == len(TARGETS) else
        f"{len(checks)} of the {len(TARGETS)} targets concern the rows of this run; the others need suites "
        "or cases it did not run."
    )
    return scope + "\n\n" + checks_markdown(checks) if checks else scope


def checks_markdown(checks: list[Check]) -> str:
    """The target checks as a table: name, goal, value, status and detail."""
    rows = [
        [c.name, c.target, "" if c.value is None else format_amount(c.value, c.unit), f"**{c.status}**", c.detail]
        for c in checks
    ]
    return _markdown_table(["target", "goal", "value", "status", "detail"], rows)


def _shape_key(case: Case, mode: str) -> tuple:
    return case.suite, case.batch, case.heads, case.kv_heads, case.head_dim, case.seqlen_q, case.seqlen_k, mode


def _time_column(case: Case) -> tuple[str, float]:
    """Header and scale from ms of a table's time column: host rows in µs, first calls in s."""
    if case.cache is not None:
        return "first call s", 1e-3
    if case.is_host:
        return "µs/call", 1e3
    return "ms", 1.0


def _rows_table(rows: list[Result], ceiling_tflops: dict[tuple, float]) -> str:
    """One suite/kind/mode group. Columns without a value in any row (GB/s outside decode, TFLOP/s
    for host rows...) are left out."""
    header, scale = _time_column(rows[0].case)
    baselines = {r.case.methods[0] for r in rows}
    baseline = baselines.pop() if len(baselines) == 1 else "first method"
    first_ms = {r.case: r.ms for r in rows if r.ok and r.method == r.case.methods[0]}

    def scaled(x: float | None) -> str:
        return "" if x is None else _num(x * scale)

    def relative(r: Result) -> str:
        first = first_ms.get(r.case)
        return f"{r.ms / first:.2f}x" if r.ok and first and r.method != r.case.methods[0] else ""

    def vs_ceiling(r: Result) -> str:
        ceiling = ceiling_tflops.get(_shape_key(r.case, r.mode))
        return f"{r.tflops / ceiling:.2f}x" if r.tflops is not None and ceiling else ""

    columns = (
        ("case", lambda r: r.case.label),
        ("kept", lambda r: r.case.kept_text if METHODS[r.method].applies_mask else "all"),
        ("method", lambda r: r.method),
        (header, lambda r: scaled(r.ms)),
        (f"CPU {header}", lambda r: scaled(r.cpu_ms)),
        ("TFLOP/s", lambda r: _num(r.tflops)),
        ("vs cuDNN", vs_ceiling),
        ("GB/s", lambda r: _num(r.gbps)),
        ("tokens/s", lambda r: _num(r.tokens_per_s)),
        ("peak GiB", lambda r: _num(r.peak_gib)),
        (f"time / {baseline}", relative),
        ("setup s", lambda r: "" if r.setup_s is None else f"{r.setup_s:.1f}"),
        ("SM clock", lambda r: r.sm_clock),
        ("note", lambda r: r.note if r.ok else f"skipped: {r.note}"),
    )
    always = {"case", "kept", "method", header, "setup s", "note"}
    cells = {title: [cell(r) for r in rows] for title, cell in columns}
    shown = [title for title, _ in columns if title in always or any(cells[title])]
    return _markdown_table(shown, [[cells[title][i] for title in shown] for i in range(len(rows))])


def render_markdown(environment: dict, results: list[Result], checks: list[Check]) -> str:
    parts = ["# flash-dma benchmark", "", _environment_table(environment)]
    parts += ["", "## Targets", "", checks_table(checks), "", "## Methods", ""]
    parts += [f"- `{name}`: {method.description}." for name, method in METHODS.items()]
    parts += ["", COUNTING]
    ceiling_tflops = {_shape_key(r.case, r.mode): r.tflops for r in select(results, CEILING) if r.tflops}
    for suite in SUITES:
        for kind in KINDS:
            for mode in MODES:
                rows = select(results, mode=mode, ok_only=False, suite=suite, kind=kind)
                if not rows:
                    continue
                title = f"{suite} · {KIND_TITLES.get(kind, kind)} · {MODE_TITLES[mode]}"
                parts += ["", f"## {title}"]
                # One table per shape (the kvcache suite has two), in the order the shapes came.
                shapes = {r.case.shape_text(): None for r in rows}
                for shape in shapes:
                    shape_rows = [r for r in rows if r.case.shape_text() == shape]
                    parts += ["", f"{shape}, bf16, causal.", "", _rows_table(shape_rows, ceiling_tflops)]
    return "\n".join(parts) + "\n"


def write_markdown(path: Path, environment: dict, results: list[Result], checks: list[Check]) -> None:
    path.write_text(render_markdown(environment, results, checks))
