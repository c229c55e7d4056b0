"""Run the kernels under compute-sanitizer's memcheck, racecheck and synccheck, and summarise the logs.

    PYTHONPATH=. python tools/sanitize.py --out $OUT/sanitize.md
    PYTHONPATH=. python tools/sanitize.py --tools memcheck --cases decode-paged-splits,summary-key-list

1. Warm-up: the driver (``tools/sanitize_driver.py``) runs each case once without the sanitizer,
   in parallel processes. It fills Triton's on-disk cache, so that the sanitized runs load every
   kernel instead of compiling it, and shows which cases pass on their own.
2. One sanitized driver process per tool, run concurrently, each logging to
   ``<out dir>/sanitize-<tool>.log``; and a canary under memcheck, a deliberate one-past-the-end
   read that must be reported (else a clean memcheck proves nothing).
3. The logs are parsed (``ERROR SUMMARY``, ``RACECHECK SUMMARY``, each report with its first
   location, attributed to the driver case that was running) into a Markdown summary at --out.

Only Triton's kernels are checked: PyTorch's are C++ kernels with mangled names (``_Z...``), which
a kernel-name filter excludes. Exit status 1 if a tool reports an error, a run fails or times out,
the canary goes unreported, or a sanitized run had to compile a kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton

from flash_dma.backends.triton import dispatch
from tools.sanitize_driver import CASES, HOPPER_VARIANTS, MARK

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tools" / "sanitize_driver.py"
TOOLS = ("memcheck", "racecheck", "synccheck")
CANARY = "canary-oob"
# The sanitizer's exit status when it found errors: distinct from the driver's own failure (1).
SANITIZER_ERROR_EXIT = 86
# Triton names kernels after their Python functions; C++ (PyTorch's) kernel names are mangled.
EXCLUDE_MANGLED = "kns=_Z"

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_REPORT_LINE = re.compile(r"^=+( +)(.*)$")  # the sanitizer's lines: a report's first line, or (indented) its details
_NOT_REPORTS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "Target application returned an error")


@dataclasses.dataclass
class Finding:
    """One kind of report: its first line, its first location, how often, and the case that was
    running when it was printed (the sanitizer prints asynchronously: the kernel's name in
    ``where`` is exact, the case nearly always)."""

    text: str
    where: str
    case: str | None
    count: int = 1


@dataclasses.dataclass
class LogReport:
    """What one run's log says. Counts are None where the log has no summary (a crash or a timeout)."""

    errors: int | None = None
    race_errors: int | None = None
    race_warnings: int | None = None
    findings: list[Finding] = dataclasses.field(default_factory=list)
    passed: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    last_case: str | None = None  # the last case begun: where a hang or a crash happened
    variants: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # Hopper variant -> cases launching it
    unnamed: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # "kernel values" no variant names -> cases

    @property
    def total_errors(self) -> int | None:
        return self.errors if self.errors is not None else self.race_errors


def parse_log(text: str) -> LogReport:
    """Parse a sanitized driver run's combined output (the sanitizer's lines and the driver's markers)."""
    report = LogReport()
    reports: list[Finding] = []
    current: Finding | None = None  # the report whose details follow
    for line in text.splitlines():
        if line.startswith(MARK):
            words = line[len(MARK):].split(maxsplit=2)
            if words[0] == "begin":
                report.last_case = words[1]
            elif words[0] == "end":
                if words[2].startswith("ok"):
                    report.passed.append(words[1])
                else:
                    report.failed[words[1]] = words[2]
            elif words[0] == "variant":
                report.variants.setdefault(words[1], []).append(words[2])
            elif words[0] == "unnamed":
                kernel, case, values = words[1], *words[2].split(maxsplit=1)
                report.unnamed.setdefault(f"{kernel} {values}", []).append(case)
            continue
        if match := _ERROR_SUMMARY.search(line):
            report.errors = int(match.group(1))
        if match := _RACE_SUMMARY.search(line):
            report.race_errors, report.race_warnings = int(match.group(2)), int(match.group(3))
        match = _REPORT_LINE.match(line)
        if not match or not match.group(2):
            continue
        indent, body = match.groups()
        if len(indent) == 1:  # a report's first line
            current = None
            if not body.startswith(_NOT_REPORTS):
                current = Finding(body, "", report.last_case)
                reports.append(current)
        elif current is not None and not current.where and body.startswith(("at ", "and ")):
            # Its location: "at kernel+offset in file:line" (a race: "and <the other access> at ...").
            current.where = body
    # The same fault in many threads or launches is one finding.
    findings: dict[tuple[str, str], Finding] = {}
    for found in reports:
        known = findings.setdefault((found.text, found.where), found)
        if known is not found:
            known.count += 1
    report.findings = list(findings.values())
    return report


