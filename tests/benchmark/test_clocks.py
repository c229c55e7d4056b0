"""flash_dma/benchmark/clocks.py: nvidia-smi's lines read, described, and sampled for a stretch of
wall time by a child process (a stand-in for nvidia-smi on the CPU; the real one on the GPU)."""

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from flash_dma.benchmark.clocks import (
    Sample, clock_log, clocks_between, describe, parse_sample, reason_names, samples_between, within,
)

REPO = Path(__file__).resolve().parents[2]

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


def test_a_stretch_of_time_takes_the_samples_inside_it():
    samples = [Sample(t, 1980, 100.0, 0) for t in (1.0, 2.0, 3.0, 4.0)]
    assert within(samples, 2.0, 3.5) == samples[1:3]
    assert within(samples, 0.0, 0.5) == [] and within(samples, 1.0, 4.0) == samples


def test_a_logs_samples_are_read_as_the_child_prints_them():
    assert samples_between(0.0, time.time()) == [] and clocks_between(0.0, time.time()) == ""  # no log
    with clock_log(command=(sys.executable, "-c", FAKE_SMI), gpu="GPU-fake"):
        deadline = time.time() + 10
        while not samples_between(0.0, time.time()) and time.time() < deadline:
            pass  # the child is starting
        start = time.time()
        time.sleep(0.1)
        assert clocks_between(start, time.time()) == "1815 MHz (power cap)"
    assert samples_between(0.0, time.time()) == []  # the log ends with its block


def test_a_child_that_ends_is_reported_once(recwarn):
    ends = "print('No devices were found', flush=True); raise SystemExit(6)"
    with clock_log(command=(sys.executable, "-c", ends), gpu="GPU-fake"):
        time.sleep(0.5)
        assert samples_between(0.0, time.time()) == []
        assert samples_between(0.0, time.time()) == []
    messages = [str(w.message) for w in recwarn]
    assert len(messages) == 1 and messages[0].startswith("nvidia-smi ended (exit code 6: No devices were found)")


def test_the_child_ends_when_the_process_that_logs_dies_unannounced():
    parent = (
        "import os, sys, time\n"
        "from flash_dma.benchmark import clocks\n"
        "with clocks.clock_log(command=(sys.executable, '-c', sys.argv[1]), gpu='GPU-fake'):\n"
        "    print(clocks._LOG.get().child.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", parent, FAKE_SMI], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    child = int(process.stdout.readline())
    process.send_signal(signal.SIGKILL)  # no finally runs: only the closed pipe tells the child
    process.wait()
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:  # a zombie not yet reaped by init counts as ended
            return stat.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


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
