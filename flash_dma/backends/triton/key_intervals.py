"""Key intervals on the GPU (``flash_dma/key_intervals.py``): their block summary and the intervals
of a causal top-k, each in one launch with no ``[Sq, Sk]`` temporary, and their layout for the
attention kernels.

- ``_interval_state_kernel``: one program per (query block, run of key blocks) classifies each
  block from its keys' intervals: FULL if every interval covers the block's rows, EMPTY if none
  meets them, else PARTIAL. O(Sk) per query block.
- ``_causal_topk_end_kernel``: per (batch, head) of per-key scores, the end row of each key under
  a causal top-k (``key_intervals.causal_topk_ends`` says what it is). A program takes a tile of
  keys: it counts the keys before them that outrank them (``[TILE, TILE]`` comparisons per tile of
  earlier keys), then walks the later keys, a tile at a time, until each has met the outrankers
  that end its run (a running count and ``tl.cumsum`` within the tile that holds the last one).
  O(Sk² / TILE²) tiles per head; nothing is sorted, so ties need no care beyond the rule.

Each has a custom op with a fake for ``torch.compile``. The attention kernels read the intervals
themselves, on PARTIAL tiles only (``tiles.visible_scores``, ``hopper/common.visible_scores``), laid
out by :func:`kernel_intervals`.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import kernel_view, placeholder, tensor_layout
from flash_dma.integers import cdiv
from flash_dma.key_intervals import KeyIntervals
from flash_dma.memo import may_memoise

_KEYS = 1024  # keys classified per program of the state kernel
_TILE = 64  # keys per side of the causal top-k kernel's comparisons


@triton.jit(do_not_specialize=[
    "stride_sb", "stride_sh", "stride_sk", "stride_eb", "stride_eh", "stride_ek",
    "stride_tb", "stride_th", "stride_tq", "stride_tk", "seqlen_q", "seqlen_k", "num_heads", "key_blocks", "chunks",
    "block_q",
])
def _interval_state_kernel(
    Start, End, State,
    stride_sb, stride_sh, stride_sk, stride_eb, stride_eh, stride_ek,
    stride_tb, stride_th, stride_tq, stride_tk, seqlen_q, seqlen_k, num_heads, key_blocks, chunks, block_q,
    BLOCK_K: tl.constexpr, BLOCKS: tl.constexpr, HAS_START: tl.constexpr,
):
    qb = tl.program_id(0) // chunks
    blocks = (tl.program_id(0) % chunks) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    first_row = qb * block_q
    stop_row = tl.minimum(first_row + block_q, seqlen_q)
    keys = blocks[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [BLOCKS, BLOCK_K]
    real = keys < seqlen_k
    end = tl.load(End + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh + keys * stride_ek, mask=real, other=0)
    start = tl.zeros_like(end)
    if HAS_START:
        start = tl.load(Start + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + keys * stride_sk, mask=real, other=0)
    # Keys past the end cover every row and meet none.
    covers = ((start <= first_row) & (end >= stop_row)) | ~real
    meets = (tl.maximum(start, first_row) < tl.minimum(end, stop_row)) & real
    full = tl.min(covers.to(tl.int32), 1)
    nonempty = tl.max(meets.to(tl.int32), 1)
    state = nonempty + nonempty * full  # EMPTY 0, PARTIAL 1, FULL 2
    ptrs = State + b.to(tl.int64) * stride_tb + h.to(tl.int64) * stride_th + qb * stride_tq + blocks * stride_tk
    tl.store(ptrs, state.to(tl.int8), mask=blocks < key_blocks)


@triton.jit
def _keys_of(scores_row, allowed_row, keys, stride_sk, stride_ak, seqlen_k, HAS_ALLOWED: tl.constexpr):
    """``(score, valid)`` of ``keys``: a key that is past the end, not allowed or NaN is not valid."""
    real = keys < seqlen_k
    score = tl.load(scores_row + keys * stride_sk, mask=real, other=0.0)
    valid = real & (score == score)
    if HAS_ALLOWED:
        valid = valid & (tl.load(allowed_row + keys * stride_ak, mask=real, other=0) != 0)
    return score, valid


@triton.jit(do_not_specialize=[
    "stride_sb", "stride_sh", "stride_sk", "stride_ab", "stride_ah", "stride_ak", "stride_eb", "stride_eh",
    "seqlen_q", "seqlen_k", "num_heads", "keep",
])
def _causal_topk_end_kernel(
    Scores, Allowed, End,
    stride_sb, stride_sh, stride_sk, stride_ab, stride_ah, stride_ak, stride_eb, stride_eh,
    seqlen_q, seqlen_k, num_heads, keep,
    TILE: tl.constexpr, HAS_ALLOWED: tl.constexpr,
):
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    scores_row = Scores + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    allowed_row = Allowed + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah
    first_mine = tl.program_id(0) * TILE
    mine = first_mine + tl.arange(0, TILE)
    score, valid = _keys_of(scores_row, allowed_row, mine, stride_sk, stride_ak, seqlen_k, HAS_ALLOWED)

    # The keys before j that outrank it (a higher score, or the same): every query that sees j sees them.
    before = tl.zeros([TILE], dtype=tl.int32)
    for first in range(0, first_mine + TILE, TILE):
        others = first + tl.arange(0, TILE)
        other_score, other_valid = _keys_of(scores_row, allowed_row, others, stride_sk, stride_ak, seqlen_k, HAS_ALLOWED)
        ahead = other_valid[None, :] & (others[None, :] < mine[:, None]) & (other_score[None, :] >= score[:, None])
        before += tl.sum(ahead.to(tl.int32), 1)
    need = keep - before  # the later outrankers that end j's run

    # The position of the need-th later outranker (a strictly higher score), Sk if there is none.
    found = tl.zeros([TILE], dtype=tl.int32) + seqlen_k
    pending = valid & (need > 0)
    counted = tl.zeros([TILE], dtype=tl.int32)
    first = first_mine
    while (first < seqlen_k) & (tl.max(pending.to(tl.int32), 0) > 0):
        others = first + tl.arange(0, TILE)
        other_score, other_valid = _keys_of(scores_row, allowed_row, others, stride_sk, stride_ak, seqlen_k, HAS_ALLOWED)
        ahead = (other_valid[None, :] & (others[None, :] > mine[:, None]) & (other_score[None, :] > score[:, None])).to(tl.int32)
        in_tile = tl.sum(ahead, 1)
        if tl.max((pending & (counted + in_tile >= need)).to(tl.int32), 0) > 0:  # a run ends in this tile
            reached = (tl.cumsum(ahead, 1) + counted[:, None]) >= need[:, None]
            at = tl.min(tl.where(reached, others[None, :], seqlen_k), 1)
            found = tl.where(pending, tl.minimum(found, at), found)
            pending = pending & (found == seqlen_k)
        counted += in_tile
        first += TILE
    # The query at position p (row p - (Sk - Sq)) is the first to see `keep` outrankers.
    end = tl.minimum(tl.maximum(found - (seqlen_k - seqlen_q), 0), seqlen_q)
    end = tl.where(valid & (need > 0), end, 0)
    tl.store(End + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh + mine, end, mask=mine < seqlen_k)


state_launcher = Launcher(_interval_state_kernel, tensors=("Start", "End", "State"), specialized=())
end_launcher = Launcher(_causal_topk_end_kernel, tensors=("Scores", "Allowed", "End"), specialized=())


def _start_arguments(start: torch.Tensor | None, end: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The start pointer and strides the kernels take: a placeholder and zeros without one."""
    if start is None:
        return placeholder(end.device, torch.int32), (0, 0, 0)
    return start, tuple(start.stride())


