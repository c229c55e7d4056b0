"""Tile configurations: the shipped tables, and how a problem narrows them.

Candidates are per GPU generation (sm90 = H100/H200, sm80 = A100 and the rest), kernel and
head-dim bucket, best first: a default call takes the first one that fits the device's shared
memory (``launch.Launcher``), so it never autotunes. ``FLASH_DMA_AUTOTUNE=1`` times them all
instead and keeps the fastest on disk. Tiles never exceed the block summary's blocks, because a
kernel tile must lie inside one summary block, nor the rows there are.

Why these tiles (measured on an H100, bf16, with ``FLASH_DMA_AUTOTUNE=1``, which stores every
candidate's time):

- forward, D = 128: 128 query rows x 128 keys, 8 warps, 2 stages. On the 16K keep-1/8 key-list
  forward it took 0.655 ms against 0.743 (64 x 64, 4 warps) and 0.779 (128 x 64, 8 warps, 3 stages).
  On the block walk (summary passed) it took 0.485 ms against 0.478 (64 x 64, 4 warps, 3 stages:
  within noise), 0.501 (3 stages) and 0.522 (128 x 64, 8 warps, 3 stages).
- forward, D = 256: 64-key tiles no longer fit three stages in 227 KB, hence 32 keys and two.
- dK/dV, D = 128: 32 queries x 64 keys, one warpgroup (4 warps), 3 stages. Once long columns
  were split into chunks added by atomics, the kernel alone took 0.866 ms at 16K keep 1/8 against
  0.899 (64 x 128, 8 warps, 3 stages) and 1.062 (32 x 128, 8 warps, 2 stages, the earlier
  choice); at 4K 0.140 against 0.172 ms. No 64-key tile with 8 warps: both warpgroups would
  compute the same S and dP tiles.
- dK/dV, D = 64: 32 x 64 with 4 warps (one warpgroup, no duplicated tiles) was fastest at S = 128.
- dQ, D = 128: 128 x 128, 8 warps, 2 stages: 0.518 ms at 16K keep 1/8 against 0.594 (128 x 64);
  at 4K they tie (0.080 against 0.078 ms).
- Decode (few query rows): 16-row tiles, split-KV supplying the parallelism, 64 keys, 4 stages.
  Over 512K keys at B=1, H=2, D=64 (block mask passed, CUDA graphs) it took 68.9 us at keep 1 and
  28.3 us at keep 1/8 against 75.1 and 33.4 (128 keys, 3 stages); over 32K keys at B=8, H=32,
  D=128, 379 and 76.5 us against 388 and 93.3 (the decode bisect in ``docs/design-notes.md``).

Each list ends with a small tile that fits any head dim's shared memory on any generation.
On sm90 the calls that ``dispatch.py`` routes to ``hopper/`` run its Gluon
kernels instead, each with its one configuration (``TILE``, ``DQ_TILE``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

_FALLBACK = (32, 32, 4, 1)
# Prefill/training shapes: (BLOCK_M, BLOCK_N, warps, stages).
_FORWARD = {
    "sm90": {
        64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
        128: [(128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)],
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
            64: [(32, 64, 4, 3), (64, 128, 8, 2), (64, 64, 4, 3)],
            128: [(32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 8, 2)],
            256: [(32, 64, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2)],
        },
        "sm80": {
            64: [(32, 64, 4, 3), (64, 64, 4, 2)],
            128: [(32, 64, 4, 2), (64, 64, 8, 2)],
            256: [(32, 32, 4, 2), (16, 64, 4, 2)],
        },
    },
    "dq": {
        "sm90": {
            64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
            128: [(128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2)],
            256: [(64, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
        },
        "sm80": {
            64: [(128, 32, 4, 3), (64, 64, 4, 3)],
            128: [(64, 32, 4, 3), (64, 64, 4, 2)],
            256: [(32, 32, 4, 2), (64, 32, 4, 2)],
        },
    },
}
# Top-k index attention (``topk/forward.py``, ``topk/backward.py``): BLOCK_N gathered keys per tile
# by pass and head-dim bucket, (BLOCK_N, warps, stages); BLOCK_M is the group's heads padded to 16.
# D = 128 by a sweep on the H100 (32K, W = 2048, H = 16 and 64: BLOCK_N 32-128, 2-8 warps, 1-3
# stages): the forward 25.7 ms against 28.2 for (64, 4, 2), the dQ walk with its dK/dV atomics
# 107 against 116; the others untuned.
_TOPK = {
    "forward": {64: (64, 4, 3), 128: (32, 2, 2), 256: (32, 4, 2)},
    "dq": {64: (64, 4, 3), 128: (32, 2, 3), 256: (32, 4, 2)},
}
# The top-k backward over a query block's union of keys (``topk/union.py``): (BLOCK_N, warps, stages)
# by head-dim bucket; BLOCK_M is the block's queries x the group's padded heads (64 rows). D = 128
# by a sweep on the H100 (32K, W = 2048, H = 16 and 64: BLOCK_N 16-64, 4-8 warps, 1-3 stages); the
# others untuned.
_TOPK_UNION = {64: (64, 4, 2), 128: (32, 4, 3), 256: (32, 8, 1)}
# Elements (rows of queries x group heads, times BLOCK_D) per chunk of the key-outer dK/dV kernel:
# its q and dO chunks live in registers (at D = 128, 64 rows spilled on sm90, 32 did not).
TOPK_DKDV_ELEMENTS = 4096
# Decode shapes (few query rows, split over keys): BLOCK_M shrinks to the rows.
_DECODE = [(16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 8, 4), (16, 32, 4, 2)]
_INTERPRETER_TILE = 32
MIN_TILE = 16  # the smallest tile side tl.dot takes


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tma_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` may load tiles through TMA descriptors: Hopper or later (and
    the interpreter, so that the CPU tests run that path), unless ``FLASH_DMA_TMA=0``."""
    if os.environ.get("FLASH_DMA_TMA", "1") == "0" or not hasattr(triton.language, "make_tensor_descriptor"):
        return False
    return triton_interpreting() or _generation(device.index or 0) == "sm90"


