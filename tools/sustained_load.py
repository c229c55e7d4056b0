"""Step time under sustained load, window by window, beside the SM clock, the power draw and the
reasons for a lowered clock that ``nvidia-smi`` reports: whether a step's time is the GPU's at its
full clock, at a power-capped clock, or the host's.

Each attention case of ``flash-dma bench`` that ``--suite``, ``--lengths`` and ``--keeps`` select
runs ``--steps`` times back to back, after ``--idle-s`` seconds with the GPU idle (its clock and
power recover) and with the host held ahead of the GPU (a ``torch.cuda._sleep`` queued first).
Each step is timed by its own pair of events, the L2 cache cleared and the leaves' gradients set
to None before it, as ``triton.testing.do_bench`` times the benchmark's rows. Printed per window of
``--window`` steps: the median step time, what ``nvidia-smi`` sampled while the GPU ran them (SM
clocks, the clock event reasons, the largest power draw it read, as it averages it), and before
how many steps the GPU had already finished the previous one (the host behind it). ``--graph``
runs each case a second time as the replay of one CUDA graph capture (the gradients by
``torch.autograd.grad``, so that nothing is added into a leaf's ``.grad``). A CUDA device is
needed.

    python3 tools/sustained_load.py --suite llm --lengths 16K,32K --keeps 1/8 --graph
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

import flash_dma
from flash_dma.benchmark.clocks import Sample, clock_log, describe, samples_between, within
from flash_dma.benchmark.inputs import make_inputs
from flash_dma.benchmark.measure import capture_graph, make_step
from flash_dma.benchmark.methods import METHODS, Prepared
from flash_dma.benchmark.suites import Case
from tools.benchmark_cases import add_case_options, selected_cases

HEAD_START_CYCLES = 50_000_000  # the GPU spins this long (25 ms at 2 GHz) while the host queues steps ahead


def window_line(first: int, times_ms: list[float], samples: list[Sample], host_behind: int) -> str:
    """One window's line: steps ``first``.. (1-based) of ``times_ms``, the samples taken while the
    GPU ran them, and the count of its steps the host issued after the GPU had run dry."""
    line = f"   steps {first:4d}-{first + len(times_ms) - 1:4d}: {statistics.median(times_ms):8.4f} ms"
    if samples:
        line += f"  SM {describe(samples)}  max {max(sample.watts for sample in samples):6.1f} W"
    return line + f"  host behind: {host_behind}"


class Run(NamedTuple):
    times_ms: list[float]  # each step's, from its first event to its second
    starts: list[float]  # each step's start on the GPU, in seconds since the epoch
    host_behind: list[bool]  # per step: the GPU had finished the step before when it was issued


def sustained_run(step: Callable[[], object], leaves: tuple[torch.Tensor, ...], steps: int, idle_s: float) -> Run:
    driver = triton.runtime.driver.active  # the L2 cache cleared as do_bench clears it
    cache = driver.get_empty_cache_for_benchmark()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    behind = []
    torch.cuda.synchronize()
    time.sleep(idle_s)
    torch.cuda._sleep(HEAD_START_CYCLES)
    for i in range(steps):
        behind.append(i > 0 and ends[i - 1].query())
        driver.clear_cache(cache)
        for leaf in leaves:
            leaf.grad = None
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize()
    finished = time.time()  # the last event's time, to the host's wake-up
    return Run(
        [start.elapsed_time(end) for start, end in zip(starts, ends)],
        [finished - start.elapsed_time(ends[-1]) / 1e3 for start in starts],
        behind,
    )


def captured(prepared: Prepared, mode: str) -> Callable[[], object]:
    """The replay of a CUDA graph of one step (``measure.capture_graph``), whose backward returns
    the gradients rather than adding them up."""
    if mode == "fwd":
        return capture_graph(prepared.forward)[0].replay
    dout = torch.randn_like(prepared.forward())
    return capture_graph(lambda: torch.autograd.grad(prepared.forward(), prepared.leaves, dout))[0].replay


def report(run: Run, samples: list[Sample], window: int) -> list[str]:
    lines = []
    ends = [start + ms / 1e3 for start, ms in zip(run.starts, run.times_ms)]
    for first in range(0, len(run.times_ms), window):
        last = min(first + window, len(run.times_ms)) - 1
        inside = within(samples, run.starts[first], ends[last])
        lines.append(window_line(first + 1, run.times_ms[first:last + 1], inside, sum(run.host_behind[first:last + 1])))
    return lines


def run_case(case: Case, args: argparse.Namespace) -> None:
    prepared = METHODS[args.method].prepare(case, make_inputs(case, "cuda"))
    step = make_step(prepared, args.mode)
    step()  # compiles, and sizes the caching allocator's pool
    runs = [("eager", step)] + ([("graph", captured(prepared, args.mode))] if args.graph else [])
    for label, fn in runs:
        run = sustained_run(fn, prepared.leaves, args.steps, args.idle_s)
        samples = samples_between(run.starts[0], run.starts[-1] + run.times_ms[-1] / 1e3)
        print(f"\n== {case.suite} {case.kind} {case.label} {args.mode}, {args.method}, {label}")
        print("\n".join(report(run, samples, args.window)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_options(parser)
    parser.add_argument("--steps", type=int, default=600, help="steps run back to back per case (default: 600)")
    parser.add_argument("--window", type=int, default=50, help="steps per printed line (default: 50)")
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds the GPU idles before each run (default: 3)")
    parser.add_argument("--graph", action="store_true", help="run each case a second time as a CUDA graph's replay")
    args = parser.parse_args()
    for name in ("steps", "window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a count >= 1, got {getattr(args, name)}")
    if args.idle_s < 0:
        parser.error(f"--idle-s: expected seconds >= 0, got {args.idle_s}")
    cases = selected_cases(parser, args, "the steps' times are the GPU's")
    print(f"flash_dma from {flash_dma.__file__}; torch {torch.__version__}; {torch.cuda.get_device_name()}")
    with clock_log():
        for case in cases:
            run_case(case, args)
            torch.cuda.empty_cache()  # the case's tensors and graph went with run_case's frame
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
