"""tools/sustained_load.py: step times window by window beside nvidia-smi's clock readings on the
GPU; on the CPU, its windows and its refusals."""

import re

import pytest

from flash_dma.benchmark.clocks import Sample
from tests.helpers import ON_GPU, run_tool
from tools.sustained_load import Run, report


def test_each_window_takes_its_steps_and_the_samples_taken_while_they_ran():
    # Four steps of 1 ms from t = 100 s, windows of two: samples at 100.0015 and 100.0035 s fall in
    # one window each, the one at 99 s (before the run) in none.
    run = Run([1.0, 1.2, 1.4, 1.6], [100.0, 100.001, 100.002, 100.003], [False, True, False, False])
    samples = [Sample(99.0, 1980, 120.0, 1), Sample(100.0015, 1980, 300.0, 0), Sample(100.0035, 1815, 650.0, 4)]
    first, second = report(run, samples, window=2)
    assert re.fullmatch(r" +steps +1- +2: +1\.1000 ms  SM 1980 MHz \(none\)  max +300\.0 W  host behind: 1", first)
    assert re.fullmatch(r" +steps +3- +4: +1\.5000 ms  SM 1815 MHz \(power cap\)  max +650\.0 W  host behind: 0", second)
    last, = report(run._replace(times_ms=[1.0, 1.2, 1.4], starts=run.starts[:3]), [], window=5)
    assert last.endswith("1.2000 ms  host behind: 1")  # no sample: the times alone


@pytest.mark.parametrize("option", ["--steps", "--window"])
def test_it_refuses_fewer_than_one(option):
    run = run_tool("sustained_load.py", option, "0")
    assert run.returncode == 2 and f"{option}: expected a count >= 1, got 0" in run.stderr


def test_it_refuses_a_negative_idle_time():
    run = run_tool("sustained_load.py", "--idle-s", "-1")
    assert run.returncode == 2 and "--idle-s: expected seconds >= 0, got -1.0" in run.stderr


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_it_refuses_to_run_without_a_gpu():
    run = run_tool("sustained_load.py", "--lengths", "4K", "--keeps", "1/8")
    assert run.returncode == 2 and "a CUDA device is needed: the steps' times are the GPU's" in run.stderr


@pytest.mark.gpu_only
def test_it_times_each_case_eager_and_replayed_window_by_window():
    run = run_tool("sustained_load.py", "--lengths", "4K", "--keeps", "1/8", "--steps", "20", "--window", "10", "--idle-s", "0", "--graph")
    assert run.returncode == 0, run.stderr
    headers = re.findall(r"== llm prefill (.+) fwdbwd, flash-dma, (\w+)", run.stdout)
    labels = ("S=4096 keep=1/8", "S=4096 keep=1/8 bias[1,16,Sq,Sk]")  # per-key bias, per-pair bias
    assert headers == [(label, how) for label in labels for how in ("eager", "graph")]
    for table in run.stdout.split("\n== ")[1:]:
        windows = re.findall(r"steps +(\d+)- +(\d+): +([\d.]+) ms.*host behind: (\d+)", table)
        assert [(first, last) for first, last, _, _ in windows] == [("1", "10"), ("11", "20")], table
        assert all(float(ms) > 0 and int(behind) <= 10 for _, _, ms, behind in windows)
