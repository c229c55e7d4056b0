"""The first call in a new process, cold and warm, with and without compiling ahead, and after ``flash-dma precompile``.

One command on the GPU machine (about two minutes on an H100):

    PYTHONPATH=. python3 tools/first_call_check.py

Each row is a child process (``flash_dma.benchmark.first_call``) making the first call of the
``firstcall`` suite's attention case, at S=16K unless ``--length`` says otherwise: the llm shape,
bf16, causal, a per-key bias and its block top-k 1/8 as a per-key mask, without ``block_mask``
(so the call builds its key list). It times the forward, then the backward.

1. Compiling ahead on, then off (``FLASH_DMA_COMPILE_AHEAD=0``): a child on an empty Triton cache
   (cold), then one on the cache it filled (warm).
2. ``flash-dma precompile`` of the same shape, length, form and dtype, backward included, into
   another empty cache, timed; then a child on that cache, which must compile no kernel.

Prints the table, the cold children's compilations, and a PASS or MISS line for the cold first
forward + backward with compiling ahead (<= 5 s) and for the call after precompile (no kernel
compiled). Exits 1 if either misses. ``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the children
under the interpreter, which compiles nothing, and leaves precompile and the checks out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from flash_dma.argument_types import one_length
from flash_dma.benchmark.first_call import ChildTimes, child_request, fresh_cache_environment, run_child
from flash_dma.benchmark.suites import first_call_cases, format_fraction

COLD_LIMIT_S = 5.0  # issue 45: the cold first forward + backward on a fresh H100
PRECOMPILE_TIMEOUT_S = 600


def _row(caches: str, ahead: str, times: ChildTimes) -> str:
    backward_s = times.first_s - times.forward_s
    return (f"| {caches} | {ahead} | {times.forward_s:.2f} | {backward_s:.2f} | {times.first_s:.2f} | "
            f"{times.compiled} of {len(times.compiles)} | {times.before_s:.2f} |")


def _compilations(label: str, times: ChildTimes) -> str:
    compiled = sorted(((seconds, name) for name, seconds, hit in times.compiles if not hit), reverse=True)
    listed = ", ".join(f"{name} {seconds:.2f}" for seconds, name in compiled) or "none"
    return f"{label}: {listed} (s; kernels compiled side by side overlap)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=one_length, default="16K",
                        help="queries = keys of the call (default: %(default)s; K = 1024)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the children's device (default: cuda)")
    args = parser.parse_args()
    attention = next(c for c in first_call_cases() if c.kind == "prefill")
    case = replace(attention, seqlen_q=args.length, seqlen_k=args.length, modes=("fwdbwd",), cache="cold")
    request = child_request(case, case.methods[0], "fwdbwd", device=args.device)
    print(f"first call in a new process: B{case.batch} H{case.heads} Hkv{case.kv_heads} D{case.head_dim} "
          f"S={case.seqlen_k}, causal, per-key bias and block top-k {format_fraction(case.keep)} ({case.methods[0]}), "
          "forward then backward")
    rows, cold = [], {}
    with tempfile.TemporaryDirectory(prefix="flash-dma-first-call-") as folder:
        for ahead, label in (("1", "on"), ("0", "off")):
            environment = {**fresh_cache_environment(os.path.join(folder, f"ahead-{ahead}")), "FLASH_DMA_COMPILE_AHEAD": ahead}
            cold[label] = run_child(request, environment)
            rows += [_row("cold", label, cold[label]), _row("warm", label, run_child(request, environment))]
        after = precompile_s = None
        if args.device == "cuda":
            environment = fresh_cache_environment(os.path.join(folder, "precompiled"))
            command = [sys.executable, "-m", "flash_dma.cli", "precompile", "--shapes", "llm", "--lengths", str(args.length),
                       "--forms", "keys", "--dtypes", "bf16", "--backward"]
            start = time.perf_counter()
            subprocess.run(command, env=environment, check=True, timeout=PRECOMPILE_TIMEOUT_S)
            precompile_s = time.perf_counter() - start
            after = run_child(request, environment)
            rows.append(_row("after precompile", "on", after))
    print("\n| caches | compile ahead | forward s | backward s | fwd+bwd s | kernels compiled | before the call s |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    for label, times in cold.items():
        print(_compilations(f"cold, compiling ahead {label}", times))
    if after is None:
        return 0  # under the interpreter: no time to check, nothing precompiled
    slow = cold["on"].first_s > COLD_LIMIT_S
    print(f"\n{'MISS' if slow else 'PASS'} cold first fwd+bwd, compiling ahead: {cold['on'].first_s:.2f} s (<= {COLD_LIMIT_S:g} s)")
    print(f"{'MISS' if after.compiled else 'PASS'} first call after precompile ({precompile_s:.1f} s, a new process "
          f"included): {after.compiled} kernels compiled, {len(after.compiles) - after.compiled} loaded from the cache")
    return int(slow or after.compiled > 0)


if __name__ == "__main__":
    raise SystemExit(main())
