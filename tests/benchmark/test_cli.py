import argparse
from pathlib import Path

import pytest
import torch

from flash_dma import cli
from flash_dma.benchmark.cli import add_arguments


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults():
    args = _parse()
    assert (args.suite, args.mode, args.methods, args.out) == ("all", "both", None, Path("benchmarks/results"))
    assert (args.quick, args.flex_decode, args.warmup_ms, args.rep_ms, args.host_calls) == (False, False, 250, 100, 1000)


@pytest.mark.parametrize("suite", ["llm", "topkq", "token", "seed", "host", "llama", "firstcall", "all"])
def test_every_suite_can_be_chosen(suite):
    assert _parse("--suite", suite, "--quick").suite == suite


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
