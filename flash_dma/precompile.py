"""``flash-dma precompile``: fill the kernel cache for a named set of shapes and forms, in parallel.

A first call on an empty cache compiles each of its kernels (seconds each: Triton's passes,
ptxas, the host compiler for the kernel's C launcher). This command compiles them beforehand,
once per machine image or per cluster, into Triton's cache: ``TRITON_CACHE_DIR``, by default
``~/.triton/cache``, which an image can hold and the nodes of a cluster can share. A later process
whose calls have the same forms then loads every kernel from the cache.

Each problem the arguments name (shape x length x form x dtype) is dry-run: the call's host code
runs, forward and (with ``--backward``) backward, launching nothing, and each launch it reaches
starts compiling its kernel on a pool of threads (``backends/triton/launch.py``, "Compiling
ahead"), so that every kernel of every problem compiles side by side. Nothing is computed, and
the inputs are never written.

    flash-dma precompile --shapes llm --lengths 4K,16K --forms keys,bits,none --dtypes bf16 --backward

A call compiles no kernel of its own when its shape, length, form and dtype are among those
precompiled, its tensors are laid out as PyTorch lays out new ones (``[B, S, H, D]``, contiguous)
and the GPU, Triton version and flash-dma version are the same. Needs a CUDA GPU: which kernels a
call takes depends on it. Declaring and parsing the arguments imports neither torch nor the kernels.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from collections import Counter
from dataclasses import dataclass

from flash_dma.argument_types import HELP_WIDTH, NO_CUDA_EXIT_CODE, length_list
from flash_dma.benchmark.suites import DOGE_SHAPE, LLM_SHAPE, SEED_SHAPE

# Named head layouts (query heads, key/value heads, head dim): the benchmark's.
SHAPES = {
    "llm": (LLM_SHAPE["heads"], LLM_SHAPE["kv_heads"], LLM_SHAPE["head_dim"]),
    "seed": (SEED_SHAPE["heads"], SEED_SHAPE["kv_heads"], SEED_SHAPE["head_dim"]),
    "doge": (DOGE_SHAPE["heads"], DOGE_SHAPE["kv_heads"], DOGE_SHAPE["head_dim"]),
}
# The mask and bias of each form; Hkv: the key/value heads, S: the length.
FORMS = {
    "keys": "a per-key mask and bias [1, Hkv, 1, S] (a block top-k per key, as the llm suite's)",
    "bits": "a BitMask per pair [1, Hkv, S, S] (each query its own keys) and a per-key bias",
    "bias": "a per-key bias [1, Hkv, 1, S] alone",
    "none": "neither mask nor bias",
}
DTYPES = ("bf16", "fp16")
AUTOTUNING_EXIT_CODE = 2
DESCRIPTION = (
    "Fill Triton's kernel cache (TRITON_CACHE_DIR, by default ~/.triton/cache) with the kernels of the "
    "attention calls named below, compiled in parallel, so that a new process on this machine, an image "
    "built from it or a cluster sharing the cache compiles none on its first call. Needs a CUDA GPU."
)


@dataclass(frozen=True)
class Problem:
    """One problem to precompile: q ``[batch, length, heads, D]``, k and v ``[batch, length, kv_heads, D]``
    in ``dtype``, with the mask and bias of ``form`` (:data:`FORMS`)."""

    heads: int
    kv_heads: int
    head_dim: int
    length: int
    form: str
    dtype: str
    causal: bool = True
    batch: int = 1

    def __str__(self) -> str:
        causal = ", causal" if self.causal else ""
        return (f"B{self.batch} H{self.heads} Hkv{self.kv_heads} D{self.head_dim} S{self.length} "
                f"{self.dtype}, {self.form}{causal}")


def _shape(text: str) -> tuple[int, int, int]:
    if text in SHAPES:
        return SHAPES[text]
    heads, kv_heads, head_dim = (int(part) for part in text.split(":"))
    if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads:
        raise ValueError(text)
    return heads, kv_heads, head_dim


def shape_list(text: str) -> tuple[tuple[int, int, int], ...]:
    """Comma-separated head layouts, each a name of :data:`SHAPES` or ``H:Hkv:D`` (e.g. ``32:8:128``)."""
    try:
        shapes = tuple(_shape(item.strip()) for item in text.split(",") if item.strip())
    except ValueError:
        shapes = ()
    if not shapes:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated shapes, each one of {', '.join(SHAPES)} or H:Hkv:D with H a multiple of Hkv "
            f"(e.g. llm,32:8:128), got {text!r}"
        )
    return shapes


def _names(choices, what: str):
    """An argparse type: comma-separated names, each one of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; choose from {', '.join(choices)}")
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = textwrap.fill(DESCRIPTION, HELP_WIDTH)
    parser.epilog = "forms:\n" + "\n".join(f"  {name:<5} {text}" for name, text in FORMS.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--shapes", type=shape_list, default="llm",
                        help=f"head layouts, comma-separated: {', '.join(f'{n} ({h}:{k}:{d})' for n, (h, k, d) in SHAPES.items())}, "
                             "or H:Hkv:D (default: %(default)s)")
    parser.add_argument("--lengths", type=length_list, default="16K",
                        help="sequence lengths (queries = keys), comma-separated (default: %(default)s; K = 1024, M = 1024^2)")
    parser.add_argument("--forms", type=_names(FORMS, "form(s)"), default="keys",
                        help="masks and biases, comma-separated, from the list below (default: %(default)s)")
    parser.add_argument("--dtypes", type=_names(DTYPES, "dtype(s)"), default="bf16",
                        help=f"comma-separated, from {', '.join(DTYPES)} (default: %(default)s)")
    parser.add_argument("--backward", action="store_true", help="the backward's kernels too (training)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                        help="causal attention (default: causal)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: %(default)s)")


