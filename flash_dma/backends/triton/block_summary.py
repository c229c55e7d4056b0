"""The block summary on the GPU: block states and their sorted lists in three launches.

``build_block_mask`` on a CUDA mask comes here (the torch version in ``block_mask.py`` serves
CPU tensors). Nothing synchronises with the host, so a summary built inside a call can be
captured in a CUDA graph; under ``torch.compile`` both steps are custom ops.

- ``_block_state_kernel``: one program per block reads its ``block_q x block_k`` elements and
  writes EMPTY (none true), PARTIAL or FULL (all true).
- ``_block_lists_kernel``: one program per row of states writes that row's PARTIAL and FULL
  lists (``block_mask.block_lists`` defines the layout); run on the states and on their
  transpose for ``kv_lists`` and ``q_lists``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import kernel_view, tensor_layout
from flash_dma.integers import cdiv

_ROWS, _COLS = 16, 128  # mask elements read per step of a block
_CHUNK = 1024  # states per step of a row
PARTIAL, FULL = tl.constexpr(1), tl.constexpr(2)  # block_mask.PARTIAL, FULL


@triton.jit(do_not_specialize=[
    "stride_mb", "stride_mh", "stride_mq", "stride_mk", "stride_sb", "stride_sh", "stride_sq", "stride_sk",
    "seqlen_q", "seqlen_k", "num_heads", "key_blocks", "block_q", "block_k",
])
def _block_state_kernel(
    Mask, State,
    stride_mb, stride_mh, stride_mq, stride_mk, stride_sb, stride_sh, stride_sq, stride_sk,
    seqlen_q, seqlen_k, num_heads, key_blocks, block_q, block_k,
    ROWS: tl.constexpr, COLS: tl.constexpr,
):
    qb = tl.program_id(0) // key_blocks
    kb = tl.program_id(0) % key_blocks
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    q_end = tl.minimum(qb * block_q + block_q, seqlen_q)
    k_end = tl.minimum(kb * block_k + block_k, seqlen_k)
    any_true = 0
    all_true = 1
    for r in range(qb * block_q, q_end, ROWS):
        rows = r + tl.arange(0, ROWS)
        for c in range(kb * block_k, k_end, COLS):
            cols = c + tl.arange(0, COLS)
            inside = (rows < q_end)[:, None] & (cols < k_end)[None, :]  # [ROWS, COLS]
            ptrs = base + rows.to(tl.int64)[:, None] * stride_mq + cols.to(tl.int64)[None, :] * stride_mk
            true = (tl.load(ptrs, mask=inside, other=0) != 0).to(tl.int32)
            any_true = tl.maximum(any_true, tl.max(tl.max(true, 1), 0))
            all_true = tl.minimum(all_true, tl.min(tl.min(tl.where(inside, true, 1), 1), 0))
    state = any_true + any_true * all_true  # EMPTY 0, PARTIAL 1, FULL 2
    tl.store(State + b.to(tl.int64) * stride_sb + h * stride_sh + qb * stride_sq + kb * stride_sk, state.to(tl.int8))


@triton.jit(do_not_specialize=[
    "stride_sb", "stride_sh", "stride_sr", "stride_sc", "stride_lb", "stride_lh", "stride_lr",
    "rows", "columns", "num_heads",
])
def _block_lists_kernel(
    State, Lists,
    stride_sb, stride_sh, stride_sr, stride_sc, stride_lb, stride_lh, stride_lr,
    rows, columns, num_heads,
    CHUNK: tl.constexpr,
):
    """One row of states: its PARTIAL then FULL list, each ``[index (listed columns, then 0), rank]``."""
    b = tl.program_id(0) // (num_heads * rows)
    h = (tl.program_id(0) // rows) % num_heads
    r = tl.program_id(0) % rows
    state_row = State + b.to(tl.int64) * stride_sb + h * stride_sh + r * stride_sr
    width = columns + 1
    for which in tl.static_range(2):
        index = Lists + b.to(tl.int64) * stride_lb + h * stride_lh + r.to(tl.int64) * stride_lr + which * 2 * width
        rank = index + width
        listed_before = 0
        for start in range(0, columns, CHUNK):
            offs = start + tl.arange(0, CHUNK)  # [CHUNK]
            real = offs < columns
            state = tl.load(state_row + offs * stride_sc, mask=real, other=0)
            hit = (state == PARTIAL + which) & real
            listed = hit.to(tl.int32)
            before = listed_before + tl.cumsum(listed, 0) - listed
            tl.store(rank + offs, before, mask=real)
            # Listed columns go to the front in order; the rest of the list is zero-filled from the back.
            tl.store(index + tl.where(hit, before, columns - 1 - (offs - before)), tl.where(hit, offs, 0), mask=real)
            listed_before += tl.sum(listed, 0)
        tl.store(rank + columns, listed_before)
        tl.store(index + columns, 0)


state_launcher = Launcher(_block_state_kernel, tensors=("Mask", "State"), specialized=())
lists_launcher = Launcher(_block_lists_kernel, tensors=("State", "Lists"), specialized=())


def block_state(mask: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """``[Bm, Hm, NQB, NKB]`` int8 EMPTY/PARTIAL/FULL states of ``mask`` ``[Bm, Hm, Sqm, Skm]``.

    ``block_q``/``block_k`` apply to axes longer than 1; a broadcast axis is one block.
    """
    nb, nh, sq, sk = mask.shape
    block_q, block_k = (block_q if sq > 1 else 1), (block_k if sk > 1 else 1)
    nqb, nkb = cdiv(sq, block_q), cdiv(sk, block_k)
    state = torch.empty(nb, nh, nqb, nkb, dtype=torch.int8, device=mask.device)
    tensors = [kernel_view(mask), state]
    state_launcher.launch(
        (tensor_layout(mask), block_q, block_k), tensors,
        lambda: ([*tensors, *mask.stride(), *state.stride(), sq, sk, nh, nkb, block_q, block_k, _ROWS, _COLS], ()),
        configs.single_program_config, lambda meta: (nqb * nkb, nb * nh),
    )
    return state


def block_lists(state: torch.Tensor, transpose: bool) -> torch.Tensor:
    """The lists of ``state`` (of its last two axes swapped when ``transpose``): ``[Bm, Hm, R, 2, 2, C + 1]``."""
    nb, nh = state.shape[:2]
    strides = list(state.stride())
    rows, columns = state.shape[2], state.shape[3]
    if transpose:
        rows, columns = columns, rows
        strides[2], strides[3] = strides[3], strides[2]
    lists = torch.empty(nb, nh, rows, 2, 2, columns + 1, dtype=torch.int32, device=state.device)
    lists_launcher.launch(
        (tensor_layout(state), transpose), [state, lists],
        lambda: ([state, lists, *strides, *lists.stride()[:3], rows, columns, nh, _CHUNK], ()),
        configs.single_program_config, lambda meta: (nb * nh * rows,),
    )
    return lists
