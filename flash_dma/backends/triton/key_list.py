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
keys are scattered: a token-level mask keeping 1/8 of the keys costs 1/8 of the work. Two
launches over chunks of every row build it (:func:`build_key_list`), with no host
synchronisation, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import broadcast_strides, kernel_view, tensor_layout

_CHUNK = 1024  # keys per program
_MAX_CHUNKS = 1024  # chunks per row that the list kernel sums over in one step


@triton.jit(do_not_specialize=["stride_mb", "stride_mh", "stride_mk", "seqlen_k", "num_heads"])
def _kept_count_kernel(
    Mask, Counts,
    stride_mb, stride_mh, stride_mk,
    seqlen_k, num_heads,
    CHUNK: tl.constexpr,
):
    """Kept keys of one chunk of one (batch, head) row: ``Counts[row, chunk]``."""
    row = tl.program_id(0)
    b = row // num_heads
    h = row % num_heads
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    real = offs < seqlen_k
    mask_row = Mask + b.to(tl.int64) * stride_mb + h * stride_mh
    keep = tl.load(mask_row + offs.to(tl.int64) * stride_mk, mask=real, other=0) != 0
    tl.store(Counts + row * tl.num_programs(1) + tl.program_id(1), tl.sum(keep.to(tl.int32), 0))


@triton.jit(do_not_specialize=["stride_mb", "stride_mh", "stride_mk", "stride_lb", "stride_lh", "seqlen_k", "num_heads"])
def _key_list_kernel(
    Mask, Counts, KeyList,
    stride_mb, stride_mh, stride_mk, stride_lb, stride_lh,
    seqlen_k, num_heads,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
):
    """One chunk of one (batch, head) row of the key list, placed by the kept counts of the chunks before it."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    b = row // num_heads
    h = row % num_heads
    order = KeyList + b.to(tl.int64) * stride_lb + h * stride_lh
    rank = order + seqlen_k + 1
    mask_row = Mask + b.to(tl.int64) * stride_mb + h * stride_mh
    earlier = tl.arange(0, CHUNKS)
    counts = tl.load(Counts + row * num_chunks + earlier, mask=earlier < num_chunks, other=0)
    kept_before = tl.sum(tl.where(earlier < chunk, counts, 0), 0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    real = offs < seqlen_k
    keep = real & (tl.load(mask_row + offs.to(tl.int64) * stride_mk, mask=real, other=0) != 0)
    kept = keep.to(tl.int32)
    before = kept_before + tl.cumsum(kept, 0) - kept  # kept keys before each position
    tl.store(rank + offs, before, mask=real)
    # Kept keys fill the order from the front, dropped ones from the back.
    tl.store(order + tl.where(keep, before, seqlen_k - 1 - (offs - before)), offs, mask=real)
    if chunk == num_chunks - 1:
        tl.store(rank + seqlen_k, tl.sum(counts, 0))


count_launcher = Launcher(_kept_count_kernel, tensors=("Mask", "Counts"), specialized=())
key_list_launcher = Launcher(_key_list_kernel, tensors=("Mask", "Counts", "KeyList"), specialized=())


def build_key_list(mask: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The key list of a per-key mask.

    Two launches over ``(rows, chunks)`` grids, so that a long row is cut into parallel chunks:
    the kept keys of every chunk, then each chunk's part of the list, placed by the counts of the
    chunks before it (a decode step over a 512K-key cache would otherwise be one program's scan).

    Args:
        mask: bool or 0/1 integer ``[Bm, Hm, 1, Sk]`` (any strides).
        seqlen_k: the number of keys, Sk >= 1.

    Returns:
        ``[Bm, Hm, 2, Sk + 1]`` int32 (see the module docstring).
    """
    batch, heads = mask.shape[:2]
    chunk = max(_CHUNK, configs.next_power_of_2(triton.cdiv(seqlen_k, _MAX_CHUNKS)))
    num_chunks = triton.cdiv(seqlen_k, chunk)
    chunks_block = configs.next_power_of_2(num_chunks)
    key_list = torch.empty(batch, heads, 2, seqlen_k + 1, dtype=torch.int32, device=mask.device)
    counts = torch.empty(batch * heads, num_chunks, dtype=torch.int32, device=mask.device)
    view = kernel_view(mask)
    strides = broadcast_strides(mask)
    mask_strides = (strides[0], strides[1], strides[3])
    layout = (tensor_layout(mask), seqlen_k)
    grid = lambda meta: (batch * heads, num_chunks)  # noqa: E731
    count_launcher.launch(
        layout, [view, counts], lambda: ([view, counts, *mask_strides, seqlen_k, heads, chunk], (chunk,)),
        configs.single_program_config, grid,
    )
    key_list_launcher.launch(
        layout, [view, counts, key_list],
        # The constexprs go into the key, which picks the compiled kernel.
        lambda: ([view, counts, key_list, *mask_strides, *key_list.stride()[:2], seqlen_k, heads, chunk, chunks_block],
                 (chunk, chunks_block)),
        configs.single_program_config, grid,
    )
    return key_list