def problems(args: argparse.Namespace) -> list[Problem]:
    """Every problem the parsed arguments name, shape by shape, then length, form and dtype."""
    return [
        Problem(heads, kv_heads, head_dim, length, form, dtype, args.causal, args.batch)
        for heads, kv_heads, head_dim in args.shapes
        for length in args.lengths
        for form in args.forms
        for dtype in args.dtypes
    ]


class CompileRecord:
    """A Triton compilation listener that keeps each compilation's kernel, time (s) and cache hit.

    Triton calls it for every kernel it compiles or finds in its cache (``knobs.compilation.listener``),
    from whichever thread compiles; a cache hit's time is that of loading the binary.
    """

    def __init__(self) -> None:
        self.compiles: list[tuple[str, float, bool]] = []

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit: bool) -> None:
        self.compiles.append((metadata["name"], times.total / 1e6, cache_hit))


def _inputs(problem: Problem, device, grad: bool) -> tuple:
    """``(query, key, value, mask, bias)`` of ``problem`` (all but the mask requiring grad with
    ``grad``), never written: a dry run reads none."""
    import torch

    from flash_dma.bit_mask import words_per_row
    from flash_dma.summaries import bit_mask_from_words

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[problem.dtype]
    batch, length, heads, kv_heads, head_dim = problem.batch, problem.length, problem.heads, problem.kv_heads, problem.head_dim
    q = torch.empty(batch, length, heads, head_dim, dtype=dtype, device=device, requires_grad=grad)
    k, v = (torch.empty(batch, length, kv_heads, head_dim, dtype=dtype, device=device, requires_grad=grad) for _ in range(2))
    per_key = (1, kv_heads, 1, length)
    mask = bias = None
    if problem.form != "none":
        bias = torch.empty(per_key, dtype=dtype, device=device, requires_grad=grad)
    if problem.form == "keys":
        mask = torch.ones(per_key, dtype=torch.bool, device=device)
    elif problem.form == "bits":
        words = torch.zeros(1, kv_heads, length, words_per_row(length), dtype=torch.int32, device=device)
        mask = bit_mask_from_words(words, (1, kv_heads, length, length))
    return q, k, v, mask, bias


def start_compiling(problems: list[Problem], backward: bool, device) -> list[tuple[str, object]]:
    """Dry-run each of ``problems`` on ``device`` (its backward too with ``backward``): every kernel
    it launches starts compiling on the pool. Returns the launches, ``(kernel name, compilation)``
    (the compilation's future, or None where there is nothing to compile), in order."""
    from flash_dma.backends.triton import dry_attention, launch
    from flash_dma.inputs import normalize_inputs

    with launch.dry_run() as launches:
        for problem in problems:
            query, key, value, mask, bias = _inputs(problem, device, backward)
            # Validated as flash_dma_func validates its arguments.
            attention = normalize_inputs(query, key, value, mask, bias, is_causal=problem.causal, descales=(None, None, None))
            dry_attention(attention, backward)
    return launches


def main(args: argparse.Namespace) -> int:
    import torch
    import triton

    from flash_dma.backends.triton.configs import autotune_enabled

    if not torch.cuda.is_available():
        print("flash-dma precompile: no CUDA GPU is available; which kernels a call takes depends on the GPU.")
        return NO_CUDA_EXIT_CODE
    if autotune_enabled():
        print("flash-dma precompile: FLASH_DMA_AUTOTUNE=1 times each kernel's candidates on a call's own tensors, "
              "so nothing can be compiled ahead; unset it to precompile.")
        return AUTOTUNING_EXIT_CODE
    selected = problems(args)
    record, listening = CompileRecord(), triton.knobs.compilation.listener
    triton.knobs.compilation.listener = record
    start = time.perf_counter()
    try:
        launches = start_compiling(selected, args.backward, torch.device("cuda"))
        for _, compilation in launches:
            if compilation is not None:
                compilation.result()
    finally:
        triton.knobs.compilation.listener = listening
    seconds = time.perf_counter() - start
    compiled = Counter(name for name, _, hit in record.compiles if not hit)
    cached = Counter(name for name, _, hit in record.compiles if hit)
    print(f"flash-dma precompile: {len(selected)} problems, {len(record.compiles)} kernels in {seconds:.1f} s "
          f"({sum(compiled.values())} compiled, {sum(cached.values())} already in the cache) into {triton.knobs.cache.dir}")
    for name in sorted({*compiled, *cached}):
        print(f"  {name}: {compiled[name]} compiled, {cached[name]} from the cache")
    return 0
