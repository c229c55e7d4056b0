"""The ``flash-dma`` command: ``demo``, ``bench``, ``bench-cp`` and ``selfcheck``, and ``--version``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``;
modules are imported only when their subcommand runs, after the optional dependencies it declares
have been found: a missing one is reported with the ``pip install`` line that adds it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field

import torch
import triton

from flash_dma import __version__

MISSING_DEPENDENCY_EXIT_CODE = 2


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its module, its help line, and its optional dependencies (module -> extra)."""

    module: str
    help: str
    requires: dict[str, str] = field(default_factory=dict)


SUBCOMMANDS = {
    "demo": Subcommand(
        "flash_dma.demo.cli",
        "train a small model on a long-context recall task, sparse vs dense",
        {"matplotlib": "demo", "tqdm": "demo"},
    ),
    "bench": Subcommand(
        "flash_dma.benchmark.cli",
        "benchmark flash-dma against FlexAttention and SDPA (CUDA)",
        # transformers: the llama and firstcall suites, part of the default --suite all.
        {"matplotlib": "bench", "tqdm": "bench", "transformers": "bench"},
    ),
    "bench-cp": Subcommand(
        "flash_dma.benchmark.context_parallel",
        "benchmark context-parallel attention on several GPUs against one (CUDA)",
    ),
    "selfcheck": Subcommand("flash_dma.selfcheck", "run attention on an example on every available backend"),
}


def version() -> str:
    """``flash-dma X (torch Y, triton Z)``: the versions that decide which kernels run."""
    return f"flash-dma {__version__} (torch {torch.__version__}, triton {triton.__version__})"


def missing_dependencies(name: str) -> str | None:
    """What subcommand ``name`` lacks and the ``pip install`` line that adds it, or None if nothing."""
    requires = SUBCOMMANDS[name].requires
    missing = [module for module in requires if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    extras = ",".join(sorted({requires[module] for module in missing}))
    return (
        f"flash-dma {name}: missing optional dependencies ({', '.join(missing)}); install them with:\n"
        f"    pip install 'flash-dma[{extras}]'"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flash-dma", description="Trainable dynamic-mask sparse attention.")
    parser.add_argument("--version", action="version", version=version())
    commands = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, subcommand in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=subcommand.help)
        # Only the chosen subcommand's module is imported (the others may need optional extras), and
        # only once its dependencies are found: its imports would otherwise fail with a bare ModuleNotFoundError.
        if argv and argv[0] == name:
            missing = missing_dependencies(name)
            if missing:
                print(missing, file=sys.stderr)
                return MISSING_DEPENDENCY_EXIT_CODE
            importlib.import_module(subcommand.module).add_arguments(sub)
    args = parser.parse_args(argv)
    return importlib.import_module(SUBCOMMANDS[args.command].module).main(args)


if __name__ == "__main__":
    sys.exit(main())
