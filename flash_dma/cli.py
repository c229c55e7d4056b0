"""The ``flash-dma`` command: ``demo``, ``bench``, ``bench-cp``, ``selfcheck`` and ``precompile``, and ``--version``.

The arguments are parsed before anything imports torch or the kernels, so that ``--help`` and
``--version`` answer at once. Each subcommand names two functions as ``"module:function"``: one
declares its arguments on a parser and is imported to parse; the other runs it on the parsed
arguments and returns the exit code. The second is imported only once the arguments parse and the
optional dependencies the subcommand declares are found: a missing one is reported with the
``pip install`` line that adds it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from importlib import metadata

from flash_dma import __version__

MISSING_DEPENDENCY_EXIT_CODE = 2


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its help line, where its functions are, and its optional dependencies (module -> extra).

    ``arguments`` (``add_arguments(parser)``) is imported to parse, ``--help`` included, so its module
    imports neither torch nor the kernels (``tests/test_cli.py`` checks every subcommand); ``run``
    (``main(args) -> int``) is imported to run.
    """

    help: str
    arguments: str
    run: str
    requires: dict[str, str] = field(default_factory=dict)


SUBCOMMANDS = {
    "demo": Subcommand(
        "train a small model on a long-context recall task, sparse vs dense",
        "flash_dma.demo.arguments:add_arguments",
        "flash_dma.demo.cli:main",
        {"matplotlib": "demo", "tqdm": "demo"},
    ),
    "bench": Subcommand(
        "benchmark flash-dma against FlexAttention and SDPA (CUDA)",
        "flash_dma.benchmark.cli:add_arguments",
        "flash_dma.benchmark.cli:main",
        # transformers: the llama and firstcall suites, part of the default --suite all.
        {"matplotlib": "bench", "tqdm": "bench", "transformers": "bench"},
    ),
    "bench-cp": Subcommand(
        "benchmark context-parallel attention on several GPUs against one (CUDA)",
        "flash_dma.benchmark.cli:add_context_parallel_arguments",
        "flash_dma.benchmark.context_parallel:main",
    ),
    "selfcheck": Subcommand(
        "run attention on an example on every available backend",
        "flash_dma.selfcheck:add_arguments",
        "flash_dma.selfcheck:main",
    ),
    "precompile": Subcommand(
        "compile the kernels of named shapes and forms into Triton's cache, in parallel (CUDA)",
        "flash_dma.precompile:add_arguments",
        "flash_dma.precompile:main",
    ),
}


def load(target: str):
    """The function that ``"module:function"`` names, its module imported."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def installed_version(name: str) -> str:
    """The version of the installed distribution ``name``, read without importing it; from the module
    itself where no distribution of that name is installed (a source build, a renamed wheel)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return importlib.import_module(name).__version__


def version() -> str:
    """``flash-dma X (torch Y, triton Z)``: the versions that decide which kernels run."""
    return f"flash-dma {__version__} (torch {installed_version('torch')}, triton {installed_version('triton')})"


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


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser of every subcommand's name and help line, with the arguments of ``command`` alone:
    the others' declarations are not imported."""
    parser = argparse.ArgumentParser(prog="flash-dma", description="Trainable dynamic-mask sparse attention.")
    parser.add_argument("--version", action="version", version=version())
    commands = parser.add_subparsers(dest="command", required=True)
    for name, subcommand in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=subcommand.help, description=subcommand.help)
        if name == command:
            load(subcommand.arguments)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    missing = missing_dependencies(args.command)
    if missing:
        print(missing, file=sys.stderr)
        return MISSING_DEPENDENCY_EXIT_CODE
    return load(SUBCOMMANDS[args.command].run)(args)


if __name__ == "__main__":
    sys.exit(main())
