"""Forward pass: online-softmax attention that walks only the non-empty tiles.

Grid: ``(row tiles, batch x heads, key splits)``. A program owns ``BLOCK_M`` query rows of one
head (or, with PACK_GQA, the rows of all query heads of one key/value head, so that each K/V
tile is loaded once per group) and visits key tiles in three loops:

1. PARTIAL tiles from the block summary: element-wise mask, bounds and band checks;
2. FULL (or, with no summary, all) tiles inside the causal/window band: no checks at all;
3. FULL tiles on the band's edges or past the last key: bounds and band checks.

With SPLIT, the key range is cut into ``num_splits`` parts whose partial results are merged
by ``_combine_splits_kernel`` through their log-sum-exps (flash-decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton.configs import (
    candidates,
    fit_to_problem,
    head_dim_block,
    length_bucket,
    multiprocessor_count,
    placeholder,
)
from flash_dma.backends.triton.launch import TunedKernel
from flash_dma.backends.triton.tiles import (
    LN2,
    LOG2E,
    band_tiles,
    bias_and_mask,
    edge_position,
    key_pointers,
    load_rows,
    scores_log2,
    split_range,
    tile_at,
    walk_plan,
)

MAX_SPLITS = 256
_KEYS_PER_SPLIT = 256  # fewer keys than this per split is not worth a split


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, start_n, q_idx,
    k_base, v_base, stride_ks, stride_vs,
    mask_rows, stride_mk, bias_rows, stride_bk,
    seqlen_k, band_lo, band_hi, head_dim,
    scale_log2, softcap_log2, scale_over_cap,
    CHECK_BOUNDS: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the key tile starting at ``start_n``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(k_base, start_n, stride_ks, seqlen_k, head_dim, CHECK_BOUNDS, BLOCK_N, BLOCK_D)
    s = scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale_log2, softcap_log2, scale_over_cap, SOFTCAP)
    bias_ptrs = bias_rows
    mask_ptrs = mask_rows
    # Per-key mask/bias: one row of pointers shared by every query row.
    if HAS_BIAS:
        bias_ptrs = key_pointers(bias_rows, offs_n, stride_bk, BIAS_PER_KEY, False)
    if APPLY_MASK:
        mask_ptrs = key_pointers(mask_rows, offs_n, stride_mk, MASK_PER_KEY, False)
    s = bias_and_mask(s, q_idx[:, None], offs_n[None, :], seqlen_k, band_lo, band_hi, bias_ptrs, mask_ptrs, HAS_BIAS, CHECK_BOUNDS, APPLY_MASK)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead, so p = 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_rows(v_base, start_n, stride_vs, seqlen_k, head_dim, CHECK_BOUNDS, BLOCK_N, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Mask, Bias, Lists, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_lb, stride_lh, stride_lr, list_width,
    stride_o_split, stride_ob, stride_os, stride_oh,
    stride_lse_split, stride_lse_b, stride_lse_h, stride_lse_q,
    seqlen_q, seqlen_k, rows, num_heads, num_kv_heads, head_dim,
    mask_head_div, bias_head_div, list_head_div, list_block_q, list_block_k,
    band_lo, band_hi,
    scale_log2, softcap_log2, scale_over_cap,
    rows_bucket, keys_bucket,  # autotuning keys only
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LISTS: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr,
    PACK_GQA: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Last row tiles first: under a causal band they hold the most work, so the grid's tail is light.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    group = num_heads // num_kv_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if PACK_GQA:
        # Rows are (query, head-in-group) pairs, heads fastest: one program serves a whole group.
        b = pid_bh // num_kv_heads
        kv_head = pid_bh % num_kv_heads
        q_idx = offs_m // group
        head = kv_head * group + offs_m % group
        first_head = kv_head * group
        q_lo = (pid_m * BLOCK_M) // group
        q_hi = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows) - 1) // group
    else:
        b = pid_bh // num_heads
        head = pid_bh % num_heads
        kv_head = head // group
        q_idx = offs_m
        first_head = head
        q_lo = pid_m * BLOCK_M
        q_hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows) - 1
    row_ok = offs_m < rows
    q_row = tl.minimum(q_idx, seqlen_q - 1).to(tl.int64)  # rows past the end read the last row
    b64 = b.to(tl.int64)

    q = tl.load(
        Q + b64 * stride_qb + (q_row * stride_qs + head * stride_qh)[:, None] + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d < head_dim)[None, :],
        other=0.0,
    )
    k_base = K + b64 * stride_kb + kv_head * stride_kh
    v_base = V + b64 * stride_vb + kv_head * stride_vh
    mask_rows = Mask
    bias_rows = Bias
    if HAS_MASK:
        if MASK_PER_KEY:
            mask_rows = Mask + b64 * stride_mb + (first_head // mask_head_div) * stride_mh
        else:
            mask_rows = Mask + b64 * stride_mb + (head // mask_head_div) * stride_mh + q_row * stride_mq
    if HAS_BIAS:
        if BIAS_PER_KEY:
            bias_rows = Bias + b64 * stride_bb + (first_head // bias_head_div) * stride_bh
        else:
            bias_rows = Bias + b64 * stride_bb + (head // bias_head_div) * stride_bh + q_row * stride_bq

    # Key tiles that the causal/window band leaves visible to these rows, then this split's share.
    diagonal = seqlen_k - seqlen_q
    lo, interior_lo, interior_hi, hi = band_tiles(q_lo, q_hi, seqlen_k, diagonal + band_lo, diagonal + band_hi, BLOCK_N)
    if SPLIT:
        lo, interior_lo, interior_hi, hi = split_range(lo, interior_lo, interior_hi, hi, split, tl.num_programs(2))
    band_lo = diagonal + band_lo
    band_hi = diagonal + band_hi

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    tiles_per_block = 1
    lists = Lists
    if HAS_LISTS:
        tiles_per_block = tl.where(list_block_k > 0, list_block_k // BLOCK_N, tl.cdiv(seqlen_k, BLOCK_N))
        list_row = tl.where(list_block_q > 0, pid_m // tl.maximum(list_block_q // BLOCK_M, 1), 0)
        lists = Lists + b64 * stride_lb + (first_head // list_head_div) * stride_lh + list_row * stride_lr
    partial_index, partial_lo, partial_hi, full_index, full_lo, interior_lo, interior_hi, full_hi = walk_plan(
        lists, list_width, tiles_per_block, lo, interior_lo, interior_hi, hi, HAS_LISTS
    )
    # Each loop reads the next tile's index one iteration ahead (`next_n`), so the K/V loads of a
    # tile never wait on the load of its index: the pipeliner can prefetch them.
    if HAS_MASK:
        start_n = tile_at(partial_index, partial_lo, tiles_per_block, False) * BLOCK_N
        for position in range(partial_lo, partial_hi):
            next_n = tile_at(partial_index, position + 1, tiles_per_block, False) * BLOCK_N
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, start_n, q_idx, k_base, v_base, stride_ks, stride_vs,
                mask_rows, stride_mk, bias_rows, stride_bk, seqlen_k, band_lo, band_hi, head_dim,
                scale_log2, softcap_log2, scale_over_cap,
                True, True, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, BLOCK_N, BLOCK_D, DOT_PRECISION,
            )
            start_n = next_n
    start_n = tile_at(full_index, interior_lo, tiles_per_block, not HAS_LISTS) * BLOCK_N
    for position in range(interior_lo, interior_hi):
        next_n = tile_at(full_index, position + 1, tiles_per_block, not HAS_LISTS) * BLOCK_N
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, start_n, q_idx, k_base, v_base, stride_ks, stride_vs,
            mask_rows, stride_mk, bias_rows, stride_bk, seqlen_k, band_lo, band_hi, head_dim,
            scale_log2, softcap_log2, scale_over_cap,
            False, False, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, BLOCK_N, BLOCK_D, DOT_PRECISION,
        )
        start_n = next_n
    start_n = tile_at(full_index, edge_position(0, full_lo, interior_lo, interior_hi), tiles_per_block, not HAS_LISTS) * BLOCK_N
    for j in range(0, (interior_lo - full_lo) + (full_hi - interior_hi)):
        next_n = tile_at(full_index, edge_position(j + 1, full_lo, interior_lo, interior_hi), tiles_per_block, not HAS_LISTS) * BLOCK_N
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, start_n, q_idx, k_base, v_base, stride_ks, stride_vs,
            mask_rows, stride_mk, bias_rows, stride_bk, seqlen_k, band_lo, band_hi, head_dim,
            scale_log2, softcap_log2, scale_over_cap,
            True, False, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, BLOCK_N, BLOCK_D, DOT_PRECISION,
        )
        start_n = next_n

    # Rows with no visible key: out = 0, lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    q_out = q_idx.to(tl.int64)
    tl.store(
        Out + split * stride_o_split + b64 * stride_ob + (q_out * stride_os + head * stride_oh)[:, None] + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d < head_dim)[None, :],
    )
    tl.store(
        Lse + split * stride_lse_split + b64 * stride_lse_b + head * stride_lse_h + q_out * stride_lse_q,
        lse,
        mask=row_ok,
    )


@triton.jit
def _combine_splits_kernel(
    OutSplits, LseSplits, Out, Lse,
    num_splits, seqlen_q, num_heads, head_dim,
    stride_o_split, stride_lse_split,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the splits of one (batch, query, head) row: weights ``exp(lse_s - lse)``."""
    row = tl.program_id(0).to(tl.int64)  # (b, q, h), h fastest
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    split_ok = offs_s < num_splits
    lse_s = tl.load(LseSplits + offs_s * stride_lse_split + row, mask=split_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2((lse_s - m) * LOG2E)
    total = tl.sum(weight, 0)
    partial = tl.load(
        OutSplits + offs_s[:, None] * stride_o_split + row * head_dim + offs_d[None, :],
        mask=split_ok[:, None] & (offs_d < head_dim)[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + row * head_dim + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    b = row // (seqlen_q * num_heads)
    q = (row // num_heads) % seqlen_q
    h = row % num_heads
    lse = tl.where(total == 0.0, float("-inf"), m + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(Lse + (b * num_heads + h) * seqlen_q + q, lse)


_TUNING_KEY = [
    "rows_bucket", "keys_bucket", "list_block_q", "list_block_k",
    "HAS_MASK", "HAS_BIAS", "HAS_LISTS", "MASK_PER_KEY", "BIAS_PER_KEY", "SOFTCAP", "PACK_GQA", "SPLIT", "BLOCK_D",
]


def _prune(configs, nargs, **kwargs):
    args = {**nargs, **kwargs}
    return fit_to_problem(candidates(args["Q"].device, args["BLOCK_D"], decode=args["rows"] <= 64), args)


_attn_fwd = TunedKernel(_attn_fwd_kernel, _TUNING_KEY, _prune)


def broadcast_strides(t: torch.Tensor | None) -> tuple[int, ...]:
    """Strides of a 4-D tensor with 0 on every size-1 (broadcast) dimension."""
    if t is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def head_divisor(t: torch.Tensor | None, num_heads: int) -> int:
    """Query head h reads head ``h // divisor`` of a ``[., 1|Hkv|H, ., .]`` tensor."""
    if t is None or t.shape[1] in (1, num_heads):
        return 1
    return num_heads // t.shape[1]


def kernel_view(t: torch.Tensor | None) -> torch.Tensor | None:
    # Triton reads bool tensors as bytes.
    return t.view(torch.uint8) if t is not None and t.dtype == torch.bool else t


def band(window_left: int, window_right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Visible offsets ``j - i - (Sk - Sq)`` as a closed range; unbounded sides become out-of-reach values."""
    reach = seqlen_q + seqlen_k + 1
    return (-reach if window_left < 0 else -window_left), (reach if window_right < 0 else window_right)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    lists: torch.Tensor | None,
    list_block_q: int,
    list_block_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Sk, Hkv, D]`` (last dimension contiguous).
        mask, bias: ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` or None.
        lists: a block summary's ``kv_lists`` ``[Bl, Hl, NQB, 2, 2, NKB + 1]``, or None (every tile).
        list_block_q, list_block_k: the summary's block sizes, 0 for an axis of one block.
        num_splits: split-KV parts; None picks them from the problem and the GPU.

    Returns:
        ``out`` ``[B, Sq, H, D]`` in q's dtype and ``lse`` ``[B, H, Sq]`` float32.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    block_d = head_dim_block(head_dim)
    list_heads = 1 if lists is None else lists.shape[1]
    # Packing a group's heads into one tile needs one summary row shared by all of its rows.
    pack_gqa = (
        group > 1 and seqlen_q * group <= 64 and list_heads in (1, num_kv_heads) and list_block_q == 0
    )
    rows = seqlen_q * group if pack_gqa else seqlen_q
    programs = batch * (num_kv_heads if pack_gqa else num_heads) * triton.cdiv(rows, 64)
    if num_splits is None:
        sms = multiprocessor_count(q.device)
        # About two programs per multiprocessor: measured faster than one wave at Sk = 512K.
        num_splits = 1 if programs >= sms else max(1, min(2 * sms // programs, seqlen_k // _KEYS_PER_SPLIT, MAX_SPLITS))
    num_splits = max(1, min(num_splits, MAX_SPLITS))

    out = torch.empty(batch, seqlen_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_heads, seqlen_q, dtype=torch.float32, device=q.device)
    if num_splits > 1:
        out_target = torch.empty(num_splits, batch, seqlen_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse_target = torch.empty(num_splits, batch, seqlen_q, num_heads, dtype=torch.float32, device=q.device)
        lse_strides = (lse_target.stride(0), lse_target.stride(1), lse_target.stride(3), lse_target.stride(2))
    else:
        out_target, lse_target = out.unsqueeze(0), lse
        lse_strides = (0, *lse.stride())

    band_lo, band_hi = band(window_left, window_right, seqlen_q, seqlen_k)
    log2e = 1.4426950408889634
    mask_view = kernel_view(mask)
    lists_arg = lists if lists is not None else placeholder(q.device, torch.int32)
    args = dict(
        Q=q, K=k, V=v, Mask=mask_view, Bias=bias, Lists=lists_arg, Out=out_target, Lse=lse_target,
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
        stride_kb=k.stride(0), stride_ks=k.stride(1), stride_kh=k.stride(2),
        stride_vb=v.stride(0), stride_vs=v.stride(1), stride_vh=v.stride(2),
        **dict(zip(("stride_mb", "stride_mh", "stride_mq", "stride_mk"), broadcast_strides(mask))),
        **dict(zip(("stride_bb", "stride_bh", "stride_bq", "stride_bk"), broadcast_strides(bias))),
        **dict(zip(("stride_lb", "stride_lh", "stride_lr"), broadcast_strides(lists)[:3])),
        list_width=0 if lists is None else lists.shape[-1],
        stride_o_split=out_target.stride(0), stride_ob=out_target.stride(1),
        stride_os=out_target.stride(2), stride_oh=out_target.stride(3),
        stride_lse_split=lse_strides[0], stride_lse_b=lse_strides[1],
        stride_lse_h=lse_strides[2], stride_lse_q=lse_strides[3],
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, rows=rows,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        mask_head_div=head_divisor(mask, num_heads), bias_head_div=head_divisor(bias, num_heads),
        list_head_div=1 if lists is None else head_divisor(lists, num_heads),
        list_block_q=list_block_q, list_block_k=list_block_k,
        band_lo=band_lo, band_hi=band_hi,
        scale_log2=softmax_scale * log2e, softcap_log2=softcap * log2e,
        scale_over_cap=softmax_scale / softcap if softcap > 0 else 0.0,
        rows_bucket=length_bucket(rows), keys_bucket=length_bucket(seqlen_k),
        HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_LISTS=lists is not None,
        MASK_PER_KEY=mask is not None and mask.shape[2] == 1 and (not pack_gqa or mask.shape[1] != num_heads or group == 1),
        BIAS_PER_KEY=bias is not None and bias.shape[2] == 1 and (not pack_gqa or bias.shape[1] != num_heads or group == 1),
        SOFTCAP=softcap > 0, PACK_GQA=pack_gqa, SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=block_d,
    )

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]), batch * (num_kv_heads if pack_gqa else num_heads), num_splits)

    _attn_fwd(grid, args)

    if num_splits > 1:
        _combine_splits_kernel[(batch * seqlen_q * num_heads,)](
            out_target, lse_target, out, lse,
            num_splits, seqlen_q, num_heads, head_dim,
            out_target.stride(0), lse_target.stride(0),
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out, lse
