"""Measuring one row: warm-up, peak memory, then the median time of many calls (CUDA only);
or, for host rows, the host's time per call with the GPU's work excluded."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flash_dma.benchmark.clocks import clocks_between
from flash_dma.benchmark.methods import Prepared


@dataclass(frozen=True)
class TimingOptions:
    """How rows are timed.

    Attributes:
        warmup_ms, rep_ms: ``triton.testing.do_bench``'s warm-up and measuring budgets. The
            warm-up is long because the GPU clocks down while a row's setup compiles: after 25 ms
            the first rows of a process read up to 1.5x high (H100, the same kernel measured twice).
        min_repeats: calls timed at least, whatever ``rep_ms`` allows: a 100 ms call (llm 128K
            forward + backward, a Llama step) would otherwise be timed once.
        host_calls: calls issued back to back per host row.
    """

    warmup_ms: int = 250
    rep_ms: int = 100
    min_repeats: int = 10
    host_calls: int = 1000


@dataclass(frozen=True)
class Measurement:
    """``ms``: time of one call (the median on the GPU; the mean host time for host rows; the
    first call's for first-call rows); ``peak_gib``: memory one call allocates beyond what existed
    before (inputs excluded), or None; ``setup_s``: wall time before the timed calls (compilation,
    autotuning); ``cpu_ms``: host rows' CPU time per call; ``sm_clock``: the SM clock while the
    GPU rows' calls were timed, and why it was lowered (``clocks.describe``; ``""`` unsampled)."""

    ms: float
    peak_gib: float | None
    setup_s: float
    cpu_ms: float | None = None
    sm_clock: str = ""


def make_step(prepared: Prepared, mode: str) -> Callable[[], object]:
    """The timed unit: one forward (``"fwd"``), or a forward and its backward (``"fwdbwd"``).

    The backward produces the gradients of every leaf (q, k, v and the bias). Its upstream
    gradient is drawn once, from a first forward call that doubles as warm-up.
    """
    if mode == "fwd":
        return prepared.forward
    if mode != "fwdbwd":
        raise ValueError(f"mode: expected 'fwd' or 'fwdbwd', got {mode!r}")
    dout = torch.randn_like(prepared.forward())

    def forward_backward() -> None:
        prepared.forward().backward(dout)

    return forward_backward


def peak_memory_gib(step: Callable[[], object], leaves: tuple[torch.Tensor, ...]) -> float:
    """Peak memory one call of ``step`` allocates beyond what was allocated before it."""
    for t in leaves:
        t.grad = None  # as in the timed loop: the backward allocates fresh gradients
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def capture_graph(step: Callable[[], object], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """``step`` captured once in a CUDA graph, and what the captured call returned (the memory each
    replay writes). It runs ``warmup`` times on a side stream first, as PyTorch's
    whole-network capture does: compilation, autotuning and the caching allocator's first blocks
    stay out of the capture, and a backward's leaves are not tied to the default stream. A step
    whose backward adds into ``.grad`` would replay those additions too: pass one that returns
    its gradients (``torch.autograd.grad``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output


def graph_replay_ms(step: Callable[[], object], options: TimingOptions) -> float:
    """Median time of ``step`` captured once in a CUDA graph (:func:`capture_graph`): decode-sized
    calls without launch overhead."""
    from triton.testing import do_bench

    return do_bench(capture_graph(step)[0].replay, warmup=options.warmup_ms, rep=options.rep_ms, return_mode="median")


def measure(prepared: Prepared, mode: str, cuda_graph: bool, options: TimingOptions) -> Measurement:
    """Warm up, then measure the peak memory of one call and the median time of many: ``rep_ms``
    worth, and at least ``min_repeats``.

    ``do_bench`` clears the L2 cache before every call and sets the leaves' gradients to None.
    """
    from triton.testing import do_bench

    start = time.perf_counter()
    step = make_step(prepared, mode)
    step()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    peak_gib = peak_memory_gib(step, prepared.leaves)
    call_ms = (time.perf_counter() - start) * 1e3  # one synchronised call: sizes the measuring budget
    options = replace(options, rep_ms=max(options.rep_ms, options.min_repeats * call_ms))
    if cuda_graph:
        ms = graph_replay_ms(step, options)
    else:
        grads = list(prepared.leaves) if mode == "fwdbwd" else None
        ms = do_bench(step, warmup=options.warmup_ms, rep=options.rep_ms, grad_to_none=grads, return_mode="median")
    end = time.time()  # the timed calls took about rep_ms (the budget as widened above), after the warm-up
    return Measurement(ms=ms, peak_gib=peak_gib, setup_s=setup_s, sm_clock=clocks_between(end - options.rep_ms / 1e3, end))


def host_time_per_call(
    step: Callable[[], object], leaves: tuple[torch.Tensor, ...], calls: int, synchronize: Callable[[], None]
) -> tuple[float, float]:
    """``(wall ms, CPU ms)`` per call of ``step``, issued ``calls`` times back to back.

    The GPU is synchronised only before and after the loop, so while the GPU keeps up with the
    host (true of tiny problems, whose kernels take microseconds) the wall time is the host's:
    Python, argument checks, allocations and kernel launches. The CPU time
    (``time.process_time``, all threads: autograd's device threads included) says how much of
    it the host spent computing rather than waiting. Gradients are set to None before each call,
    as a train step's ``zero_grad`` does.
    """
    synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        for t in leaves:
            t.grad = None
        step()
    synchronize()
    return (time.perf_counter() - wall) * 1e3 / calls, (time.process_time() - cpu) * 1e3 / calls


def measure_host(
    prepared: Prepared, mode: str, options: TimingOptions, synchronize: Callable[[], None] = torch.cuda.synchronize
) -> Measurement:
    """Host time per call in eager mode: one call to compile and autotune, ``options.host_calls``
    more to warm up, then ``options.host_calls`` timed (see :func:`host_time_per_call`)."""
    start = time.perf_counter()
    step = make_step(prepared, mode)
    step()
    synchronize()
    setup_s = time.perf_counter() - start
    host_time_per_call(step, prepared.leaves, options.host_calls, synchronize)
    wall_ms, cpu_ms = host_time_per_call(step, prepared.leaves, options.host_calls, synchronize)
    return Measurement(ms=wall_ms, peak_gib=None, setup_s=setup_s, cpu_ms=cpu_ms)
