"""Runs every (case, method, mode) row, one case's tensors shared by all its methods.

A row that fails (out of memory, a compiler error, an unavailable SDPA backend) becomes a
skipped row carrying the error; the run goes on. Memory is released between methods. A case
decides how its rows are measured: GPU time, host time per call (host rows), or the first
call in a new process (first-call rows, which make their inputs in the child instead).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from tqdm import tqdm

from flash_dma.benchmark.first_call import measure_first_call
from flash_dma.benchmark.inputs import DTYPE, CacheInputs, Inputs, TokenInputs, make_inputs
from flash_dma.benchmark.measure import Measurement, TimingOptions, measure, measure_host
from flash_dma.benchmark.methods import METHODS, Method, MethodOptions, Prepared
from flash_dma.benchmark.metrics import (
    active_pairs,
    attention_flops,
    block_active_pairs,
    document_active_pairs,
    gbps,
    index_active_pairs,
    kv_bytes,
    kvcache_bytes,
    selection_active_pairs,
    tflops,
)
from flash_dma.benchmark.results import Result
from flash_dma.benchmark.suites import Case
from flash_dma.bit_mask import BitMask
from flash_dma.key_intervals import KeyIntervals

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
    numbers = [f"{result.ms:.4g} ms"]
    for value, unit in ((result.cpu_ms, "ms CPU"), (result.tflops, "TFLOP/s"), (result.gbps, "GB/s"),
                        (result.tokens_per_s, "tokens/s")):
        if value is not None:
            numbers.append(f"{value:.4g} {unit}")
    if result.peak_gib is not None:
        numbers.append(f"peak {result.peak_gib:.3g} GiB")
    numbers.append(f"setup {result.setup_s:.1f} s")
    if result.sm_clock:
        numbers.append(f"SM {result.sm_clock}")
    return f"{head}: {', '.join(numbers)}"


def count_work(
    method: Method, case: Case, inputs: Inputs | TokenInputs | CacheInputs | None
) -> tuple[int | None, int | None]:
    """``(visible (q, k) pairs, K/V bytes read)`` behind a row's TFLOP/s and GB/s (decode rows).

    None where the row's time is not attention kernels' (host time, a model, a first call).
    Packed documents count each document's own causal pairs under its selection (a padded
    method gets no credit for its padding). KV-cache rows count the bytes of K and V of the
    kept keys, the bias of every key and the mask (:func:`kvcache_bytes`).
    """
    if not case.counts_work:
        return None, None
    if case.documents is not None:
        return document_active_pairs(case.documents, case.heads, inputs.mask if method.applies_mask else None), None
    if case.uses_kv_cache:
        pairs = active_pairs(case.seqlen_q, case.seqlen_k, case.batch, case.heads, inputs.mask)
        bias = inputs.bias_cache
        return pairs, kvcache_bytes(inputs.mask, case.kv_heads, case.head_dim, DTYPE.itemsize, bias.shape[-1],
                                    bias.element_size())
    if method.applies_mask and inputs.block_mask is not None:
        pairs = block_active_pairs(inputs.block_mask, case.seqlen_q, case.seqlen_k, case.batch, case.heads)
    elif method.applies_mask and inputs.indices is not None:  # every method attends what the indices list
        pairs = index_active_pairs(inputs.indices, case.seqlen_q, case.seqlen_k, case.heads)
    elif method.applies_mask and isinstance(inputs.mask, (BitMask, KeyIntervals)):
        pairs = selection_active_pairs(inputs.mask, case.seqlen_q, case.seqlen_k, case.batch, case.heads)
    else:
        mask = inputs.mask if method.applies_mask else None
        pairs = active_pairs(case.seqlen_q, case.seqlen_k, case.batch, case.heads, mask)
    if not case.is_decode:
        return pairs, None
    mask = inputs.mask if method.skips_masked_keys else None
    return pairs, kv_bytes(case.seqlen_k, case.batch, case.kv_heads, case.head_dim, DTYPE.itemsize, mask)


def measure_row(method: Method, case: Case, prepared: Prepared | None, mode: str, timing: TimingOptions) -> Measurement:
    """The measurement the case asks for: a first call in a new process, host time, or GPU time."""
    if case.cache is not None:
        return measure_first_call(case, method.name, mode)
    if case.is_host:
        return measure_host(prepared, mode, timing)
    return measure(prepared, mode, cuda_graph=case.is_decode, options=timing)


def _run_method(
    method: Method, case: Case, inputs: Inputs | TokenInputs | None, method_options: MethodOptions,
    timing: TimingOptions,
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
    pairs, nbytes = count_work(method, case, inputs)

    start = time.perf_counter()
    # A first-call row's child process prepares the method itself.
    prepared, failure = (None, None) if case.cache else attempt(lambda: method.prepare(case, inputs))
    if failure is not None:
        for mode in modes:
            yield Result(case, method.name, mode, status="skipped", note=failure)
        return
    # Preparation (block masks, Flex's mask compilation) is charged to the method's first row.
    prepare_s = time.perf_counter() - start
    for mode in modes:
        m, failure = attempt(lambda: measure_row(method, case, prepared, mode, timing))
        if failure is not None:
            yield Result(case, method.name, mode, status="skipped", note=failure)
            continue
        yield Result(
            case, method.name, mode,
            ms=m.ms,
            tflops=None if pairs is None else tflops(attention_flops(pairs, case.head_dim, mode), m.ms),
            gbps=None if nbytes is None else gbps(nbytes, m.ms),
            peak_gib=m.peak_gib,
            setup_s=prepare_s + m.setup_s,
            active_pairs=pairs,
            cpu_ms=m.cpu_ms,
            tokens_per_s=None if case.generated_tokens is None else case.generated_tokens / (m.ms * 1e-3),
            sm_clock=m.sm_clock,
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
            # First-call rows make their inputs in the child process.
            inputs, failure = (None, None) if case.cache else attempt(lambda: make_inputs(case, device))
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
