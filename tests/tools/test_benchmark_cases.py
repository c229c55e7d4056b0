"""tools/benchmark_cases.py: the benchmark's attention cases a tool's options pick, and its
refusals: no such case, or no GPU to time them on."""

import argparse

import pytest

from tests.helpers import ON_GPU
from tools.benchmark_cases import add_case_options, selected_cases


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    add_case_options(parser)
    return parser


def test_the_options_default_to_the_llm_suites_forward_and_backward_by_flash_dma():
    args = _parser().parse_args([])
    assert (args.suite, args.lengths, args.keeps, args.mode, args.method) == ("llm", None, None, "fwdbwd", "flash-dma")


def test_options_that_pick_no_case_are_refused(capsys):
    parser = _parser()
    with pytest.raises(SystemExit) as exit:
        selected_cases(parser, parser.parse_args(["--lengths", "3K"]), "times")
    assert exit.value.code == 2
    assert "no attention case of suite llm runs flash-dma with those lengths and keeps" in capsys.readouterr().err


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_a_machine_without_a_gpu_is_refused(capsys):
    parser = _parser()
    with pytest.raises(SystemExit) as exit:
        selected_cases(parser, parser.parse_args(["--lengths", "4K", "--keeps", "1/8"]), "the kernels' times are the GPU's")
    assert exit.value.code == 2
    assert "a CUDA device is needed: the kernels' times are the GPU's" in capsys.readouterr().err


@pytest.mark.gpu_only
def test_the_attention_cases_of_the_lengths_and_keeps_are_picked():
    parser = _parser()
    cases = selected_cases(parser, parser.parse_args(["--lengths", "4K", "--keeps", "1/8"]), "times")
    assert [case.label for case in cases] == ["S=4096 keep=1/8", "S=4096 keep=1/8 bias[1,16,Sq,Sk]"]
    assert all(case.counts_work and case.seqlen_k == 4096 for case in cases)
