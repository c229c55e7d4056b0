"""Host time per call of ``flash_dma_func`` at the benchmark's host shape, and where it goes.

The calls are the ``host`` suite's flash-dma rows (``flash_dma.benchmark.suites.host_cases``:
S=128, B=1, H=2, Hkv=1, D=64, causal, the seeds' per-key mask and bias, and a bare call), issued
back to back and timed as the suite times them (``measure.host_time_per_call``); then the same
calls under ``cProfile``, their time split by where it is spent (validation, the Triton
backend's Python, autograd, allocations, launches).

    python3 tools/host_profile.py                  # on a GPU: the real calls
    TRITON_INTERPRET=1 python tools/host_profile.py --stub   # on the CPU: launches stubbed

With ``--stub`` the kernels' launches do nothing and the routing table is told the device is a
Hopper, so what is timed is the Python of the path an H100 takes, without its GPU work, CUDA
allocations or launch calls. The script imports whichever ``flash_dma`` is first on the path, so
that two checkouts can be compared (``PYTHONPATH=other/checkout``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import flash_dma
from flash_dma.benchmark.inputs import make_inputs
from flash_dma.benchmark.measure import host_time_per_call, make_step
from flash_dma.benchmark.methods import FlashDma
from flash_dma.benchmark.suites import host_cases

# Where profiled time is counted, first match wins: (part, what a function's file or name holds).
PARTS = (
    ("validation (inputs.py)", ("flash_dma/inputs.py",)),
    ("kernel launch (Triton's launcher)", ("triton_launcher", "built-in method launch>", "triton/backends", "triton/compiler")),
    ("allocations (empty, zeros)", ("torch.empty", "torch.zeros", "new_zeros", "new_empty", "empty_like", "zeros_like")),
    ("Triton backend Python", ("flash_dma/backends/triton",)),
    ("other flash-dma Python", ("flash_dma/",)),
    ("autograd (Function.apply, engine)", ("torch/autograd", "run_backward", "built-in method apply", "torch/_functorch")),
    ("tensor attributes and small torch ops (stride, data_ptr, view, ...)", ("torch",)),
)


def stub_launches() -> None:
    """Launch nothing, and route as on a Hopper GPU (the interpreter's own routing is the generic kernels')."""
    from flash_dma.backends.triton import dispatch, launch

    launch.Prepared.run = lambda self, tensors, addresses: None
    dispatch.device_kind = lambda device: "hopper"


def part_of(function: tuple) -> str:
    name = "{}:{}({})".format(*function)
    return next((part for part, marks in PARTS if any(mark in name for mark in marks)), "other")


def breakdown(stats: pstats.Stats, calls: int) -> dict[str, float]:
    """Profiled time per call (us) by part: each function's own time, counted once."""
    parts: dict[str, float] = {}
    for function, (_, _, own, _, _) in stats.stats.items():
        part = part_of(function)
        parts[part] = parts.get(part, 0.0) + own * 1e6 / calls
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timing and per profile (default: 2000)")
    parser.add_argument("--top", type=int, default=25, help="functions listed per profile, by own time (default: 25)")
    parser.add_argument("--stub", action="store_true", help="stub the launches and route as on a Hopper (CPU runs)")
    args = parser.parse_args()
    if args.stub:
        stub_launches()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.stub else "cpu")
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"flash_dma from {flash_dma.__file__}; torch {torch.__version__}; device {device}; stub {args.stub}")
    for case in host_cases():
        prepared = FlashDma(reuse_block_mask=True, backend="triton").prepare(case, make_inputs(case, device))
        for mode in ("fwd", "fwdbwd"):
            step = make_step(prepared, mode)
            host_time_per_call(step, prepared.leaves, args.calls, synchronize)  # warm-up
            wall_ms, cpu_ms = host_time_per_call(step, prepared.leaves, args.calls, synchronize)
            profile = cProfile.Profile()
            profile.enable()
            host_time_per_call(step, prepared.leaves, args.calls, synchronize)
            profile.disable()
            stats = pstats.Stats(profile)
            parts = breakdown(stats, args.calls)
            total = sum(parts.values())
            label = f"mask={case.mask} bias={case.bias} {mode}"
            print(f"\n== {label}: {wall_ms * 1e3:.1f} us per call (CPU {cpu_ms * 1e3:.1f} us)")
            print(f"   profiled {total:.1f} us per call; its parts, scaled to the unprofiled {wall_ms * 1e3:.1f} us:")
            for part, us in sorted(parts.items(), key=lambda item: -item[1]):
                print(f"   {us / total * wall_ms * 1e3:7.1f} us  {100 * us / total:5.1f} %  {part}")
            stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
