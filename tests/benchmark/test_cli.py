import argparse
import re
from pathlib import Path

import pytest
import torch

from flash_dma import cli
from flash_dma.benchmark.cli import add_arguments, add_context_parallel_arguments, method_names
from flash_dma.benchmark.methods import METHODS
from flash_dma.benchmark.suites import SUITES

# Every subcommand that takes --lengths and --keeps: each takes the same forms.
WITH_LENGTHS = {"bench": add_arguments, "bench-cp": add_context_parallel_arguments}


def _parse(*argv, arguments=add_arguments):
    parser = argparse.ArgumentParser()
    arguments(parser)
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


def test_the_methods_taken_are_those_the_suites_run():
    assert set(method_names()) == set(METHODS)


def test_methods_are_validated():
    assert _parse("--methods", "flex, flash-dma").methods == ("flex", "flash-dma")
    assert _parse("--methods", "sdpa,llama-sdpa,llama-flash-dma").methods == ("sdpa", "llama-sdpa", "llama-flash-dma")
    with pytest.raises(SystemExit):
        _parse("--methods", "flex,fa4")
    with pytest.raises(SystemExit):
        _parse("--suite", "gpt")


@pytest.mark.parametrize("command", list(WITH_LENGTHS))
def test_lengths_and_keeps_take_suffixes_and_fractions(command):
    args = _parse("--lengths", "16384, 16K,1m", "--keeps", "1/8, 0.5,1", arguments=WITH_LENGTHS[command])
    assert (args.lengths, args.keeps) == ((16384, 16384, 1 << 20), (0.125, 0.5, 1.0))


@pytest.mark.parametrize("command", list(WITH_LENGTHS))
@pytest.mark.parametrize(
    "option, value",
    [("--lengths", "16Q"), ("--lengths", "1.5K"), ("--lengths", "0"), ("--lengths", ""),
     ("--keeps", "1/0"), ("--keeps", "an eighth"), ("--keeps", "2"), ("--keeps", "0")],
)
def test_bad_lengths_and_keeps_are_refused_naming_the_option(capsys, command, option, value):
    with pytest.raises(SystemExit):
        _parse(option, value, arguments=WITH_LENGTHS[command])
    error = capsys.readouterr().err
    assert f"argument {option}: expected comma-separated" in error and f"got {value!r}" in error


def test_bench_filters_nothing_by_default():
    assert (_parse().lengths, _parse().keeps) == (None, None)


def test_bench_cp_accepts_its_defaults_as_its_help_shows_them(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench-cp", "--help"])
    options = " ".join(capsys.readouterr().out.split("show this help message and exit")[1].split())
    shown = {option: re.search(rf"{option} [A-Z]+ [^(]*\(default: ([^;)]+)", options).group(1)
             for option in ("--lengths", "--keeps")}
    assert shown == {"--lengths": "256K,1M", "--keeps": "1/8,1"}
    typed = _parse(*(item for pair in shown.items() for item in pair), arguments=add_context_parallel_arguments)
    default = _parse(arguments=add_context_parallel_arguments)
    assert (typed.lengths, typed.keeps) == (default.lengths, default.keeps) == ((262144, 1048576), (0.125, 1.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on machines without a GPU")
@pytest.mark.parametrize(
    "argv", [["bench", "--quick"], ["bench-cp", "--lengths", "256K,1M", "--keeps", "1/8,1"]], ids=["bench", "bench-cp"]
)
def test_without_cuda_exits_2_with_a_clear_message(capsys, tmp_path, argv):
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU is available" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
