"""``flash-dma precompile``: its arguments, the problems they name, and the kernels it hands to the
compiler (under the interpreter, which compiles nothing, the launches its dry runs reach)."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from flash_dma import flash_dma_func, precompile
from flash_dma.backends.triton import launch
from flash_dma.argument_types import NO_CUDA_EXIT_CODE
from flash_dma.precompile import CompileRecord, Problem


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flash-dma precompile")
    precompile.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_arguments_name_every_combination_in_order():
    args = _parse("--shapes", "llm,32:8:64", "--lengths", "4K,16384", "--forms", "keys,bits,none", "--dtypes", "bf16,fp16",
                  "--backward", "--no-causal")
    problems = precompile.problems(args)
    assert args.backward and len(problems) == 2 * 2 * 3 * 2
    assert problems[0] == Problem(16, 4, 128, 4096, "keys", "bf16", causal=False)
    assert problems[1] == Problem(16, 4, 128, 4096, "keys", "fp16", causal=False)
    assert problems[-1] == Problem(32, 8, 64, 16384, "none", "fp16", causal=False)
    assert str(problems[0]) == "B1 H16 Hkv4 D128 S4096 bf16, keys"


def test_the_defaults_are_one_causal_forward():
    args = _parse()
    assert precompile.problems(args) == [Problem(16, 4, 128, 16384, "keys", "bf16", causal=True)] and not args.backward


@pytest.mark.parametrize(("argv", "message"), [
    (("--shapes", "12:5:64"), "H:Hkv:D with H a multiple of Hkv"),
    (("--shapes", "big"), "expected comma-separated shapes"),
    (("--forms", "keys,rows"), "unknown form(s) ['rows']; choose from keys, bits, bias, none"),
    (("--dtypes", "fp32"), "unknown dtype(s) ['fp32']; choose from bf16, fp16"),
    (("--lengths", "16Q"), "expected comma-separated lengths"),
], ids=["heads", "shape-name", "form", "dtype", "length"])
def test_a_bad_argument_says_what_was_expected(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert message in capsys.readouterr().err


def test_the_compile_record_keeps_name_seconds_and_cache_hit():
    record = CompileRecord()
    record(src=None, metadata={"name": "_kernel"}, metadata_group={}, times=SimpleNamespace(total=2_500_000), cache_hit=False)
    assert record.compiles == [("_kernel", 2.5, False)]


def test_without_a_gpu_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert precompile.main(_parse()) == NO_CUDA_EXIT_CODE
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.gpu_only
def test_while_autotuning_it_says_why_it_compiles_nothing(monkeypatch, capsys):
    monkeypatch.setenv("FLASH_DMA_AUTOTUNE", "1")
    assert precompile.main(_parse()) == precompile.AUTOTUNING_EXIT_CODE
    assert "FLASH_DMA_AUTOTUNE=1" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's dry run against its launches (test_launch.py compiles ahead on the GPU)")
@pytest.mark.parametrize("form", list(precompile.FORMS))
def test_it_starts_compiling_the_kernels_of_the_call(form, monkeypatch):
    """The dry run of each problem reaches the launches that the same call makes, forward and
    backward (after those that build its inputs: a BitMask's summary)."""
    import flash_dma.backends.triton as triton_backend

    monkeypatch.setattr(triton_backend, "SMALL_PROBLEM", 0)  # walked as large problems are (key lists, summaries)
    problem = Problem(4, 2, 32, 160, form, "fp16")
    with launch.dry_run() as building:
        query, key, value, mask, bias = precompile._inputs(problem, torch.device("cpu"), True)
    inputs_made = [name for name, _ in building]
    with torch.no_grad():
        for leaf in (query, key, value, bias):
            if leaf is not None:
                leaf.normal_()
    launched = []
    run = launch.Prepared.run
    monkeypatch.setattr(launch.Prepared, "run", lambda self, *tensors: launched.append(self.kernel.__name__) or run(self, *tensors))
    flash_dma_func(query, key, value, mask, bias, is_causal=True, backend="triton").sum().backward()
    launches = precompile.start_compiling([problem], True, torch.device("cpu"))
    assert [name for name, _ in launches] == inputs_made + launched and "_dq_kernel" in launched
    assert all(compilation is None for _, compilation in launches)  # the interpreter compiles nothing
