"""Measuring one row: warm-up, peak memory, then the median time of many calls (CUDA only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flash_dma.benchmark.methods import Prepared


@dataclass(frozen=True)
class TimingOptions:
    """``triton.testing.do_bench``'s warm-up and measuring budgets, in milliseconds."""

    warmup_ms: int = 25
    rep_ms: int = 100


@dataclass(frozen=True)
class Measurement:
    """``ms``: median time of one call; ``peak_gib``: memory it allocates beyond what existed before
    (inputs excluded); ``setup_s``: wall time of the first call (compilation, autotuning)."""

    ms: float
    peak_gib: float
    setup_s: float


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


def graph_replay_ms(step: Callable[[], object], options: TimingOptions) -> float:
    """Median time of ``step`` captured once in a CUDA graph: decode-sized calls without launch overhead.

    ``step`` must have run already: compilation and autotuning cannot happen inside a capture.
    """
    from triton.testing import do_bench

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return do_bench(graph.replay, warmup=options.warmup_ms, rep=options.rep_ms, return_mode="median")


def measure(prepared: Prepared, mode: str, cuda_graph: bool, options: TimingOptions) -> Measurement:
    """Warm up, then measure the peak memory of one call and the median time of many.

    ``do_bench`` clears the L2 cache before every call and sets the leaves' gradients to None.
    """
    from triton.testing import do_bench

    start = time.perf_counter()
    step = make_step(prepared, mode)
    step()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - start
    peak_gib = peak_memory_gib(step, prepared.leaves)
    if cuda_graph:
        ms = graph_replay_ms(step, options)
    else:
        grads = list(prepared.leaves) if mode == "fwdbwd" else None
        ms = do_bench(step, warmup=options.warmup_ms, rep=options.rep_ms, grad_to_none=grads, return_mode="median")
    return Measurement(ms=ms, peak_gib=peak_gib, setup_s=setup_s)
