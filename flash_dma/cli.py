"""The ``flash-dma`` command: ``demo``, ``bench`` and ``selfcheck``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``;
modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": ("flash_dma.demo.cli", "train a small model on a long-context recall task, sparse vs dense"),
    "bench": ("flash_dma.benchmark.cli", "benchmark flash-dma against FlexAttention and SDPA (CUDA)"),
    "selfcheck": ("flash_dma.selfcheck", "run attention on an example on every available backend"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flash-dma", description="Trainable dynamic-mask sparse attention.")
    commands = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        # Only the chosen subcommand's module is imported (the others may need optional extras).
        if argv and argv[0] == name:
            importlib.import_module(module).add_arguments(sub)
    args = parser.parse_args(argv)
    return importlib.import_module(SUBCOMMANDS[args.command][0]).main(args)


if __name__ == "__main__":
    sys.exit(main())
