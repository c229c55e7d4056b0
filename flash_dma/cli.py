"""The ``flash-dma`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flash-dma", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    selfcheck = commands.add_parser("selfcheck", help="run attention on an example on every available backend")
    selfcheck.add_argument("--device", default=None)
    args = parser.parse_args(argv)

    if args.command == "selfcheck":
        from flash_dma.selfcheck import run

        return 0 if run(args.device) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
