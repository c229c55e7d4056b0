"""Merging partial attention results: ``(out, lse)`` of the same query rows over two sets of keys.

Context parallelism attends a rank's queries to each shard's keys in turn; each call returns its
rows' output and log-sum-exp over the keys it saw. One pass folds a call's result into the
running one, in float32 registers, and stores it rounded once, in the destination's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import tensor_layout
from flash_dma.integers import cdiv

_BLOCK_M = 32  # rows per program: 32 x 128 elements of one head, one tile of loads


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "stride_qb", "stride_qh", "rows", "num_heads"])
def _merge_kernel(
    Running, Lse, Part, PartLse, Dest,
    stride_rb, stride_rs, stride_rh, stride_pb, stride_ps, stride_ph, stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh, stride_qb, stride_qh,
    rows, num_heads, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rows ``[BLOCK_M * program_id(0), +BLOCK_M)`` of one (batch, head):
    ``Dest = (Running * exp(Lse) + Part * exp(PartLse)) / exp(new)`` and ``Lse = new``, with
    ``new = logaddexp(Lse, PartLse)``; rows where both are -inf (no key seen) get 0 and -inf."""
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    real_m = offs_m < rows
    real = real_m[:, None] & (offs_d < head_dim)[None, :]  # [BLOCK_M, BLOCK_D]
    lse_rows = Lse + b.to(tl.int64) * stride_lb + h * stride_lh + offs_m  # the row axis is contiguous
    old = tl.load(lse_rows, mask=real_m, other=float("-inf"))
    part = tl.load(PartLse + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m, mask=real_m, other=float("-inf"))
    top = tl.maximum(old, part)
    empty = top == float("-inf")  # no key seen yet: both weights are exp(-inf) = 0
    shift = tl.where(empty, 0.0, top)
    keep = tl.exp(old - shift)
    take = tl.exp(part - shift)
    total = tl.where(empty, 1.0, keep + take)  # else >= 1: one of the two is exp(0)
    rows64 = offs_m.to(tl.int64)[:, None]
    running = tl.load(
        Running + b.to(tl.int64) * stride_rb + h * stride_rh + rows64 * stride_rs + offs_d[None, :], mask=real, other=0.0
    ).to(tl.float32)
    partial = tl.load(
        Part + b.to(tl.int64) * stride_pb + h * stride_ph + rows64 * stride_ps + offs_d[None, :], mask=real, other=0.0
    ).to(tl.float32)
    merged = running * (keep / total)[:, None] + partial * (take / total)[:, None]
    dest = Dest + b.to(tl.int64) * stride_db + h * stride_dh + rows64 * stride_ds + offs_d[None, :]
    tl.store(dest, merged.to(Dest.dtype.element_ty), mask=real)
    tl.store(lse_rows, tl.where(empty, float("-inf"), shift + tl.log(total)), mask=real_m)


# Strides divisible by 16 let whole rows move as 16-byte vectors.
merge_launcher = Launcher(
    _merge_kernel, tensors=("Running", "Lse", "Part", "PartLse", "Dest"),
    specialized=(
        "stride_rb", "stride_rs", "stride_rh", "stride_pb", "stride_ps", "stride_ph",
        "stride_db", "stride_ds", "stride_dh", "head_dim",
    ),
)


def merge_partial(
    running: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, dest: torch.Tensor
) -> None:
    """Fold one call's result into the running one: ``dest`` gets the merged output, ``lse`` the
    merged log-sum-exp, in place (``dest`` may be ``running``).

    Args:
        running, dest: ``[B, R, H, D]`` (any dtype; last dimension contiguous).
        lse: ``[B, H, R]`` float32, the running log-sum-exp (row axis contiguous).
        part_out: ``[B, R, H, D]`` (last dimension contiguous), part_lse: ``[B, H, R]`` float32
            (row axis contiguous): the call's result.
    """
    batch, rows, num_heads, head_dim = running.shape
    tensors = [running, lse, part_out, part_lse, dest]
    block_d = configs.next_power_of_2(head_dim)

    def build():
        args = [
            *tensors, *running.stride()[:3], *part_out.stride()[:3], *dest.stride()[:3], *lse.stride()[:2],
            *part_lse.stride()[:2], rows, num_heads, head_dim,
        ]
        return args + [_BLOCK_M, block_d], (running.dtype, dest.dtype, block_d)

    merge_launcher.launch(
        tuple(map(tensor_layout, tensors)), tensors, build, configs.single_program_config,
        lambda meta: (cdiv(rows, _BLOCK_M), batch * num_heads),
    )
