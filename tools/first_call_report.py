"""Which kernels the first call in a new process compiles, how long each takes, and what a warm cache saves.

Runs the ``firstcall`` suite's attention case (``flash_dma.benchmark.suites.first_call_cases``:
llm shape at 4K, block top-k, the summary built per call) in a child process, forward and
backward, first with fresh empty compiler caches, then twice with one shared cache (the second
run is the warm one). Each child records every Triton compilation
(``flash_dma.benchmark.first_call.CompileRecord``); the report lists them, cold against warm.

    python3 tools/first_call_report.py      # on a GPU
    TRITON_INTERPRET=1 python3 tools/first_call_report.py --device cpu --length 128   # the pipeline, nothing compiled
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from dataclasses import replace

from flash_dma.argument_types import one_length
from flash_dma.benchmark.first_call import ChildTimes, child_request, fresh_cache_environment, run_child
from flash_dma.benchmark.suites import first_call_cases


def _summary(label: str, times: ChildTimes) -> str:
    compiled = sum(seconds for _, seconds, hit in times.compiles if not hit)
    loaded = sum(seconds for _, seconds, hit in times.compiles if hit)
    return (f"{label}: before the call {times.before_s:.2f} s, first call {times.first_s:.2f} s; "
            f"{len(times.compiles)} kernels, {compiled:.2f} s compiling, {loaded:.2f} s loading from the cache")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd", help="the first call (default: fwdbwd)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the child's device (default: cuda)")
    parser.add_argument("--length", type=one_length, help="queries = keys of the call (default: the suite's; K = 1024)")
    args = parser.parse_args()
    case = next(c for c in first_call_cases() if c.kind == "prefill")
    if args.length is not None:
        case = replace(case, seqlen_q=args.length, seqlen_k=args.length)
    request = child_request(case, case.methods[0], args.mode, device=args.device)
    with tempfile.TemporaryDirectory(prefix="flash-dma-first-call-") as folder:
        environment = fresh_cache_environment(folder)
        cold = run_child(request, environment)
        warm = run_child(request, environment)
    print(_summary("cold caches", cold))
    print(_summary("warm caches", warm))
    # A kernel may compile more than once (one specialisation per launch signature): match them in order.
    seen: Counter = Counter()
    warm_of = {}
    for name, seconds, _ in warm.compiles:
        seen[name] += 1
        warm_of[(name, seen[name])] = seconds
    seen.clear()
    print(f"\n{'kernel':<48} {'cold (s)':>9} {'warm (s)':>9}")
    for name, seconds, _ in sorted(cold.compiles, key=lambda c: -c[1]):
        seen[name] += 1
        warm_s = warm_of.get((name, seen[name]))
        print(f"{name:<48} {seconds:>9.3f} {'-' if warm_s is None else f'{warm_s:.3f}':>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
