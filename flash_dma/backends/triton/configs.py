"""Tile configurations and how they are chosen.

Candidates are per GPU generation (sm90 = H100, sm80 = A100 and the rest) and head-dim bucket.
The autotuner is keyed on coarse length buckets (``length_bucket``) plus the kernel's compile-time
flags, so a new sequence length inside a bucket reuses the tuned choice, and results are cached on
disk (``cache_results``) for later processes. Tiles never exceed the block summary's blocks,
because a kernel tile must lie inside one summary block.

``FLASH_DMA_AUTOTUNE=0`` (used by the GPU tests) and the Triton interpreter skip tuning and take
the first candidate.
"""

from __future__ import annotations

import functools
import os

import torch
import triton



def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


# Prefill/training shapes: (BLOCK_M, BLOCK_N, warps, stages), best guess first. The sm90 lists
# hold the variants ptxas compiles with the fewest spills (tools/compile_report.py); sm80 lists
# are FlashAttention-2-like guesses.
_FORWARD = {
    "sm90": {
        64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
        128: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)],
        256: [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)],
    },
    "sm80": {
        64: [(128, 64, 4, 3), (64, 64, 4, 3)],
        128: [(128, 32, 4, 3), (64, 64, 4, 3)],
        256: [(64, 32, 4, 2), (32, 32, 4, 2)],
    },
}
# Backward: dK/dV programs own BLOCK_N keys and loop over BLOCK_M queries; dQ the other way round.
_BACKWARD = {
    "dkdv": {
        "sm90": {
            64: [(32, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3)],
            128: [(64, 64, 8, 2), (32, 128, 8, 2), (32, 64, 4, 3)],
            256: [(32, 64, 8, 2), (32, 32, 4, 2)],
        },
        "sm80": {
            64: [(32, 64, 4, 3), (64, 64, 4, 2)],
            128: [(32, 64, 4, 2), (64, 64, 8, 2)],
            256: [(32, 32, 4, 2), (16, 64, 4, 2)],
        },
    },
    "dq": {
        "sm90": {
            64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
            128: [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)],
            256: [(64, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
        },
        "sm80": {
            64: [(128, 32, 4, 3), (64, 64, 4, 3)],
            128: [(64, 32, 4, 3), (64, 64, 4, 2)],
            256: [(32, 32, 4, 2), (64, 32, 4, 2)],
        },
    },
}
# Decode shapes (few query rows, split over keys): BLOCK_M shrinks to the rows.
_DECODE = [(16, 128, 4, 3), (16, 64, 4, 4), (16, 128, 8, 4)]
_INTERPRETER_TILE = 32


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled() -> bool:
    return os.environ.get("FLASH_DMA_AUTOTUNE", "1") != "0" and not triton_interpreting()


@functools.lru_cache(maxsize=None)
def _generation(device_index: int) -> str:
    return "sm90" if torch.cuda.get_device_capability(device_index)[0] >= 9 else "sm80"


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: a small pretend GPU, so that the split-KV heuristics are exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor standing in for an absent kernel input (never read)."""
    return torch.zeros(1, dtype=dtype, device=device)


def length_bucket(n: int) -> int:
    """Coarse, 4x-wide length buckets: 1-16, 17-64, ..., so that tuning survives new lengths."""
    return (max(n, 1) - 1).bit_length() // 2


def head_dim_block(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def candidates(device: torch.device, block_d: int, decode: bool) -> list[triton.Config]:
    if triton_interpreting():
        return [_config(_INTERPRETER_TILE, _INTERPRETER_TILE, 4, 1)]
    if decode:
        return [_config(*c) for c in _DECODE]
    table = _FORWARD[_generation(device.index or 0)]
    return [_config(*c) for c in table[min(b for b in table if b >= block_d)]]


def backward_candidates(device: torch.device, block_d: int, kernel: str) -> list[triton.Config]:
    if triton_interpreting():
        return [_config(_INTERPRETER_TILE, _INTERPRETER_TILE, 4, 1)]
    table = _BACKWARD[kernel][_generation(device.index or 0)]
    return [_config(*c) for c in table[min(b for b in table if b >= block_d)]]


def fit_to_problem(configs, nargs, **kwargs) -> list[triton.Config]:
    """Shrink tiles to the summary blocks and to the rows there are; drop duplicates."""
    nargs = {**nargs, **kwargs}
    fitted = {}
    for config in configs:
        block_m, block_n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        block_m = min(block_m, max(16, triton.next_power_of_2(nargs.get("rows", nargs["seqlen_q"]))))
        if nargs["list_block_q"] > 0:
            block_m = min(block_m, nargs["list_block_q"])
        if nargs["list_block_k"] > 0:
            block_n = min(block_n, nargs["list_block_k"])
        key = (block_m, block_n, config.num_warps, config.num_stages)
        fitted.setdefault(key, _config(*key))
    return list(fitted.values())
