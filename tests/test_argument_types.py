"""The argument types the subcommands and tools share (``flash_dma.argument_types``); their use
as ``bench`` and ``bench-cp`` options is tested in ``tests/benchmark/test_cli.py``."""

import argparse

import pytest

from flash_dma.argument_types import count_list, fraction_list, length_list, one_length


def test_lengths_take_k_and_m_suffixes_in_either_case():
    assert length_list("128, 16K,1m") == (128, 16384, 1 << 20)


def test_fractions_take_ratios_and_decimals_in_zero_to_one():
    assert fraction_list("1/8,0.5, 1") == (0.125, 0.5, 1.0)


@pytest.mark.parametrize(
    "parse, text, expected",
    [
        (length_list, "0,16K", "comma-separated lengths such as 16384,16K,1M"),
        (length_list, "16G", "comma-separated lengths such as 16384,16K,1M"),
        (fraction_list, "3/2", "comma-separated fractions in (0, 1]"),
        (fraction_list, "1/0", "comma-separated fractions in (0, 1]"),
        (one_length, "4K,8K", "expected one length, got '4K,8K'"),
    ],
    ids=["zero-length", "unknown-suffix", "above-one", "zero-denominator", "two-lengths"],
)
def test_bad_values_are_refused_saying_what_was_expected(parse, text, expected):
    with pytest.raises(argparse.ArgumentTypeError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        parse(text)


def test_chunk_counts_take_counts_of_at_least_one():
    assert count_list("2,4,8") == (2, 4, 8)
    for text in ("0,2", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated counts >= 1"):
            count_list(text)
