"""tools/kernel_times.py: each kernel's GPU time per step, by query chunk count on the GPU; on the
CPU, its table from profiler events and its refusal to run."""

import re
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from tests.helpers import run_tool
from tools.kernel_times import KernelTime, kernel_table


def test_kernel_table_adds_each_kernels_launches_per_step_longest_first():
    def event(name, us, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_time=us, device_type=device)

    events = [event("dq", 30.0), event("fill", 1.0), event("dq", 34.0), event("fill", 3.0), event("dkdv", 80.0),
              event("aten::add", 500.0, DeviceType.CPU)]
    assert kernel_table(events, steps=2) == [KernelTime("dkdv", 40.0, 0.5), KernelTime("dq", 32.0, 1.0), KernelTime("fill", 2.0, 1.0)]


def test_it_refuses_fewer_than_one_step():
    run = run_tool("kernel_times.py", "--steps", "0")
    assert run.returncode == 2 and "--steps: expected a count >= 1, got 0" in run.stderr


@pytest.mark.gpu_only
def test_it_times_the_dkdv_kernel_for_each_forced_chunk_count():
    run = run_tool("kernel_times.py", "--lengths", "4K", "--keeps", "1/8", "--chunks", "1,2", "--steps", "2")
    assert run.returncode == 0, run.stderr
    headers = re.findall(r"== llm prefill (.+) fwdbwd, flash-dma, dK/dV query chunks: (\d+)", run.stdout)
    labels = ("S=4096 keep=1/8", "S=4096 keep=1/8 bias[1,16,Sq,Sk]")  # per-key bias, per-pair bias
    assert headers == [(label, chunks) for label in labels for chunks in ("1", "2")]
    tables = run.stdout.split("\n== ")[1:]
    for table in tables:
        total = float(re.search(r"total ([\d.]+) us per step", table).group(1))
        times = [float(t) for t in re.findall(r"^\s+([\d.]+) us  x", table, re.MULTILINE)]
        assert total > 0 and abs(sum(times) - total) <= 0.1 * len(times)
        assert re.search(r"us  x1  _dkdv\w*_kernel", table), table