def autotune_enabled() -> bool:
    return os.environ.get("FLASH_DMA_AUTOTUNE", "0") == "1" and not triton_interpreting()


def compile_ahead_enabled() -> bool:
    """Whether a call that needs a kernel compiled has all of its kernels, its backward's
    included, compiled side by side on threads (``launch.py``), unless ``FLASH_DMA_COMPILE_AHEAD=0``.
    Never while autotuning (candidates are timed on the call's own tensors) nor under the
    interpreter (nothing compiles)."""
    return os.environ.get("FLASH_DMA_COMPILE_AHEAD", "1") != "0" and not autotune_enabled() and not triton_interpreting()


@functools.lru_cache(maxsize=None)
def _generation(device_index: int) -> str:
    return "sm90" if torch.cuda.get_device_capability(device_index)[0] >= 9 else "sm80"


@functools.lru_cache(maxsize=None)
def is_hopper(device: torch.device) -> bool:
    """Compute capability 9.x exactly (wgmma is Hopper's; later generations have other MMAs)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: a small pretend GPU, so that the split-KV heuristics are exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def length_bucket(n: int) -> int:
    """Coarse, 4x-wide length buckets: 1-16, 17-64, ..., so that tuning survives new lengths."""
    return (max(n, 1) - 1).bit_length() // 2


def next_power_of_2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 is a constexpr function, slow to call from the host.
    return 1 << (n - 1).bit_length() if n > 1 else 1


def head_dim_block(head_dim: int) -> int:
    return max(MIN_TILE, next_power_of_2(head_dim))


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    # Kwargs in the kernels' parameter order: the launcher passes them positionally.
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


def _table(table: dict, device: torch.device, block_d: int) -> list[triton.Config]:
    if triton_interpreting():
        return [_config(_INTERPRETER_TILE, _INTERPRETER_TILE, 4, 1)]
    by_dim = table[_generation(device.index or 0)]
    return [_config(*c) for c in (*by_dim[min(b for b in by_dim if b >= block_d)], _FALLBACK)]


def forward_candidates(device: torch.device, block_d: int, decode: bool) -> list[triton.Config]:
    if decode and not triton_interpreting():
        return [_config(*c) for c in _DECODE]
    return _table(_FORWARD, device, block_d)


def backward_candidates(device: torch.device, block_d: int, kernel: str) -> list[triton.Config]:
    return _table(_BACKWARD[kernel], device, block_d)


def _topk_tile(table: dict, block_m: int, block_d: int) -> list[triton.Config]:
    """The top-k tile of ``BLOCK_M`` rows from ``table``'s (BLOCK_N, warps, stages) by head-dim bucket."""
    if triton_interpreting():
        return [_config(block_m, _INTERPRETER_TILE, 4, 1)]
    return [_config(block_m, *table[min(b for b in table if b >= block_d)])]


def topk_candidates(pass_: str, block_d: int, group: int) -> list[triton.Config]:
    """The tile of the top-k ``pass_`` (``"forward"`` or ``"dq"``)."""
    return _topk_tile(_TOPK[pass_], max(MIN_TILE, next_power_of_2(group)), block_d)


def union_candidates(block_d: int, group: int, queries: int) -> list[triton.Config]:
    """The tile of the union backward for blocks of ``queries`` queries."""
    return _topk_tile(_TOPK_UNION, queries * next_power_of_2(group), block_d)


def topk_dkdv_rows(block_d: int, block_g: int) -> int:
    """Rows of a chunk of the top-k dK/dV kernel: at least the group's (padded) heads."""
    return max(block_g, _INTERPRETER_TILE if triton_interpreting() else TOPK_DKDV_ELEMENTS // block_d)


def single_program_config() -> list[triton.Config]:
    """For kernels without tile parameters."""
    return [triton.Config({}, num_warps=4, num_stages=1)]


def fit_to_problem(configs, rows: int, list_block_q: int, list_block_k: int) -> list[triton.Config]:
    """Shrink tiles to the summary blocks and to the rows there are; drop duplicates."""
    fitted = {}
    for config in configs:
        block_m = min(config.kwargs["BLOCK_M"], max(MIN_TILE, next_power_of_2(rows)))
        block_n = config.kwargs["BLOCK_N"]
        if list_block_q > 0:
            block_m = min(block_m, list_block_q)
        if list_block_k > 0:
            block_n = min(block_n, list_block_k)
        key = (block_m, block_n, config.num_warps, config.num_stages)
        fitted.setdefault(key, _config(*key))
    return list(fitted.values())
