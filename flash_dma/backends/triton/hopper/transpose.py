"""FP8 value transposition kernel: V ``[B, Sk, Hkv, D]`` copied keys-contiguous for the Hopper FP8 forward.

8-bit wgmma takes no transposed operand, so the forward's ``P V`` reads V along its keys
(docs/design-notes.md, "FP8 forward"). Each program copies a tile of keys x columns, read along the
columns and written along the keys, both coalesced: torch's permuted copy reads a byte per thread
across rows, several times slower on the H100.

Within each group of 16 keys the copy puts the keys in the order in which the forward's softmax
holds their probabilities (``key_at_column``), so that P becomes ``P V``'s 8-bit operand
without moving a byte between threads (as FlashAttention-3 permutes V for its FP8 forward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import tensor_layout
from flash_dma.integers import cdiv

_BLOCK_K = 64  # keys per program
KEY_ALIGNMENT = 16  # the copy's rows are padded to it: the TMA's row alignment, in bytes; also a key group's length


@triton.jit
def key_at_column(columns):
    """The key that each column of the copy holds: its group of 16 keys in place, and within it,
    at ``4 t + 2 j + e``, key ``8 j + 2 t + e`` (the one thread ``t`` of a quad holds in wgmma's
    accumulator, register pair ``j``, element ``e``), where wgmma's 8-bit A operand wants thread
    ``t``'s bytes. ``hopper/forward._value_operand`` permutes P's columns the same way."""
    n = columns % 16
    return columns - n + ((n >> 1) & 1) * 8 + ((n >> 2) & 3) * 2 + (n & 1)


@triton.jit(do_not_specialize=["seqlen_k", "num_kv_heads", "stride_b", "stride_s", "stride_h", "padded_k"])
def _transpose_values_kernel(
    V, VT,
    seqlen_k, num_kv_heads, stride_b, stride_s, stride_h, padded_k,
    HEAD_DIM: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Columns ``[program 0 * BLOCK_K, + BLOCK_K)`` of one (batch, key/value head)'s copy:
    ``VT[b, h, d, n] = V[b, key_at_column(n), h, d]``, zeros for the keys past Sk. Each row of V is
    read whole and each column written in one run, both coalesced."""
    head = tl.program_id(1)  # b * Hkv + h
    written = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    keys = key_at_column(written)  # [BLOCK_K]
    columns = tl.arange(0, COLUMNS)  # [COLUMNS]
    inside = (keys[:, None] < seqlen_k) & (columns[None, :] < HEAD_DIM)  # [BLOCK_K, COLUMNS]
    source = V + (head // num_kv_heads).to(tl.int64) * stride_b + (head % num_kv_heads) * stride_h
    tile = tl.load(source + keys[:, None].to(tl.int64) * stride_s + columns[None, :], mask=inside, other=0)  # [BLOCK_K, COLUMNS]
    target = VT + (head.to(tl.int64) * HEAD_DIM + columns[:, None]) * padded_k + written[None, :]  # [COLUMNS, BLOCK_K]
    tl.store(target, tl.trans(tile), mask=(columns[:, None] < HEAD_DIM) & (written[None, :] < padded_k))


_launcher = Launcher(_transpose_values_kernel, tensors=("V", "VT"), specialized=())


def transposed_values(v: torch.Tensor) -> torch.Tensor:
    """``v`` ``[B, Sk, Hkv, D]`` (8-bit, columns contiguous) as ``[B, Hkv, D, Sk']``, keys
    contiguous in the order of ``key_at_column``; ``Sk'`` is Sk rounded up to ``KEY_ALIGNMENT``,
    the keys past Sk zeros (the forward reads whole groups of 16: a zero probability times a NaN
    would be NaN)."""
    batch, seqlen_k, num_kv_heads, head_dim = v.shape
    if v.stride(3) != 1:
        v = v.contiguous()
    padded_k = cdiv(seqlen_k, KEY_ALIGNMENT) * KEY_ALIGNMENT
    vt = torch.empty(batch, num_kv_heads, head_dim, padded_k, dtype=v.dtype, device=v.device)
    # As bytes: the interpreter's numpy has no 8-bit floats, and a copy needs no arithmetic.
    tensors = [v.view(torch.uint8), vt.view(torch.uint8)]
    _launcher.launch(
        (tensor_layout(v),), tensors,
        lambda: ([*tensors, seqlen_k, num_kv_heads, v.stride(0), v.stride(1), v.stride(2), padded_k,
                  head_dim, configs.next_power_of_2(head_dim), _BLOCK_K], ()),
        configs.single_program_config, lambda meta: (cdiv(seqlen_k, _BLOCK_K), batch * num_kv_heads),
    )
    return vt
