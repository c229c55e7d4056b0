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

The Triton kernels gather each tile's rows of K and V through the order as they go. The Hopper
kernels copy whole tiles with TMA instead, so :func:`gather_kept_keys` first gathers the kept
keys' K and V once per call, in list order, into dense tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import broadcast_strides, kernel_view, tensor_layout
from flash_dma.integers import cdiv

_CHUNK = 1024  # keys per program
_MAX_CHUNKS = 1024  # chunks per row that the list kernel sums over in one step
GATHER_BLOCK = 128  # list slots per gather program: the largest key tile that reads the gathered rows


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


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "seqlen_k", "num_kv_heads"])
def _gather_kept_kernel(
    K, V, KeyList, KeptK, KeptV, Lengths,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, seqlen_k, num_kv_heads, head_dim,
    LENGTHS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Slots ``[BLOCK * program_id(0), +BLOCK)`` of one (batch, kv head)'s list:
    ``KeptK[b, slot, h] = K[b, order[slot], h]``, and V alike.

    Only tiles that hold a kept key are written, and they are written whole: their slots past
    the kept count hold zeros, so that a kernel masking their scores never multiplies a
    probability of 0 by an unwritten row, nor by a dropped key's. With LENGTHS, kept keys at or
    past ``Lengths[b]`` are zeros too: a KV cache's slots past an entry's keys may hold NaN.
    """
    b = tl.program_id(1) // num_kv_heads
    h = tl.program_id(1) % num_kv_heads
    order = KeyList + b.to(tl.int64) * stride_lb + h * stride_lh
    kept = tl.load(order + 2 * seqlen_k + 1)  # rank[Sk]: the kept count
    first = tl.program_id(0) * BLOCK
    if first < kept:
        slots = first + tl.arange(0, BLOCK)  # [BLOCK]
        cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        real = (slots < seqlen_k)[:, None] & (cols < head_dim)[None, :]  # [BLOCK, BLOCK_D]
        keys = tl.load(order + slots, mask=slots < seqlen_k, other=0).to(tl.int64)
        kept_rows = b.to(tl.int64) * stride_ob + h * stride_oh + slots.to(tl.int64)[:, None] * stride_os + cols[None, :]
        k_rows = b.to(tl.int64) * stride_kb + h * stride_kh + keys[:, None] * stride_ks + cols[None, :]
        listed = real & (slots < kept)[:, None]
        if LENGTHS:
            listed = listed & (keys < tl.load(Lengths + b))[:, None]
        tl.store(KeptK + kept_rows, tl.load(K + k_rows, mask=listed, other=0.0), mask=real)
        v_rows = b.to(tl.int64) * stride_vb + h * stride_vh + keys[:, None] * stride_vs + cols[None, :]
        tl.store(KeptV + kept_rows, tl.load(V + v_rows, mask=listed, other=0.0), mask=real)


count_launcher = Launcher(_kept_count_kernel, tensors=("Mask", "Counts"), specialized=())
key_list_launcher = Launcher(_key_list_kernel, tensors=("Mask", "Counts", "KeyList"), specialized=())
# Strides divisible by 16 let whole rows move as 16-byte vectors.
gather_launcher = Launcher(
    _gather_kept_kernel, tensors=("K", "V", "KeyList", "KeptK", "KeptV", "Lengths"),
    specialized=(
        "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
        "stride_ob", "stride_os", "stride_oh", "head_dim",
    ),
)


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
    chunk = max(_CHUNK, configs.next_power_of_2(cdiv(seqlen_k, _MAX_CHUNKS)))
    num_chunks = cdiv(seqlen_k, chunk)
    chunks_block = configs.next_power_of_2(num_chunks)
    key_list = torch.empty(batch, heads, 2, seqlen_k + 1, dtype=torch.int32, device=mask.device)
    counts = torch.empty(batch * heads, num_chunks, dtype=torch.int32, device=mask.device)
    view = kernel_view(mask)
    strides = broadcast_strides(mask)
    mask_strides = (strides[0], strides[1], strides[3])
    layout = (tensor_layout(mask), seqlen_k)
    grid = lambda meta: (batch * heads, num_chunks)  # noqa: E731
    count_launcher.launch(
        layout, [view, counts], lambda: ([view, counts, *mask_strides, seqlen_k, heads, chunk], ()),
        configs.single_program_config, grid,
    )
    key_list_launcher.launch(
        layout, [view, counts, key_list],
        lambda: ([view, counts, key_list, *mask_strides, *key_list.stride()[:2], seqlen_k, heads, chunk, chunks_block], ()),
        configs.single_program_config, grid,
    )
    return key_list


def gather_kept_keys(
    k: torch.Tensor, v: torch.Tensor, key_list: torch.Tensor, lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the kept keys, in list order, for kernels that copy whole tiles of them.

    Args:
        k, v: ``[B, Sk, Hkv, D]`` (last dimension contiguous).
        key_list: ``[1|B, 1|Hkv, 2, Sk + 1]`` from :func:`build_key_list`.
        lengths: ``[B]`` int32 keys of each entry (a KV cache's), or None for all ``Sk``: the
            kept keys past an entry's length are gathered as zeros.

    Returns:
        ``(kept_k, kept_v)``, contiguous ``[B, Sk, Hkv, D]``: slot ``j`` of (b, h) holds the key at
        ``order[j]``. Written are the tiles of :data:`GATHER_BLOCK` slots that hold a kept key;
        the rest is never read (the list's tiles end with its kept count).
    """
    batch, seqlen_k, num_kv_heads, head_dim = k.shape
    kept_k = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    kept_v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    tensors = [k, v, key_list, kept_k, kept_v, key_list if lengths is None else lengths]
    block_d = configs.next_power_of_2(head_dim)
    list_strides = broadcast_strides(key_list)

    def build():
        args = [*tensors, *k.stride()[:3], *v.stride()[:3], *kept_k.stride()[:3], *list_strides[:2], seqlen_k, num_kv_heads, head_dim]
        return args + [lengths is not None, GATHER_BLOCK, block_d], (k.dtype, lengths is not None, block_d)

    gather_launcher.launch(
        (tensor_layout(k), tensor_layout(v), tensor_layout(key_list), lengths is None), tensors, build, configs.single_program_config,
        lambda meta: (cdiv(seqlen_k, GATHER_BLOCK), batch * num_kv_heads),
    )
    return kept_k, kept_v
