"""Key lists: the kept keys of a per-key mask, in the form the kernels gather them in.

A per-key mask ``[Bm, Hm, 1, Sk]`` (one set of keys shared by every query: the Doge form) is
compacted into a key list ``[Bm, Hm, 2, Sk + 1]`` int32, one row per (batch, mask head):

- ``[..., 0, :Sk]``, the *order*: the kept key positions in ascending order, then the dropped
  ones (in descending order). It is a permutation of the keys, so the dK/dV kernel, which owns
  ``BLOCK_N`` consecutive slots, writes every key's gradient exactly once: the kept keys' sums,
  and zeros for the dropped ones.
- ``[..., 1, :]``, the *rank*: ``rank[x]`` is the number of kept keys before position ``x``, so
  ``rank[Sk]`` is the count. A causal or window band of positions maps to a range of the order
  with two loads.

The kernels then attend over ``ceil(count / BLOCK_N)`` tiles of kept keys only, however the kept
keys are scattered: a token-level mask keeping 1/8 of the keys costs 1/8 of the work. One
program per row builds it in one pass over the mask, with no host synchronisation, so it can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import broadcast_strides, kernel_view, placeholder

_CHUNK = 1024  # keys per step of the scan
FULL, PARTIAL = tl.constexpr(2), tl.constexpr(1)  # block_mask.FULL, PARTIAL


@triton.jit(do_not_specialize=[
    "stride_mb", "stride_mh", "stride_mk", "stride_sb", "stride_sh", "stride_sk",
    "stride_lb", "stride_lh", "seqlen_k", "num_heads", "mask_head_div", "state_head_div", "block_k",
])
def _key_list_kernel(
    Mask, State, KeyList,
    stride_mb, stride_mh, stride_mk, stride_sb, stride_sh, stride_sk, stride_lb, stride_lh,
    seqlen_k, num_heads, mask_head_div, state_head_div, block_k,
    HAS_MASK: tl.constexpr, HAS_STATE: tl.constexpr, CHUNK: tl.constexpr,
):
    """One (batch, head) row. A key is kept if the mask keeps it or, with a block state, if its
    block is FULL, or PARTIAL and the mask keeps it (``block_mask.effective_mask_rows``)."""
    b = tl.program_id(0) // num_heads
    h = tl.program_id(0) % num_heads
    order = KeyList + b.to(tl.int64) * stride_lb + h * stride_lh
    rank = order + seqlen_k + 1
    mask_row = Mask + b.to(tl.int64) * stride_mb + (h // mask_head_div) * stride_mh
    state_row = State + b.to(tl.int64) * stride_sb + (h // state_head_div) * stride_sh
    kept_before = 0
    for start in range(0, seqlen_k, CHUNK):
        offs = start + tl.arange(0, CHUNK)  # [CHUNK]
        real = offs < seqlen_k
        keep = real
        if HAS_MASK:
            keep = real & (tl.load(mask_row + offs.to(tl.int64) * stride_mk, mask=real, other=0) != 0)
        if HAS_STATE:
            state = tl.load(state_row + (offs // block_k) * stride_sk, mask=real, other=0)
            if HAS_MASK:
                keep = (state == FULL) | ((state == PARTIAL) & keep)
            else:
                keep = real & (state == FULL)
        kept = keep.to(tl.int32)
        before = kept_before + tl.cumsum(kept, 0) - kept  # kept keys before each position
        tl.store(rank + offs, before, mask=real)
        # Kept keys fill the order from the front, dropped ones from the back.
        tl.store(order + tl.where(keep, before, seqlen_k - 1 - (offs - before)), offs, mask=real)
        kept_before += tl.sum(kept, 0)
    tl.store(rank + seqlen_k, kept_before)


key_list_launcher = Launcher(_key_list_kernel, tensors=("Mask", "State", "KeyList"), specialized=())


def build_key_list(
    mask: torch.Tensor | None, seqlen_k: int, state: torch.Tensor | None = None, block_k: int = 0
) -> torch.Tensor:
    """The key list of a per-key mask and/or a per-key block state.

    Args:
        mask: bool or 0/1 integer ``[Bm, Hm, 1, Sk]``, or None (then ``state`` decides alone).
        seqlen_k: the number of keys, Sk >= 1.
        state: a block summary's states ``[Bs, Hs, 1, NKB]`` (EMPTY/PARTIAL/FULL), or None.
        block_k: keys per block of ``state``; 0 when the state is one block over all keys.
            The batch and head sizes of ``mask`` and ``state`` must broadcast (equal, or 1).

    Returns:
        ``[max(Bm, Bs), max(Hm, Hs), 2, Sk + 1]`` int32 (see the module docstring).
    """
    present = [t for t in (mask, state) if t is not None]
    device = present[0].device
    batch = max(t.shape[0] for t in present)
    heads = max(t.shape[1] for t in present)
    key_list = torch.empty(batch, heads, 2, seqlen_k + 1, dtype=torch.int32, device=device)
    mask_strides, state_strides = broadcast_strides(mask), broadcast_strides(state)
    args = [
        placeholder(device, torch.uint8) if mask is None else kernel_view(mask),
        placeholder(device, torch.int8) if state is None else state,
        key_list,
        mask_strides[0], mask_strides[1], mask_strides[3], state_strides[0], state_strides[1], state_strides[3],
        key_list.stride(0), key_list.stride(1), seqlen_k, heads,
        1 if mask is None or mask.shape[1] == 1 else heads // mask.shape[1],
        1 if state is None or state.shape[1] == 1 else heads // state.shape[1],
        block_k if block_k > 0 else seqlen_k,
        mask is not None, state is not None, _CHUNK,
    ]
    key_list_launcher(lambda meta: (batch * heads,), args, (mask is not None, state is not None), configs.single_program_config)
    return key_list
