"""The options by which a tool picks the benchmark's attention cases (``--suite``, ``--lengths``,
``--keeps``, ``--mode``, ``--method``), as ``flash-dma bench`` names them, and the cases they pick."""

from __future__ import annotations

import argparse

import torch

from flash_dma.argument_types import fraction_list, length_list
from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.suites import MODES, SUITES, Case, build_cases


def add_case_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=SUITES, default="llm", help="the benchmark suite whose cases are run (default: llm)")
    parser.add_argument("--lengths", type=length_list, default=None, help="only the cases with these key lengths (e.g. 16K,32K)")
    parser.add_argument("--keeps", type=fraction_list, default=None, help="only the cases keeping these fractions (e.g. 1/8,1)")
    parser.add_argument("--mode", choices=MODES, default="fwdbwd", help="forward only, or forward and backward (default)")
    parser.add_argument("--method", choices=tuple(METHODS), default="flash-dma", help="the benchmark method run (default: flash-dma)")


def selected_cases(parser: argparse.ArgumentParser, args: argparse.Namespace, what: str) -> list[Case]:
    """The attention cases in this process (not a model's, nor a new process's) that the options
    pick; the parser's error where there is no case, or no GPU (``what``: what the tool times on it)."""
    cases = [
        case for case in build_cases(args.suite, modes=(args.mode,), methods=(args.method,), lengths=args.lengths, keeps=args.keeps)
        if case.counts_work
    ]
    if not cases:
        parser.error(f"no attention case of suite {args.suite} runs {args.method} with those lengths and keeps")
    if not torch.cuda.is_available():
        parser.error(f"a CUDA device is needed: {what}")
    return cases
