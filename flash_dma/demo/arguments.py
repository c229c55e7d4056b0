"""``flash-dma demo``'s arguments.

Declared apart from :mod:`flash_dma.demo.cli`, whose configurations are built from modules that
import torch, so that ``flash-dma demo --help`` answers without importing it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# How the sparse model selects keys; flash_dma.demo.cli.CONFIGS holds one set of configurations for each.
SELECTIONS = ("key", "query")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model (default: per device)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder for the plot and summary")
    parser.add_argument("--smoke", action="store_true", help="a tiny configuration that only checks the pipeline")
    parser.add_argument("--selection", choices=SELECTIONS, default="key",
                        help="how the sparse model selects keys: by a per-key bias (key, default) or per query "
                             "by a lightning indexer (query)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
