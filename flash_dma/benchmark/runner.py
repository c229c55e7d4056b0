"""Runs every (case, method, mode) row, one case's tensors shared by all its methods.

A row that fails (out of memory, a compiler error, an unavailable SDPA backend) becomes a
skipped row carrying the error; the run goes on. Memory is released between methods.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from tqdm import tqdm

from flash_dma.benchmark.inputs import DTYPE, Inputs, make_inputs
from flash_dma.benchmark.measure import TimingOptions, measure
from flash_dma.benchmark.methods import METHODS, Method, MethodOptions
from flash_dma.benchmark.metrics import active_pairs, attention_flops, gbps, kv_bytes, tflops
from flash_dma.benchmark.results import Result
from flash_dma.benchmark.suites import Case

_NOTE_CHARS = 300
T = TypeVar("T")


def count_rows(cases: list[Case]) -> int:
    return sum(len(case.methods) * len(case.modes) for case in cases)


def describe_error(error: BaseException) -> str:
    """``"OutOfMemoryError: CUDA out of memory. Tried to allocate ..."``: type and first line, shortened."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= _NOTE_CHARS else text[: _NOTE_CHARS - 3] + "..."


def attempt(action: Callable[[], T]) -> tuple[T | None, str | None]:
    """``(action(), None)``, or ``(None, the error described)``: a failure is recorded, never fatal.

    Returning (rather than handling the error at the call site) frees the traceback, and the
    tensors its frames hold, before the next row runs.
    """
    try:
        return action(), None
    except Exception as error:
        return None, describe_error(error)


def format_row(result: Result) -> str:
    """One log line per row, e.g. ``"llm prefill S=4096 keep=1/8 flex fwd: 0.097 ms, 12 TFLOP/s, 0.13 GiB"``."""
    head = f"{result.case.suite} {result.case.kind} {result.case.label} {result.method} {result.mode}"
    if not result.ok:
        return f"{head}: skipped ({result.note})"
    numbers = [f"{result.ms:.4g} ms", f"{result.tflops:.4g} TFLOP/s"]
    if result.gbps is not None:
        numbers.append(f"{result.gbps:.4g} GB/s")
    numbers += [f"peak {result.peak_gib:.3g} GiB", f"setup {result.setup_s:.1f} s"]
    return f"{head}: {', '.join(numbers)}"


def _run_method(
    method: Method, case: Case, inputs: Inputs, method_options: MethodOptions, timing: TimingOptions
) -> Iterator[Result]:
    """The rows of one method on one case, in the case's mode order."""
    modes = []
    for mode in case.modes:
        reason = method.skip_reason(case, mode, method_options)
        if reason is None:
            modes.append(mode)
        else:
            yield Result(case, method.name, mode, status="skipped", note=reason)
    if not modes:
        return
    mask_for_pairs = inputs.mask if method.applies_mask else None
    mask_for_bytes = inputs.mask if method.skips_masked_keys else None
    pairs = active_pairs(case.seqlen_q, case.seqlen_k, case.batch, case.heads, mask_for_pairs)
    nbytes = kv_bytes(case.seqlen_k, case.batch, case.kv_heads, case.head_dim, DTYPE.itemsize, mask_for_bytes)

    start = time.perf_counter()
    prepared, failure = attempt(lambda: method.prepare(case, inputs))
    if failure is not None:
        for mode in modes:
            yield Result(case, method.name, mode, status="skipped", note=failure)
        return
    # Preparation (block masks, Flex's mask compilation) is charged to the method's first row.
    prepare_s = time.perf_counter() - start
    for mode in modes:
        m, failure = attempt(lambda: measure(prepared, mode, cuda_graph=case.is_decode, options=timing))
        if failure is not None:
            yield Result(case, method.name, mode, status="skipped", note=failure)
            continue
        yield Result(
            case, method.name, mode,
            ms=m.ms,
            tflops=tflops(attention_flops(pairs, case.head_dim, mode), m.ms),
            gbps=gbps(nbytes, m.ms) if case.is_decode else None,
            peak_gib=m.peak_gib,
            setup_s=prepare_s + m.setup_s,
            active_pairs=pairs,
        )
        prepare_s = 0.0


def run_cases(
    cases: list[Case],
    method_options: MethodOptions = MethodOptions(),
    timing: TimingOptions = TimingOptions(),
    device: str = "cuda",
    methods: dict[str, Method] = METHODS,
    on_case_done: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """Every row of ``cases``, with a progress bar and a log line per row.

    ``on_case_done(results so far)`` runs after each case, so that a run cut short still leaves
    its finished rows behind.
    """
    results = []
    with tqdm(total=count_rows(cases), unit="row", desc="flash-dma bench", dynamic_ncols=True) as bar:
        for case in cases:
            inputs, failure = attempt(lambda: make_inputs(case, device))
            if failure is not None:
                for name in case.methods:
                    for mode in case.modes:
                        results.append(Result(case, name, mode, status="skipped", note=f"inputs: {failure}"))
                        bar.update()
                continue
            for name in case.methods:
                bar.set_postfix_str(f"{case.suite} {case.kind} {case.label} {name}")
                for result in _run_method(methods[name], case, inputs, method_options, timing):
                    results.append(result)
                    tqdm.write(format_row(result))
                    bar.update()
                torch.cuda.empty_cache()  # the method's temporaries are gone; let the next one have the memory
            del inputs
            gc.collect()  # compiled graphs can hold tensors in reference cycles
            torch.cuda.empty_cache()
            if on_case_done is not None:
                on_case_done(results)
    return results
