"""GPU time per kernel of the benchmark's flash-dma calls: where a forward, or a forward and its
backward, spends its time on the GPU.

Each attention case of ``flash-dma bench`` that ``--suite``, ``--lengths`` and ``--keeps`` select
is run as the benchmark's ``flash-dma`` method runs it (``--method`` picks another), ``--steps``
times under ``torch.profiler``, after a warm-up; each kernel's GPU time per step is the sum over
its launches. ``--chunks`` forces the dK/dV kernel's query chunks
(``backward.forced_query_chunks``), one table per count: the chunk sweeps of
``docs/design-notes.md``. A CUDA device is needed.

    python3 tools/kernel_times.py --suite llm --lengths 16K --keeps 1/8
    python3 tools/kernel_times.py --suite llm --lengths 16K,32K --keeps 1/8 --chunks 2,4,8
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import flash_dma
from flash_dma.argument_types import count_list
from flash_dma.backends.triton.backward import forced_query_chunks
from flash_dma.benchmark.inputs import make_inputs
from flash_dma.benchmark.measure import make_step
from flash_dma.benchmark.methods import METHODS
from tools.benchmark_cases import add_case_options, selected_cases

WARMUP_STEPS = 3
NAME_WIDTH = 100  # characters of a kernel's name shown (templated CUDA kernels run to hundreds)


class KernelTime(NamedTuple):
    name: str
    us_per_step: float
    launches_per_step: float


def kernel_table(events, steps: int) -> list[KernelTime]:
    """The GPU time and launches per step of each kernel among profiler ``events`` (those of
    ``steps`` steps), longest first. Events that ran elsewhere than a GPU are left out."""
    totals: dict[str, tuple[float, int]] = {}
    for event in events:
        if event.device_type == DeviceType.CUDA:
            us, launches = totals.get(event.name, (0.0, 0))
            totals[event.name] = (us + event.device_time, launches + 1)
    rows = [KernelTime(name, us / steps, launches / steps) for name, (us, launches) in totals.items()]
    return sorted(rows, key=lambda row: -row.us_per_step)


def format_table(rows: list[KernelTime]) -> list[str]:
    lines = [f"   total {sum(row.us_per_step for row in rows):.1f} us per step"]
    lines += [f"   {row.us_per_step:9.1f} us  x{row.launches_per_step:g}  {row.name[:NAME_WIDTH]}" for row in rows]
    return lines


def time_kernels(step, leaves: tuple[torch.Tensor, ...], steps: int) -> list[KernelTime]:
    """``step`` run ``steps`` times under the profiler after a warm-up, each with the leaves'
    gradients cleared first (as ``do_bench`` does), so that no accumulation adds kernels."""

    def run() -> None:
        for leaf in leaves:
            leaf.grad = None
        step()

    for _ in range(WARMUP_STEPS):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return kernel_table(profiler.events(), steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_options(parser)
    parser.add_argument("--chunks", type=count_list, default=(None,),
                        help="comma-separated dK/dV query chunk counts, one table each (default: the library's choice)")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per table (default: 20)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps: expected a count >= 1, got {args.steps}")
    cases = selected_cases(parser, args, "the kernels' times are the GPU's")
    print(f"flash_dma from {flash_dma.__file__}; torch {torch.__version__}; {torch.cuda.get_device_name()}")
    for case in cases:
        inputs = make_inputs(case, "cuda")
        prepared = METHODS[args.method].prepare(case, inputs)
        for chunks in args.chunks:
            with forced_query_chunks(chunks):
                rows = time_kernels(make_step(prepared, args.mode), prepared.leaves, args.steps)
            chosen = "the library's choice" if chunks is None else chunks
            print(f"\n== {case.suite} {case.kind} {case.label} {args.mode}, {args.method}, dK/dV query chunks: {chosen}")
            print("\n".join(format_table(rows)))
        del inputs, prepared
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
