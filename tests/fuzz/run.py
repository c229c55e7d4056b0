"""Command line of the fuzz harness: run trials, show progress, report what failed.

    python -m tests.fuzz.run --trials 10000 --seed 0 --extra-head-dims 72,256 --time-limit 420 --out fuzz-out
    python -m tests.fuzz.run --seed 0 --trial 1234             # trial 1234 of that run, alone
    python -m tests.fuzz.run --config '{"index": 1234, ...}'   # a trial from its JSON (failures print it)

On a GPU the defaults are bf16 and fp16, head dims 64 and 128, lengths up to 300 (keys up to
1024 in the split-KV families). Without a GPU the kernels run under the Triton interpreter, in
fp32 and fp16, with short sequences and small heads. ``--trial`` needs the options of the run
it comes from (they choose the families); ``--config`` needs nothing else.

Compilation is the run's main cost on a GPU: each family (``configs.py``) compiles about four
kernels, mostly within the first few hundred trials; 24 families come to about 95 (110 with two
extra head dims). ``--families`` trades compile time for variety; other seeds draw other families.

The report (``report.json``, ``report.md`` in ``--out``) is rewritten every 30 s and at the end,
and ``current.json`` holds the trial being run, so that a run killed from outside, or a hard
crash of the process, still says where it was. Exit status: 0 when every trial passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import triton  # noqa: E402

from tests.fuzz import report as reporting  # noqa: E402
from tests.fuzz.check import TORCH_DTYPES, run_trial  # noqa: E402
from tests.fuzz.configs import Space, Trial, family_pool, sample_trial  # noqa: E402

_SAVE_EVERY = 30.0  # seconds between report rewrites
_LOG_EVERY = 30.0  # seconds between progress lines when stderr is not a terminal
_PRINTED_FAILURES = 20  # failures printed as they happen


class CompileLog:
    """Triton's compilation listener: kernels compiled (or found in its disk cache), and the time."""

    def __init__(self) -> None:
        self.compiled: Counter = Counter()
        self.from_disk_cache = 0
        self.microseconds = 0

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.from_disk_cache += 1
        else:
            self.compiled[src.name] += 1
            self.microseconds += times.total

    def to_dict(self) -> dict:
        return {
            "kernels": sum(self.compiled.values()),
            "seconds": round(self.microseconds / 1e6, 1),
            "from_disk_cache": self.from_disk_cache,
            "per_kernel": dict(self.compiled.most_common()),
        }


