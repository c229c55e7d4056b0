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
from flash_dma.backends.triton.layout import broadcast_strides, kernel_view, tensor_layout

_CHUNK = 1024  # keys per step of the scan


@triton.jit(do_not_specialize=["stride_mb", "stride_mh", "stride_mk", "stride_lb", "stride_lh", "seqlen_k", "num_heads"])
def _key_list_kernel(
    Mask, KeyList,
    stride_mb, stride_mh, stride_mk, stride_lb, stride_lh,
    seqlen_k, num_heads,
    CHUNK: tl.constexpr,
):
    """One (batch, head) row of the key list."""
    b = tl.program_id(0) // num_heads
    h = tl.program_id(0) % num_heads
    order = KeyList + b.to(tl.int64) * stride_lb + h * stride_lh
    rank = order + seqlen_k + 1
    mask_row = Mask + b.to(tl.int64) * stride_mb + h * stride_mh
    kept_before = 0
    for start in range(0, seqlen_k, CHUNK):
        offs = start + tl.arange(0, CHUNK)  # [CHUNK]
        real = offs < seqlen_k
        keep = real & (tl.load(mask_row + offs.to(tl.int64) * stride_mk, mask=real, other=0) != 0)
        kept = keep.to(tl.int32)
        before = kept_before + tl.cumsum(kept, 0) - kept  # kept keys before each position
        tl.store(rank + offs, before, mask=real)
        # Kept keys fill the order from the front, dropped ones from the back.
        tl.store(order + tl.where(keep, before, seqlen_k - 1 - (offs - before)), offs, mask=real)
        kept_before += tl.sum(kept, 0)
    tl.store(rank + seqlen_k, kept_before)


key_list_launcher = Launcher(_key_list_kernel, tensors=("Mask", "KeyList"), specialized=())


def build_key_list(mask: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The key list of a per-key mask.

    Args:
        mask: bool or 0/1 integer ``[Bm, Hm, 1, Sk]`` (any strides).
        seqlen_k: the number of keys, Sk >= 1.

    Returns:
        ``[Bm, Hm, 2, Sk + 1]`` int32 (see the module docstring).
    """
    batch, heads = mask.shape[:2]
    key_list = torch.empty(batch, heads, 2, seqlen_k + 1, dtype=torch.int32, device=mask.device)
    tensors = [kernel_view(mask), key_list]

    def build():
        strides = broadcast_strides(mask)
        args = [*tensors, strides[0], strides[1], strides[3], *key_list.stride()[:2], seqlen_k, heads, _CHUNK]
        return args, ()

    key_list_launcher.launch(
        (tensor_layout(mask), seqlen_k), tensors, build, configs.single_program_config, lambda meta: (batch * heads,)
    )
    return key_list
