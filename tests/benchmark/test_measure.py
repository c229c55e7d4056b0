"""Host time per call and the measuring budget, on the CPU with fake forwards."""

import time

import pytest
import torch
import triton.testing

from flash_dma.benchmark import measure as measure_module
from flash_dma.benchmark.measure import TimingOptions, host_time_per_call, measure, measure_host
from flash_dma.benchmark.methods import Prepared


def _busy(seconds: float) -> None:
    """Spend ``seconds`` of CPU time (``time.sleep`` would spend none)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class FakeForward:
    """A differentiable forward costing ``seconds`` of host time; counts its calls."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self.calls = 0
        self.weight = torch.ones(3, requires_grad=True)

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        _busy(self.seconds)
        return self.weight * 2


class CountingSync:
    def __init__(self):
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_host_time_is_per_call_synchronised_only_around_the_loop():
    forward, sync = FakeForward(seconds=2e-4), CountingSync()
    forward.weight.grad = torch.zeros(3)
    seen_grads = []

    def step():
        seen_grads.append(forward.weight.grad)
        forward()

    wall_ms, cpu_ms = host_time_per_call(step, (forward.weight,), calls=50, synchronize=sync)
    assert forward.calls == 50 and sync.count == 2
    assert seen_grads == [None] * 50  # reset before every call, as zero_grad(set_to_none=True) does
    # CPU time counts every thread of the process (other tests' threads under xdist too), so only
    # its lower side is certain: the fake spins its 0.2 ms on this thread.
    assert 0.2 <= wall_ms < 5 and cpu_ms >= 0.1


def test_waiting_costs_wall_time_but_no_cpu_time():
    wall_ms, cpu_ms = host_time_per_call(lambda: time.sleep(0.002), (), calls=20, synchronize=lambda: None)
    assert wall_ms >= 2 and cpu_ms < wall_ms / 2


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_measure_host_warms_up_then_times(mode):
    forward, sync = FakeForward(), CountingSync()
    m = measure_host(Prepared(forward, (forward.weight,)), mode, TimingOptions(host_calls=30), synchronize=sync)
    first_calls = 2 if mode == "fwdbwd" else 1  # make_step draws the backward's upstream gradient from a forward
    assert forward.calls == first_calls + 2 * 30  # the first call, 30 to warm up, 30 timed
    assert sync.count == 1 + 2 * 2
    assert (forward.weight.grad is not None) == (mode == "fwdbwd")
    assert m.peak_gib is None and m.ms > 0 and m.cpu_ms > 0 and m.setup_s >= 0


def test_long_calls_are_timed_at_least_min_repeats_times(monkeypatch):
    budgets = []

    def fake_do_bench(fn, warmup, rep, grad_to_none=None, return_mode="median"):
        budgets.append(rep)
        return 1.0

    def call_taking(ms):
        def peak_memory(step, leaves):
            _busy(ms / 1e3)
            return 0.5

        return peak_memory

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    prepared = Prepared(FakeForward(), ())
    options = TimingOptions(rep_ms=100, min_repeats=10)
    monkeypatch.setattr(measure_module, "peak_memory_gib", call_taking(30))
    assert measure(prepared, "fwd", cuda_graph=False, options=options).peak_gib == 0.5
    monkeypatch.setattr(measure_module, "peak_memory_gib", call_taking(0))
    measure(prepared, "fwd", cuda_graph=False, options=options)
    assert budgets[0] >= 300 and budgets[1] == 100