def build_interval_state(start: torch.Tensor | None, end: torch.Tensor, query_len: int, block_q: int, block_k: int) -> torch.Tensor:
    """EMPTY/PARTIAL/FULL per block: int8 ``[Bm, Hm, NQB, NKB]`` of the intervals ``start``/``end``
    ``[Bm, Hm, Sk]`` int32 over ``query_len`` rows (``key_intervals.interval_states`` in one launch)."""
    batch, heads, key_len = end.shape
    block_q, block_k = (block_q if query_len > 1 else 1), (block_k if key_len > 1 else 1)
    query_blocks, key_blocks = cdiv(query_len, block_q), cdiv(key_len, block_k)
    blocks = max(1, _KEYS // block_k)
    chunks = cdiv(key_blocks, blocks)
    state = torch.empty(batch, heads, query_blocks, key_blocks, dtype=torch.int8, device=end.device)
    start_view, start_strides = _start_arguments(start, end)
    tensors = [start_view, end, state]
    state_launcher.launch(
        (tensor_layout(start), tensor_layout(end), query_len, block_q, block_k), tensors,
        lambda: ([
            *tensors, *start_strides, *end.stride(), *state.stride(), query_len, key_len, heads, key_blocks, chunks,
            block_q, block_k, blocks, start is not None,
        ], ()),
        configs.single_program_config, lambda meta: (query_blocks * chunks, batch * heads),
    )
    return state


def build_causal_topk_ends(scores: torch.Tensor, allowed: torch.Tensor | None, keep: int, query_len: int) -> torch.Tensor:
    """int32 ``[Bm, Hm, Sk]``: the end rows of a causal top-k (``key_intervals.causal_topk_ends`` in
    one launch). ``scores`` ``[Bm, Hm, Sk]`` float, any strides, compared in their own dtype;
    ``allowed`` ``[Bm, Hm, Sk]`` bool or 0/1, or None."""
    batch, heads, key_len = scores.shape
    end = torch.empty(batch, heads, key_len, dtype=torch.int32, device=scores.device)
    allowed_view = placeholder(scores.device, torch.uint8) if allowed is None else kernel_view(allowed)
    allowed_strides = (0, 0, 0) if allowed is None else tuple(allowed.stride())
    tensors = [scores, allowed_view, end]
    end_launcher.launch(
        (tensor_layout(scores), tensor_layout(allowed), keep, query_len), tensors,
        lambda: ([
            *tensors, *scores.stride(), *allowed_strides, *end.stride()[:2], query_len, key_len, heads, keep,
            _TILE, allowed is not None,
        ], ()),
        configs.single_program_config, lambda meta: (cdiv(key_len, _TILE), batch * heads),
    )
    return end


@torch.library.custom_op("flash_dma::interval_state", mutates_args=())
def interval_state_op(start: torch.Tensor | None, end: torch.Tensor, query_len: int, block_q: int, block_k: int) -> torch.Tensor:
    return build_interval_state(start, end, query_len, block_q, block_k)


@interval_state_op.register_fake
def _interval_state_fake(start, end, query_len, block_q, block_k):
    batch, heads, key_len = end.shape
    query_blocks = 1 if query_len == 1 else cdiv(query_len, block_q)
    key_blocks = 1 if key_len == 1 else cdiv(key_len, block_k)
    return end.new_empty(batch, heads, query_blocks, key_blocks, dtype=torch.int8)


@torch.library.custom_op("flash_dma::causal_topk_ends", mutates_args=())
def causal_topk_ends_op(scores: torch.Tensor, allowed: torch.Tensor | None, keep: int, query_len: int) -> torch.Tensor:
    return build_causal_topk_ends(scores, allowed, keep, query_len)


@causal_topk_ends_op.register_fake
def _causal_topk_ends_fake(scores, allowed, keep, query_len):
    return scores.new_empty(scores.shape, dtype=torch.int32)


def interval_state(start: torch.Tensor | None, end: torch.Tensor, query_len: int, block_q: int, block_k: int) -> torch.Tensor:
    """``build_interval_state``, through the custom op when compiling."""
    return (interval_state_op if torch.compiler.is_compiling() else build_interval_state)(start, end, query_len, block_q, block_k)


def causal_topk_end_rows(scores: torch.Tensor, allowed: torch.Tensor | None, keep: int, query_len: int) -> torch.Tensor:
    """``build_causal_topk_ends``, through the custom op when compiling."""
    return (causal_topk_ends_op if torch.compiler.is_compiling() else build_causal_topk_ends)(scores, allowed, keep, query_len)


# The kernels' rows of each KeyIntervals walked, while the intervals live: a mask shared by several
# layers is laid out once.
_KERNEL_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kernel_intervals(mask: KeyIntervals) -> torch.Tensor:
    """The rows of ``mask`` as the attention kernels read them: int32 ``[Bm, Hm, 1, 2 Sk]``, each
    key's first query row then one past its last (``layout.Call``, mask kind ``"intervals"``)."""
    keep = may_memoise()  # not traced, captured or dry-run (``memo.may_memoise``)
    rows = _KERNEL_ROWS.get(mask) if keep else None
    if rows is None:
        start = torch.zeros_like(mask.end) if mask.start is None else mask.start
        batch, heads, key_len = mask.end.shape
        rows = torch.stack((start, mask.end), dim=-1).view(batch, heads, 1, 2 * key_len)
        if keep:
            _KERNEL_ROWS[mask] = rows
    return rows
