import argparse
import re
from pathlib import Path

import pytest
import torch

from flash_dma import cli
from flash_dma.benchmark.cli import add_arguments
from flash_dma.benchmark.suites import SUITES


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults():
    args = _parse()
    assert (args.suite, args.mode, args.methods, args.out) == ("all", "both", None, Path("benchmarks/results"))
    assert (args.quick, args.flex_decode, args.warmup_ms, args.rep_ms, args.host_calls) == (False, False, 250, 100, 1000)


@pytest.mark.parametrize("suite", [*SUITES, "all"])
def test_every_suite_can_be_chosen(suite):
    assert _parse("--suite", suite, "--quick").suite == suite


def test_help_describes_the_command_and_every_suite(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "Time flash-dma against FlexAttention and PyTorch SDPA" in text
    listed = re.findall(r"^  (\w+) {2,}\S", text.split("suites (--suite NAME")[1], re.MULTILINE)
    assert listed == list(SUITES)


def test_methods_are_validated():
    assert _parse("--methods", "flex, flash-dma").methods == ("flex", "flash-dma")
    assert _parse("--methods", "sdpa,llama-sdpa,llama-flash-dma").methods == ("sdpa", "llama-sdpa", "llama-flash-dma")
    with pytest.raises(SystemExit):
        _parse("--methods", "flex,fa4")
    with pytest.raises(SystemExit):
        _parse("--suite", "gpt")


def test_lengths_and_keeps_are_parsed():
    args = _parse("--lengths", "16384,32768", "--keeps", "1/8, 1")
    assert (args.lengths, args.keeps) == ((16384, 32768), (0.125, 1.0))
    assert (_parse().lengths, _parse().keeps) == (None, None)
    for bad in (("--lengths", "16K"), ("--keeps", "1/0"), ("--keeps", "an eighth")):
        with pytest.raises(SystemExit):
            _parse(*bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on machines without a GPU")
def test_bench_without_cuda_exits_2_with_a_clear_message(capsys, tmp_path):
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU is available" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