@dataclasses.dataclass
class Run:
    """One sanitized driver process."""

    label: str
    tool: str
    cases: list[str]
    log: Path
    expect_errors: bool = False  # the canary
    seconds: float = 0.0
    returncode: int | None = None  # None: timed out
    report: LogReport = dataclasses.field(default_factory=LogReport)

    def problem(self) -> str | None:
        """Why this run fails the check, or None."""
        report, errors = self.report, self.report.total_errors
        if self.returncode is None:
            return f"timed out in case {report.last_case}"
        if self.expect_errors:
            return None if errors else "the deliberate out-of-bounds read was not reported"
        if errors is None:
            return f"no error summary (exit status {self.returncode}; last case {report.last_case})"
        if errors:
            return f"{errors} errors"
        if report.failed:
            return f"{len(report.failed)} cases failed their checks"
        if self.returncode != 0 or len(report.passed) != len(self.cases):
            return f"the driver exited with {self.returncode} after {len(report.passed)} of {len(self.cases)} cases"
        return None


def find_sanitizer(path: str | None) -> str:
    """The compute-sanitizer executable: ``path``, on PATH, or in a CUDA toolkit under /usr/local."""
    versioned = sorted(
        glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), key=lambda p: [int(n) for n in re.findall(r"\d+", p)]
    )
    candidates = [path] if path else [shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"]
    for candidate in candidates + ([] if path else versioned[::-1]):  # the newest toolkit first
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit(f"compute-sanitizer not found{f' at {path}' if path else ' (pass --sanitizer)'}")


def driver_env(cache_dir: Path) -> dict[str, str]:
    """The environment of every driver process, warm-up and sanitized alike, so that kernels specialise alike."""
    env = dict(os.environ)
    env.update(
        # Every tensor its own cudaMalloc: with the caching allocator, an access past a tensor
        # but inside its pooled block is invisible to memcheck (PyTorch's advice for the sanitizer).
        PYTORCH_NO_CUDA_MEMORY_CACHING="1",
        TRITON_CACHE_DIR=str(cache_dir),
        FLASH_DMA_AUTOTUNE="0",  # tuning would time every tile candidate under the sanitizer
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    return env


def sanitizer_command(
    sanitizer: str, tool: str, cases: list[str], options: argparse.Namespace, help_text: str
) -> list[str]:
    """The compute-sanitizer command line for one tool over ``cases``; options it lacks (``help_text``) are left out.

    Options are written ``--name=value``: since 2023.3 some take their yes/no value optionally,
    and then only in that form.
    """
    command = [sanitizer, f"--tool={tool}", f"--error-exitcode={SANITIZER_ERROR_EXIT}"]
    command.append(f"--print-limit={options.print_limit}")
    if "--check-exit-code" in help_text:
        command.append("--check-exit-code=no")  # the driver's failures are reported apart, not as sanitizer errors
    if not options.all_kernels:
        # --kernel-name-exclude since 2023.3, --kernel-regex-exclude before.
        exclude = next((o for o in ("--kernel-name-exclude", "--kernel-regex-exclude") if o in help_text), None)
        if exclude:
            command.append(f"{exclude}={EXCLUDE_MANGLED}")
    if tool == "racecheck":
        command.append("--racecheck-report=analysis")  # one report per pair of racing instructions
    return command + [sys.executable, str(DRIVER), *(f"--case={name}" for name in cases)]


def execute(command: list[str], log: Path, env: dict[str, str], timeout: float) -> tuple[int | None, float]:
    """Run ``command`` with its output in ``log``: ``(exit status or None on timeout, seconds)``."""
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        # A session of its own, so that a timeout ends the sanitizer and the driver it started together.
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    return returncode, time.monotonic() - start


def cache_files(cache_dir: Path) -> set[Path]:
    return {p for p in cache_dir.rglob("*") if p.is_file()} if cache_dir.exists() else set()


def warm_up(cases: list[str], log: Path, env: dict[str, str], jobs: int, timeout: float) -> Run:
    """Each case once without the sanitizer, ``jobs`` processes at a time (compiling is the slow part),
    naming the Hopper variants it launches."""
    run = Run("warm-up (no sanitizer)", "", cases, log)
    parts = log.parent / f"{log.stem}.parts"
    parts.mkdir(exist_ok=True)
    start = time.monotonic()

    def one(name: str) -> int | None:
        return execute([sys.executable, str(DRIVER), "--variants", f"--case={name}"], parts / f"{name}.log", env, timeout)[0]

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        statuses = list(pool.map(one, cases))
    run.seconds = time.monotonic() - start
    log.write_text("".join((parts / f"{name}.log").read_text() for name in cases))
    shutil.rmtree(parts)
    run.report = parse_log(log.read_text())
    run.returncode = None if None in statuses else max(statuses, default=0)
    return run


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def markdown(runs: list[Run], warm: Run, compiled: tuple[int, int], setup: str) -> str:
    """The summary: one table row per run, then every finding and failed case, then the case lists.

    ``compiled``: Triton cache files written by the warm-up and by the sanitized runs.
    """
    warmed, compiled_under_sanitizer = compiled
    lines = [
        "# compute-sanitizer report",
        "",
        setup,
        "",
        "| run | cases | errors | race warnings | time | result |",
        "|---|---|---|---|---|---|",
    ]
    warm_problem = None if warm.returncode == 0 and not warm.report.failed else (
        "timed out" if warm.returncode is None else f"{len(warm.report.failed)} cases failed"
    )
    lines.append(
        f"| {warm.label} | {len(warm.cases)} | - | - | {warm.seconds:.0f} s | "
        f"{warm_problem or 'ok'}; {warmed} new Triton cache files |"
    )
    for run in runs:
        result = run.problem() or ("reported, as it must be" if run.expect_errors else "clean")
        errors, warnings = _count(run.report.total_errors), _count(run.report.race_warnings)
        lines.append(f"| {run.label} | {len(run.cases)} | {errors} | {warnings} | {run.seconds:.0f} s | {result} |")
    note = "kernels compiled under the sanitizer" if compiled_under_sanitizer else "every kernel came from the cache"
    lines += ["", f"Triton cache: {compiled_under_sanitizer} files written during the sanitized runs ({note})."]
    for run in [warm, *runs]:
        if run.report.findings or run.report.failed:
            lines += ["", f"## {run.label} ({run.log.name})", ""]
            lines += [f"- {f.count}x `{f.text}` `{f.where}` (case {f.case})" for f in run.report.findings]
            lines += [f"- case {name}: {status}" for name, status in run.report.failed.items()]
    lines += ["", "## Cases", ""]
    lines += [f"- {run.label}: {', '.join(run.cases)}" for run in runs]
    if torch.cuda.is_available() and dispatch.device_kind(torch.device("cuda")) == "hopper":
        lines += ["", *variant_coverage(warm.report.variants, warm.report.unnamed)]
    return "\n".join(lines) + "\n"


def variant_coverage(variants: dict[str, list[str]], unnamed: dict[str, list[str]]) -> list[str]:
    """The section naming, for each Hopper variant of ``variants.VARIANTS``, the cases that launch
    it (``variants``, from the warm-up's driver lines), those no case launches first, then the
    Hopper launches no variant names (``unnamed``: kernel and compile-time values -> cases)."""
    missing = [v.name for v in HOPPER_VARIANTS if v.name not in variants]
    lines = [
        "## Hopper variants",
        "",
        f"{len(HOPPER_VARIANTS) - len(missing)} of the {len(HOPPER_VARIANTS)} Hopper variants "
        f"(`flash_dma/backends/triton/variants.py`) are launched by the cases run"
        + (f"; not launched: {', '.join(missing)}." if missing else "."),
        "",
        "| variant | cases |",
        "|---|---|",
    ]
    lines += [f"| {v.name} | {', '.join(dict.fromkeys(variants[v.name]))} |" for v in HOPPER_VARIANTS if v.name in variants]
    if unnamed:
        lines += ["", "Hopper launches that no variant names (compile-time values):", ""]
        lines += [f"- `{spec}`: {', '.join(dict.fromkeys(cases))}" for spec, cases in unnamed.items()]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated, from " + ", ".join(TOOLS))
    parser.add_argument("--cases", help="comma-separated driver cases for every tool (default: all; "
                        "tools/sanitize_driver.py --list)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "sanitize.md",
                        help="the Markdown summary; the logs go beside it (default: $OUT/sanitize.md)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per driver process")
    parser.add_argument("--sanitizer", help="the compute-sanitizer executable (default: PATH, then /usr/local/cuda*)")
    parser.add_argument("--print-limit", type=int, default=100, help="reports printed per run (0: all)")
    parser.add_argument("--jobs", type=int, default=4, help="sanitized runs at a time (1: undisturbed timings)")
    parser.add_argument("--all-kernels", action="store_true", help="also check PyTorch's kernels")
    parser.add_argument("--no-canary", action="store_true", help="skip the memcheck canary")
    args = parser.parse_args()

    tools = args.tools.split(",")
    if unknown := [t for t in tools if t not in TOOLS]:
        parser.error(f"unknown tools {unknown}")
    chosen = args.cases.split(",") if args.cases else None
    if unknown := [name for name in chosen or () if name not in CASES]:
        parser.error(f"unknown cases {unknown}")
    sanitizer = find_sanitizer(args.sanitizer)
    asked = subprocess.run([sanitizer, "--help"], capture_output=True, text=True)
    help_text = asked.stdout + asked.stderr
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(triton.knobs.cache.dir)  # TRITON_CACHE_DIR, or Triton's default
    env = driver_env(cache_dir)

    cases = chosen or [c.name for c in CASES.values() if c.default]
    runs = [Run(tool, tool, cases, out_dir / f"sanitize-{tool}.log") for tool in tools]
    if not args.no_canary:
        runs.append(Run("memcheck canary", "memcheck", [CANARY], out_dir / "sanitize-canary.log", expect_errors=True))
    needed = list(dict.fromkeys(name for run in runs for name in run.cases))

    before = cache_files(cache_dir)
    warm = warm_up(needed, out_dir / "sanitize-warmup.log", env, min(len(needed), os.cpu_count() or 1, 8), args.timeout)
    warmed = cache_files(cache_dir)
    print(f"warm-up: {len(warm.report.passed)} of {len(needed)} cases passed ({warm.seconds:.0f} s)", flush=True)

    def sanitized(run: Run) -> Run:
        command = sanitizer_command(sanitizer, run.tool, run.cases, args, help_text)
        run.returncode, run.seconds = execute(command, run.log, env, args.timeout)
        run.report = parse_log(run.log.read_text())
        print(f"{run.label}: {run.problem() or 'ok'} ({run.seconds:.0f} s)", flush=True)
        return run

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(sanitized, runs))
    compiled = (len(warmed - before), len(cache_files(cache_dir) - warmed))

    example = " ".join(sanitizer_command(sanitizer, "TOOL", ["NAME"], args, help_text)[1:-1])
    setup = (
        f"`{sanitizer}` ({version[-1] if version else 'version unknown'}), torch {torch.__version__}, "
        f"triton {triton.__version__}. Runs: `{example} --case=...`, TOOL each run's tool"
    )
    summary = markdown(runs, warm, compiled, setup)
    args.out.write_text(summary)
    print(summary)
    warm_clean = warm.returncode == 0 and not warm.report.failed
    return 0 if warm_clean and not compiled[1] and not any(run.problem() for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
