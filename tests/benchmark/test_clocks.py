"""flash_dma/benchmark/clocks.py: nvidia-smi's lines read, described, and sampled for a stretch of
wall time by a child process (a stand-in for nvidia-smi on the CPU; the real one on the GPU)."""

import sys
import time
from datetime import datetime

import pytest
import torch

from flash_dma.benchmark.clocks import Sample, clock_log, clocks_between, describe, parse_sample, reason_names, samples_between

# Prints one sample line every 10 ms, stamped now, in nvidia-smi's format; its arguments are ignored.
FAKE_SMI = (
    "import datetime, sys, time\n"
    "while True:\n"
    "    now = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
    "    print(f'{now}, 1815, 650.5, 0x0000000000000004', flush=True)\n"
    "    time.sleep(0.01)\n"
)


def test_a_sample_line_is_read_and_anything_else_is_not():
    stamp = datetime(2026, 11, 30, 9, 1, 2, 125000).timestamp()
    assert parse_sample("2026/11/30 09:01:02.125, 1815, 558.46, 0x0000000000000004\n") == Sample(stamp, 1815, 558.46, 4)
    assert parse_sample("2026/11/30 09:01:02.125, 1815, [N/A], 0x0000000000000004") is None
    assert parse_sample("timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active") is None
    assert parse_sample("") is None


def test_reasons_are_named_bit_by_bit():
    assert reason_names(0) == "none"
    assert reason_names(0x4) == "power cap"
    assert reason_names(0x1 | 0x40) == "idle, hardware thermal"


def test_samples_are_described_by_their_clocks_and_every_reason_given():
    assert describe([]) == ""
    assert describe([Sample(0.0, 1980, 120.0, 0)]) == "1980 MHz (none)"
    assert describe([Sample(0.0, 1815, 600.0, 4), Sample(0.1, 1800, 700.0, 4), Sample(0.2, 1980, 300.0, 0)]) == (
        "1800-1980 MHz (power cap)"
    )


def test_a_stretch_of_time_gets_the_samples_taken_in_it_and_none_outside_a_log():
    assert samples_between(0.0, time.time()) == [] and clocks_between(0.0, time.time()) == ""
    with clock_log(command=(sys.executable, "-c", FAKE_SMI), gpu="GPU-fake"):
        time.sleep(0.3)
        start = time.time()
        time.sleep(0.2)
        end = time.time()
        samples = samples_between(start, end)
        assert 5 <= len(samples) <= 25, samples
        assert all(start <= sample.seconds <= end for sample in samples)
        assert clocks_between(start, end) == "1815 MHz (power cap)"
    assert samples_between(start, end) == []  # the log ends with its block


def test_without_nvidia_smi_a_log_has_no_samples():
    with clock_log(command=("/nonexistent/nvidia-smi",), gpu="GPU-fake"):
        assert samples_between(0.0, time.time()) == []


@pytest.mark.gpu_only
def test_the_gpus_clock_is_sampled_while_it_works():
    with clock_log():
        start = time.time()
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        while time.time() - start < 0.3:
            a @ a
        torch.cuda.synchronize()
        samples = samples_between(start, time.time())
    assert samples and all(500 <= sample.sm_mhz <= 3000 for sample in samples)
