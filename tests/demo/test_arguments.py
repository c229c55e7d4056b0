"""``flash-dma demo``'s arguments, declared apart from the configurations they choose."""

import argparse
from pathlib import Path

from flash_dma.demo import cli as demo_cli
from flash_dma.demo.arguments import SELECTIONS, add_arguments


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_every_selection_has_its_configurations():
    assert tuple(demo_cli.CONFIGS) == SELECTIONS


def test_defaults_and_a_query_selection():
    args = _parse()
    assert (args.device, args.steps, args.seed, args.out, args.smoke, args.selection, args.quiet) == (
        "cpu", None, 0, Path("demo_out"), False, "key", False
    )
    assert _parse("--selection", "query").selection == "query"
