"""``flash-dma bench`` and ``flash-dma bench-cp``: their arguments, and ``bench``'s run.

``bench`` times flash-dma against FlexAttention and SDPA, side by side in one process. It writes
``results.json``, ``results.md`` and ``results.png`` to ``--out`` and prints the target checks.
Needs a CUDA GPU; on a machine without one it says so and returns 2. Its optional dependencies
are the ``[bench]`` extra, which :mod:`flash_dma.cli` checks before running it. ``bench-cp`` runs
in :mod:`flash_dma.benchmark.context_parallel`.

Declaring and parsing the arguments imports neither torch nor the kernels, so that ``--help``
answers at once: :func:`main` imports them.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from flash_dma.argument_types import HELP_WIDTH, NO_CUDA_EXIT_CODE, fraction_list, length_list
from flash_dma.benchmark.suites import MODES, SUITE_HELP, SUITES, build_cases

if TYPE_CHECKING:
    from flash_dma.benchmark.results import Result
    from flash_dma.benchmark.targets import Check


def method_names() -> tuple[str, ...]:
    """The methods some suite runs (the keys of ``methods.METHODS``), in the order the suites first run them."""
    return tuple(dict.fromkeys(method for case in build_cases() for method in case.methods))


def _method_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    known = method_names()
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or text!r}; choose from {', '.join(known)}")
    return names


DESCRIPTION = (
    "Time flash-dma against FlexAttention and PyTorch SDPA, side by side in one process on the same "
    "tensors (a CUDA GPU is needed). Writes results.json, results.md and results.png to --out and "
    "prints the target checks; the targets and plots are those of the suites run."
)


def suites_epilog() -> str:
    """One entry per suite, in run order: what ``--suite NAME`` runs."""
    width = max(map(len, SUITES))
    entries = [
        textwrap.fill(text, HELP_WIDTH, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))
        for name, text in SUITE_HELP.items()
    ]
    return "suites (--suite NAME; all runs every one, in this order):\n" + "\n".join(entries)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.epilog = textwrap.fill(DESCRIPTION, HELP_WIDTH), suites_epilog()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keeps one line per suite
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="all",
                        help="which cases to run (default: all; the suites are listed below)")
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both",
                        help="forward only, forward + backward, or both (default: both)")
    parser.add_argument("--methods", type=_method_list, default=None,
                        help=f"comma-separated subset of: {', '.join(method_names())} (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for results.json, results.md and results.png (default: benchmarks/results)")
    parser.add_argument("--lengths", type=length_list, default=None,
                        help="only the cases with these key lengths, comma-separated (e.g. 16K,32768; K = 1024)")
    parser.add_argument("--keeps", type=fraction_list, default=None,
                        help="only the cases keeping these fractions, comma-separated (e.g. 1/8,1)")
    parser.add_argument("--quick", action="store_true",
                        help="a few rows per suite (about one Flex compilation each): a sanity run")
    parser.add_argument("--flex-decode", action="store_true",
                        help="also run Flex on the decode rows (38-300 ms a call there)")
    parser.add_argument("--warmup-ms", type=int, default=250, help="do_bench warm-up budget per row (default: 250)")
    parser.add_argument("--rep-ms", type=int, default=100,
                        help="do_bench measuring budget per row, raised to 10 calls for long ones (default: 100)")
    parser.add_argument("--host-calls", type=int, default=1000,
                        help="calls issued back to back per host-time row (default: 1000)")


def add_context_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``bench-cp``'s arguments; its defaults are written as a user types them, and parsed as typed."""
    parser.add_argument("--lengths", type=length_list, default="256K,1M",
                        help="total tokens, comma-separated (default: %(default)s; K = 1024, M = 1024^2)")
    parser.add_argument("--keeps", type=fraction_list, default="1/8,1",
                        help="fractions of key blocks kept, comma-separated (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per row after one warm-up (default: 3)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results-cp"), help="output folder")


def environment() -> dict:
    """What the numbers were measured on, for the report's header."""
    import torch
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(sys.argv),
    }


def main(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: parsing the arguments (--help) imports no torch

    from flash_dma.benchmark.clocks import clock_log
    from flash_dma.benchmark.measure import TimingOptions
    from flash_dma.benchmark.methods import MethodOptions
    from flash_dma.benchmark.plots import plot_results
    from flash_dma.benchmark.report import checks_table, write_json, write_markdown
    from flash_dma.benchmark.runner import run_cases
    from flash_dma.benchmark.targets import evaluate

    if not torch.cuda.is_available():
        print(
            "flash-dma bench: no CUDA GPU is available. The benchmark times CUDA kernels "
            "(flash-dma's Triton kernels, FlexAttention, SDPA) and cannot run on the CPU.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT_CODE

    modes = MODES if args.mode == "both" else (args.mode,)
    cases = build_cases(
        args.suite, quick=args.quick, modes=modes, methods=args.methods, lengths=args.lengths, keeps=args.keeps,
    )
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)

    # Rewritten after every case: a run cut short (time limit, crash) keeps its finished rows.
    def save(results: list[Result]) -> list[Check]:
        checks = evaluate(results)
        write_json(args.out / "results.json", env, results, checks)
        write_markdown(args.out / "results.md", env, results, checks)
        return checks

    with clock_log():
        results = run_cases(
            cases,
            MethodOptions(flex_decode=args.flex_decode),
            TimingOptions(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, host_calls=args.host_calls),
            on_case_done=save,
        )
    checks = save(results)
    plotted = plot_results(args.out / "results.png", results)
    print(checks_table(checks))
    print(f"results in {args.out}: results.md, results.json" + (", results.png" if plotted else ""))
    return 0
