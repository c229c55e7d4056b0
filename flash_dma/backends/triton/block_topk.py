"""Block top-k selection per key: block scores, the best blocks and their states, in one launch.

``flash_dma.masks.topk_block_mask`` in its per-key layout on a CUDA device comes here (its torch
version serves other devices, and the per-query-block layout everywhere). One program per row
(batch, head) of the per-key bias ``[Bm, Hm, 1, Sk]``:

1. Scores: each key block's maximum (or mean) of the bias over its allowed keys; a NaN among them
   makes the score NaN. The block's state is written at once where it is decided: EMPTY where no
   key is allowed, FULL or PARTIAL for a forced (sink) block, and a provisional code for a
   candidate, whose score goes to a float32 scratch row (NaN for every other block).
2. Selection: a candidate is kept when fewer than ``keep`` candidates rank above it, by score and
   then by the lower index, so ties break as the torch version's do and nothing depends on the
   order of a sort. Counting is pairwise, ``[CHUNK, CHUNK]`` comparisons at a time: O(NKB²) per
   row, a few microseconds at 16K keys in blocks of 128.

Nothing synchronises with the host, and the result is bitwise deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import kernel_view, placeholder, tensor_layout
from flash_dma.integers import cdiv

_KEYS = 4096  # bias elements read per step of phase 1
_CHUNK = 128  # blocks compared per step of phase 2
PARTIAL, FULL = tl.constexpr(1), tl.constexpr(2)  # block_mask.PARTIAL, FULL
# Provisional states of a candidate (phase 1), made PARTIAL/FULL or EMPTY by phase 2.
_CANDIDATE, _FULL_CANDIDATE = tl.constexpr(-1), tl.constexpr(-2)


@triton.jit(do_not_specialize=[
    "stride_bb", "stride_bh", "stride_bk", "stride_ab", "stride_ah", "stride_ak", "stride_pb", "stride_pk",
    "seqlen_k", "num_heads", "key_blocks", "sink_blocks", "keep",
])
def _block_topk_kernel(
    Bias, Allowed, PastEnd, Scores, State,
    stride_bb, stride_bh, stride_bk, stride_ab, stride_ah, stride_ak, stride_pb, stride_pk,
    seqlen_k, num_heads, key_blocks, sink_blocks, keep,
    BLOCK_K: tl.constexpr, BLOCKS: tl.constexpr, CHUNK: tl.constexpr,
    HAS_ALLOWED: tl.constexpr, HAS_PAST_END: tl.constexpr, MEAN: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // num_heads
    h = row % num_heads
    bias_row = Bias + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    allowed_row = Allowed + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah
    scores_row = Scores + row.to(tl.int64) * key_blocks
    state_row = State + row.to(tl.int64) * key_blocks

    # Phase 1: scores and the states that need no ranking.
    for first in range(0, key_blocks, BLOCKS):
        blocks = first + tl.arange(0, BLOCKS)  # [BLOCKS]
        keys = blocks[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [BLOCKS, BLOCK_K]
        real = keys < seqlen_k
        x = tl.load(bias_row + keys.to(tl.int64) * stride_bk, mask=real, other=0.0).to(tl.float32)
        allowed = real
        if HAS_ALLOWED:
            allowed = allowed & (tl.load(allowed_row + keys.to(tl.int64) * stride_ak, mask=real, other=0) != 0)
        count = tl.sum(allowed.to(tl.int32), 1)  # [BLOCKS]
        if MEAN:
            score = tl.sum(tl.where(allowed, x, 0.0), 1) / tl.maximum(count, 1).to(tl.float32)
        else:
            score = tl.max(tl.where(allowed, x, float("-inf")), 1)
        # tl.max drops NaNs where torch's amax keeps them: a NaN among the allowed keys is made explicit.
        has_nan = tl.max((allowed & (x != x)).to(tl.int32), 1) > 0
        score = tl.where(has_nan, float("nan"), score)
        # Keys past a sequence's end do not exist: they do not make a block PARTIAL.
        present = count
        if HAS_PAST_END:
            past = tl.load(PastEnd + b.to(tl.int64) * stride_pb + keys.to(tl.int64) * stride_pk, mask=real, other=0) != 0
            present += tl.sum(past.to(tl.int32), 1)
        full = present == tl.minimum(seqlen_k - blocks * BLOCK_K, BLOCK_K)
        eligible = count > 0
        forced = eligible & (blocks < sink_blocks)
        candidate = eligible & ~forced & ~has_nan
        state = tl.where(forced, tl.where(full, FULL, PARTIAL), 0)
        state = tl.where(candidate, tl.where(full, _FULL_CANDIDATE, _CANDIDATE), state)
        inside = blocks < key_blocks
        tl.store(scores_row + blocks, tl.where(candidate, score, float("nan")), mask=inside)
        tl.store(state_row + blocks, state.to(tl.int8), mask=inside)
    tl.debug_barrier()  # the row's scores, written by every thread, are read by every thread below

    # Phase 2: a candidate is kept if fewer than `keep` candidates rank above it. A NaN (not a
    # candidate) compares false with everything, so it neither ranks nor is ranked.
    for first in range(0, key_blocks, CHUNK):
        mine = first + tl.arange(0, CHUNK)  # [CHUNK]
        inside = mine < key_blocks
        score = tl.load(scores_row + mine, mask=inside, other=float("nan"))
        above = tl.zeros([CHUNK], dtype=tl.int32)
        for other_first in range(0, key_blocks, CHUNK):
            others = other_first + tl.arange(0, CHUNK)
            other_score = tl.load(scores_row + others, mask=others < key_blocks, other=float("nan"))
            ahead = (other_score[None, :] > score[:, None]) | (
                (other_score[None, :] == score[:, None]) & (others[None, :] < mine[:, None])
            )  # [CHUNK, CHUNK]
            above += tl.sum(ahead.to(tl.int32), 1)
        state = tl.load(state_row + mine, mask=inside, other=0)
        kept = above < keep
        state = tl.where(state == _CANDIDATE, tl.where(kept, PARTIAL, 0), state)
        state = tl.where(state == _FULL_CANDIDATE, tl.where(kept, FULL, 0), state)
        tl.store(state_row + mine, state.to(tl.int8), mask=inside)


topk_launcher = Launcher(_block_topk_kernel, tensors=("Bias", "Allowed", "PastEnd", "Scores", "State"), specialized=())


def block_topk_state(
    bias: torch.Tensor,
    allowed: torch.Tensor | None,
    past_end: torch.Tensor | None,
    block_k: int,
    keep: int,
    sink_blocks: int,
    mean: bool,
) -> torch.Tensor:
    """The per-key block states ``[Bm, Hm, 1, NKB]`` int8 of ``topk_block_mask``.

    Args:
        bias: ``[Bm, Hm, 1, Sk]`` float, any float dtype and strides (broadcast axes of stride 0).
        allowed: ``[Bm, Hm, 1, Sk]`` bool or None (every key allowed): the keys a block may count.
        past_end: ``[Bm, 1, 1, Sk]`` bool or None: keys past a packed sequence's end.
        block_k: keys per block, a power of two.
        keep: blocks kept per row by score, on top of the forced ones.
        sink_blocks: the first blocks, kept whenever they hold an allowed key.
        mean: score a block by the mean of its allowed keys' bias, else by their maximum.
    """
    batch, heads, _, seqlen_k = bias.shape
    key_blocks = cdiv(seqlen_k, block_k)
    state = torch.empty(batch, heads, 1, key_blocks, dtype=torch.int8, device=bias.device)
    scores = torch.empty(batch * heads, key_blocks, dtype=torch.float32, device=bias.device)
    allowed_view = placeholder(bias.device, torch.uint8) if allowed is None else kernel_view(allowed)
    past_view = placeholder(bias.device, torch.uint8) if past_end is None else kernel_view(past_end)
    allowed_strides = (0, 0, 0) if allowed is None else (allowed.stride(0), allowed.stride(1), allowed.stride(3))
    past_strides = (0, 0) if past_end is None else (past_end.stride(0), past_end.stride(3))
    tensors = [bias, allowed_view, past_view, scores, state]
    flags = (allowed is not None, past_end is not None, mean)
    topk_launcher.launch(
        (tensor_layout(bias), tensor_layout(allowed), tensor_layout(past_end), block_k, keep, sink_blocks, flags), tensors,
        lambda: ([
            *tensors, bias.stride(0), bias.stride(1), bias.stride(3), *allowed_strides, *past_strides,
            seqlen_k, heads, key_blocks, sink_blocks, keep, block_k, max(1, _KEYS // block_k), _CHUNK, *flags,
        ], ()),
        configs.single_program_config, lambda meta: (batch * heads,),
    )
    return state
