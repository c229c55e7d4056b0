"""Argument types and conventions shared by the ``flash-dma`` subcommands and the tools: token
lengths with K and M suffixes, fractions, the help's width, and the exit code for a missing GPU.

Imports neither torch nor the kernels: ``flash_dma.cli`` parses before it imports them.
"""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

NO_CUDA_EXIT_CODE = 2
# The suffixes a length may carry, as the suites' labels and the help write lengths (16K, 1M).
LENGTH_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20}
_LENGTH = re.compile(r"([0-9]+)([KM]?)", re.IGNORECASE)


def _comma_list(text: str, parse, expected: str) -> tuple:
    """``parse`` applied to each comma-separated item of ``text``; the error says what was expected."""
    try:
        values = tuple(parse(item.strip()) for item in text.split(",") if item.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return values


def _length(text: str) -> int:
    match = _LENGTH.fullmatch(text)
    if match is None or int(match[1]) == 0:
        raise ValueError(text)
    return int(match[1]) * LENGTH_UNITS[match[2].upper()]


def _fraction(text: str) -> float:
    try:
        value = Fraction(text)
    except ZeroDivisionError:
        raise ValueError(text) from None
    if not 0 < value <= 1:
        raise ValueError(text)
    return float(value)


def length_list(text: str) -> tuple[int, ...]:
    """Comma-separated token counts, each ``16384``, ``16K`` (x 1024) or ``1M`` (x 1024^2): the
    ``--lengths`` of every subcommand."""
    return _comma_list(text, _length, "comma-separated lengths such as 16384,16K,1M (K = 1024, M = 1024^2)")


def one_length(text: str) -> int:
    """One token count in :func:`length_list`'s forms: a tool's ``--length``."""
    lengths = length_list(text)
    if len(lengths) != 1:
        raise argparse.ArgumentTypeError(f"expected one length, got {text!r}")
    return lengths[0]


def fraction_list(text: str) -> tuple[float, ...]:
    """Comma-separated fractions in (0, 1], each ``1/8``, ``0.125`` or ``1``: the ``--keeps`` of every subcommand."""
    return _comma_list(text, _fraction, "comma-separated fractions in (0, 1] such as 1/8,0.5,1")


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def count_list(text: str) -> tuple[int, ...]:
    """Comma-separated counts, each at least 1: a tool's ``--chunks``."""
    return _comma_list(text, _count, "comma-separated counts >= 1 such as 2,4,8")


HELP_WIDTH = 100  # columns of the subcommands' help text