def _device_alive(device: torch.device) -> bool:
    """False once the CUDA context is unusable (after an illegal access every later call fails)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2
    except Exception:  # noqa: BLE001 - whatever the driver raises, the context is gone
        return False


class Progress:
    """A tqdm bar on a terminal; in a captured log, a plain line every ``_LOG_EVERY`` seconds."""

    def __init__(self, total: int, start: float):
        self.total, self.start, self.last_line = total, start, start
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="trial", dynamic_ncols=True)

    def update(self, report: reporting.Report, compiles: CompileLog) -> None:
        status = (
            f"{report.counts['mismatch']} mismatches, {report.counts['crash']} crashes, "
            f"{sum(compiles.compiled.values())} kernels compiled ({compiles.microseconds / 1e6:.0f} s)"
        )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(status, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last_line >= _LOG_EVERY:
            self.last_line = now
            print(f"[{now - self.start:6.0f} s] {report.trials}/{self.total} trials, {status}", flush=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _strings(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10000 if on_gpu else 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="index of the first trial (to split a run)")
    parser.add_argument("--dtypes", type=_strings, default=("bf16", "fp16", "fp8") if on_gpu else ("fp32", "fp16", "fp8"))
    parser.add_argument("--head-dims", type=_ints, default=(64, 128) if on_gpu else (16, 32))
    parser.add_argument(
        "--extra-head-dims", type=_ints, default=(96, 256),
        help="head dims given one family each (default 96 and 256: the Hopper kernels' padded and wide tiles), e.g. 72",
    )
    parser.add_argument(
        "--families", type=int, default=24, help="families drawn from --head-dims (each a few compiled kernels)"
    )
    parser.add_argument("--max-seqlen", type=int, default=300 if on_gpu else 40)
    parser.add_argument("--max-seqlen-k-long", type=int, default=1024 if on_gpu else 0, help="split-KV key lengths; 0: none")
    parser.add_argument("--max-heads", type=int, default=8 if on_gpu else 4)
    parser.add_argument("--time-limit", type=float, default=None, help="seconds; no trial starts after it")
    parser.add_argument("--out", type=Path, default=None, help="directory for report.json, report.md, current.json")
    parser.add_argument("--trial", type=int, default=None, help="run only this trial index, verbosely")
    parser.add_argument("--config", type=Trial.from_json, default=None, help="run only this trial (its JSON), verbosely")
    args = parser.parse_args(argv)
    args.command = " ".join(["python -m tests.fuzz.run", *(sys.argv[1:] if argv is None else argv)])
    if unknown := set(args.dtypes) - set(TORCH_DTYPES):
        parser.error(f"--dtypes: unknown {sorted(unknown)}, expected some of {sorted(TORCH_DTYPES)}")
    args.space = Space(
        dtypes=args.dtypes, head_dims=args.head_dims, extra_head_dims=args.extra_head_dims, families=args.families,
        max_seqlen=args.max_seqlen, max_seqlen_k_long=args.max_seqlen_k_long, max_heads=args.max_heads,
    )
    return args


def run_one(trial: Trial, device: torch.device) -> int:
    """Run a single trial and print everything about it."""
    print(f"trial: {trial}\nconfig: {trial.to_json()}", flush=True)
    outcome = run_trial(trial, device)
    print(f"{outcome.status} in {outcome.seconds:.2f} s" + (f" (stage {outcome.stage})" if outcome.stage else ""))
    for problem in outcome.problems:
        print(f"  {problem}")
    return 0 if outcome.status == "ok" else 1


def run_many(args: argparse.Namespace, device: torch.device) -> int:
    """Run the trials, stopping early at the time limit or when the CUDA context dies; write the report."""
    options = {
        "seed": args.seed, "trials": args.trials, "start": args.start, "time_limit": args.time_limit,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in vars(args.space).items()},
    }
    report = reporting.Report(command=args.command, options=options, versions=reporting.versions(device))
    pool = family_pool(args.space, args.seed)
    report.families = {i: {"family": str(f), "trials": 0, "failures": 0} for i, f in enumerate(pool)}
    compiles = CompileLog()
    triton.knobs.compilation.listener = compiles
    start = time.perf_counter()
    last_save = start
    progress = Progress(args.trials, start)

    def save() -> dict:
        result = report.to_dict(time.perf_counter() - start, compiles.to_dict())
        if args.out is not None:
            reporting.write(result, args.out)
        return result

    try:
        for index in range(args.start, args.start + args.trials):
            if args.time_limit is not None and time.perf_counter() - start > args.time_limit:
                report.stopped = "time limit"
                break
            trial = sample_trial(args.space, args.seed, index)
            if args.out is not None:
                (args.out / "current.json").write_text(trial.to_json())
            outcome = run_trial(trial, device)
            failure = report.add(trial, outcome)
            if failure is not None and len(report.failures) <= _PRINTED_FAILURES:
                progress.write(f"FAIL #{index} {outcome.status}: {outcome.problems[0]}")
                progress.write(f"  {trial}\n  repro: {failure['repro']}")
                if len(report.failures) == _PRINTED_FAILURES:
                    progress.write("(further failures are only counted in the progress lines; the report has them all)")
            progress.update(report, compiles)
            if outcome.status == "crash" and not _device_alive(device):
                report.stopped = "fatal"
                report.fatal = (
                    f"the CUDA context died during trial #{index} (the faulting launch may be an earlier trial's: "
                    f"rerun them alone with their repro lines): {outcome.problems[0]}"
                )
                break
            if time.perf_counter() - last_save > _SAVE_EVERY:
                last_save = time.perf_counter()
                save()
    except KeyboardInterrupt:
        report.stopped = "interrupted"
    finally:
        triton.knobs.compilation.listener = None
        progress.close()
    result = save()
    print(reporting.summary(result), flush=True)
    if args.out is not None:
        print(f"report: {args.out / 'report.md'}, {args.out / 'report.json'}")
    return 0 if report.counts["ok"] == report.trials and report.fatal is None else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.config is not None:
        return run_one(args.config, device)
    if args.trial is not None:
        return run_one(sample_trial(args.space, args.seed, args.trial), device)
    return run_many(args, device)


if __name__ == "__main__":
    sys.exit(main())
