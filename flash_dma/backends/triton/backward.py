"""Backward pass: dQ, dK, dV, and the bias gradient in the bias's own shape.

Three launches, none with atomics for dQ, dK or dV:

1. ``_delta_kernel``: ``delta = rowsum(dO * O)`` per (batch, head, query).
2. ``_dkdv_kernel``, grid ``(key tiles, batch x kv heads)``: a program owns BLOCK_N keys of one
   key/value head and, for each query head of its group, walks the query tiles that the
   summary's transposed lists leave non-empty (partial, full interior, full edge), recomputing
   P and accumulating dK and dV in registers. It also makes the bias gradient: for a per-key
   bias ``[., ., 1, Sk]`` the column sums of dS, kept in registers across query tiles and the
   group's heads and written once; for a full bias each dS tile.
3. ``_dq_kernel``, grid ``(query tiles, batch x heads)``: walks key tiles like the forward.

A bias broadcast over keys (``[., ., ., 1]``) shifts whole rows of scores, which the softmax
ignores: its gradient is exactly zero and takes no work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton.configs import (
    backward_candidates,
    fit_to_problem,
    head_dim_block,
    length_bucket,
    placeholder,
)
from flash_dma.backends.triton.forward import band, broadcast_strides, head_divisor, kernel_view
from flash_dma.backends.triton.launch import TunedKernel
from flash_dma.backends.triton.tiles import (
    LOG2E,
    band_tiles,
    bias_and_mask,
    edge_position,
    first_position,
    key_pointers,
    load_rows,
    scores_log2,
    split_range,
    tile_at,
    walk_plan,
)

# Kinds of bias gradient.
DBIAS_NONE, DBIAS_PER_KEY, DBIAS_FULL = 0, 1, 2
MAX_QUERY_CHUNKS = 8
_QUERIES_PER_CHUNK = 2048
_SMALLEST_BLOCK_N = 16


@triton.jit
def _delta_kernel(
    Out, DOut, Delta,
    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    seqlen_q, num_heads, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o = load_rows(Out + b.to(tl.int64) * stride_ob + h * stride_oh, pid_m * BLOCK_M, stride_os, seqlen_q, head_dim, True, BLOCK_M, BLOCK_D)
    do = load_rows(DOut + b.to(tl.int64) * stride_db + h * stride_dh, pid_m * BLOCK_M, stride_ds, seqlen_q, head_dim, True, BLOCK_M, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (b * num_heads + h).to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _softmax_grad(s, lse2, delta, dp, q_axis: tl.constexpr, scale, softcap_log2, SOFTCAP: tl.constexpr, scores):
    """``(dS, dQK)``: the score gradient (the bias gradient) and the gradient of ``q.k``.

    ``lse2`` and ``delta`` run along axis ``q_axis`` of the tile; ``scores`` are the log2-domain
    scores before bias, from which the softcap derivative ``1 - tanh^2`` is recovered.
    """
    if q_axis == 0:
        p = tl.exp2(s - lse2[:, None])
        ds = p * (dp - delta[:, None])
    else:
        p = tl.exp2(s - lse2[None, :])
        ds = p * (dp - delta[None, :])
    dqk = ds * scale
    if SOFTCAP:
        t = scores / softcap_log2
        dqk = dqk * (1.0 - t * t)
    return p, ds, dqk


@triton.jit
def _load_lse2(Lse, Delta, offset, offs_m, seqlen_q):
    """log2-domain LSE and delta of rows ``offs_m``; empty rows (and rows past the end) get
    LSE = +inf so that their probabilities, and hence their gradients, are exactly 0."""
    row_ok = offs_m < seqlen_q
    lse = tl.load(Lse + offset + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(Delta + offset + offs_m, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _dkdv_tile(
    dk, dv, dbias_keys, k, v, start_m, offs_n,
    q_base, do_base, stride_qs, stride_dos, lse_delta_offset, Lse, Delta,
    mask_head, stride_mq, stride_mk, bias_head, stride_bq, stride_bk, dbias_head, stride_dbq, stride_dbk,
    seqlen_q, seqlen_k, band_lo, band_hi, head_dim,
    scale, scale_log2, softcap_log2, scale_over_cap,
    CHECK_BOUNDS: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr,
    DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, DBIAS_HEAD_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate one query tile's contribution to dK, dV (and the bias gradient); tiles are [keys, queries]."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_rows(q_base, start_m, stride_qs, seqlen_q, head_dim, CHECK_BOUNDS, BLOCK_M, BLOCK_D)
    do = load_rows(do_base, start_m, stride_dos, seqlen_q, head_dim, CHECK_BOUNDS, BLOCK_M, BLOCK_D)
    lse2, delta = _load_lse2(Lse, Delta, lse_delta_offset, offs_m, seqlen_q)
    scores = scores_log2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), scale_log2, softcap_log2, scale_over_cap, SOFTCAP)
    bias_ptrs = bias_head
    mask_ptrs = mask_head
    q_row = tl.minimum(offs_m, seqlen_q - 1).to(tl.int64)  # rows past the end read the last row
    if HAS_BIAS:
        bias_rows = bias_head if BIAS_PER_KEY else bias_head + q_row * stride_bq
        bias_ptrs = key_pointers(bias_rows, offs_n, stride_bk, BIAS_PER_KEY, True)
    if APPLY_MASK:
        mask_rows = mask_head if MASK_PER_KEY else mask_head + q_row * stride_mq
        mask_ptrs = key_pointers(mask_rows, offs_n, stride_mk, MASK_PER_KEY, True)
    s = bias_and_mask(scores, offs_m[None, :], offs_n[:, None], seqlen_k, band_lo, band_hi, bias_ptrs, mask_ptrs, HAS_BIAS, CHECK_BOUNDS, APPLY_MASK)
    dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    p, ds, dqk = _softmax_grad(s, lse2, delta, dp, 1, scale, softcap_log2, SOFTCAP, scores)
    dv += tl.dot(p.to(do.dtype), do, input_precision=DOT_PRECISION)
    dk += tl.dot(dqk.to(q.dtype), q, input_precision=DOT_PRECISION)
    if DBIAS == 1:
        dbias_keys += tl.sum(ds, 1)
    if DBIAS == 2:
        ptrs = dbias_head + (offs_n * stride_dbk)[:, None] + (offs_m * stride_dbq)[None, :]
        ok = (offs_n < seqlen_k)[:, None] & (offs_m < seqlen_q)[None, :]
        if DBIAS_ATOMIC:
            tl.atomic_add(ptrs, ds, mask=ok)
        elif DBIAS_HEAD_SHARED:
            # The group's heads share this gradient; only this program touches it, in order.
            tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + ds, mask=ok)
        else:
            tl.store(ptrs, ds, mask=ok)
    return dk, dv, dbias_keys


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, Lse, Delta, Mask, Bias, Lists, DK, DV, DBias, ScratchK, ScratchV, Turns,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_lb, stride_lh, stride_lr, list_width,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dbc, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim,
    mask_head_div, bias_head_div, list_head_div, dbias_head_div, list_block_q, list_block_k,
    band_lo, band_hi,
    scale, scale_log2, softcap_log2, scale_over_cap,
    rows_bucket, keys_bucket,  # autotuning keys only
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LISTS: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr,
    DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, DBIAS_HEAD_SHARED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    chunk = tl.program_id(0)
    num_chunks = tl.num_programs(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2) // num_kv_heads
    kv_head = tl.program_id(2) % num_kv_heads
    group = num_heads // num_kv_heads
    b64 = b.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    # Query tiles that see any of these keys: q - k must lie in [-(diagonal + band_hi), -(diagonal + band_lo)].
    diagonal = seqlen_k - seqlen_q
    k_last = tl.minimum(pid_n * BLOCK_N + BLOCK_N, seqlen_k) - 1
    lo, interior_lo, interior_hi, hi = band_tiles(
        pid_n * BLOCK_N, k_last, seqlen_q, -(diagonal + band_hi), -(diagonal + band_lo), BLOCK_M
    )
    band_lo = diagonal + band_lo
    band_hi = diagonal + band_hi
    tiles_per_block = 1
    list_row = 0
    # Listed query tiles of this key tile's whole column, over the group's heads. Under a sparse
    # mask most columns are empty: they load nothing and take no part in the ordered accumulation.
    column_work = hi - lo
    if HAS_LISTS:
        tiles_per_block = tl.where(list_block_q > 0, list_block_q // BLOCK_M, tl.cdiv(seqlen_q, BLOCK_M))
        list_row = tl.where(list_block_k > 0, pid_n // tl.maximum(list_block_k // BLOCK_N, 1), 0)
        column_work = 0
        for g in range(0, group):
            lists = Lists + b64 * stride_lb + ((kv_head * group + g) // list_head_div) * stride_lh + list_row * stride_lr
            partial_rank, full_rank = lists + list_width, lists + 3 * list_width
            column_work += first_position(partial_rank, hi, tiles_per_block, False) - first_position(partial_rank, lo, tiles_per_block, False)
            column_work += first_position(full_rank, hi, tiles_per_block, False) - first_position(full_rank, lo, tiles_per_block, False)
    # This program's share of the column's query tiles (see the ordered accumulation at the end).
    lo, interior_lo, interior_hi, hi = split_range(lo, interior_lo, interior_hi, hi, chunk, num_chunks)

    keys = tl.where(column_work > 0, seqlen_k, 0)  # an empty column loads no keys
    k = load_rows(K + b64 * stride_kb + kv_head * stride_kh, pid_n * BLOCK_N, stride_ks, keys, head_dim, True, BLOCK_N, BLOCK_D)
    v = load_rows(V + b64 * stride_vb + kv_head * stride_vh, pid_n * BLOCK_N, stride_vs, keys, head_dim, True, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dbias_keys = tl.zeros([BLOCK_N], dtype=tl.float32)

    for g in range(0, group):
        head = kv_head * group + g
        q_base = Q + b64 * stride_qb + head * stride_qh
        do_base = DO + b64 * stride_dob + head * stride_doh
        lse_delta_offset = (b * num_heads + head).to(tl.int64) * seqlen_q
        mask_head = Mask + b64 * stride_mb + (head // mask_head_div) * stride_mh
        bias_head = Bias + b64 * stride_bb + (head // bias_head_div) * stride_bh
        dbias_head = DBias + chunk * stride_dbc + b64 * stride_dbb + (head // dbias_head_div) * stride_dbh
        lists = Lists
        if HAS_LISTS:
            lists = Lists + b64 * stride_lb + (head // list_head_div) * stride_lh + list_row * stride_lr
        partial_index, partial_lo, partial_hi, full_index, full_lo, p_interior_lo, p_interior_hi, full_hi = walk_plan(
            lists, list_width, tiles_per_block, lo, interior_lo, interior_hi, hi, HAS_LISTS
        )
        # As in the forward, each loop reads the next tile's index one iteration ahead.
        if HAS_MASK:
            start_m = tile_at(partial_index, partial_lo, tiles_per_block, False) * BLOCK_M
            for position in range(partial_lo, partial_hi):
                next_m = tile_at(partial_index, position + 1, tiles_per_block, False) * BLOCK_M
                dk, dv, dbias_keys = _dkdv_tile(
                    dk, dv, dbias_keys, k, v, start_m, offs_n,
                    q_base, do_base, stride_qs, stride_dos, lse_delta_offset, Lse, Delta,
                    mask_head, stride_mq, stride_mk, bias_head, stride_bq, stride_bk, dbias_head, stride_dbq, stride_dbk,
                    seqlen_q, seqlen_k, band_lo, band_hi, head_dim, scale, scale_log2, softcap_log2, scale_over_cap,
                    True, True, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, DBIAS, DBIAS_ATOMIC, DBIAS_HEAD_SHARED,
                    BLOCK_M, BLOCK_D, DOT_PRECISION,
                )
                start_m = next_m
        start_m = tile_at(full_index, p_interior_lo, tiles_per_block, not HAS_LISTS) * BLOCK_M
        for position in range(p_interior_lo, p_interior_hi):
            next_m = tile_at(full_index, position + 1, tiles_per_block, not HAS_LISTS) * BLOCK_M
            dk, dv, dbias_keys = _dkdv_tile(
                dk, dv, dbias_keys, k, v, start_m, offs_n,
                q_base, do_base, stride_qs, stride_dos, lse_delta_offset, Lse, Delta,
                mask_head, stride_mq, stride_mk, bias_head, stride_bq, stride_bk, dbias_head, stride_dbq, stride_dbk,
                seqlen_q, seqlen_k, band_lo, band_hi, head_dim, scale, scale_log2, softcap_log2, scale_over_cap,
                False, False, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, DBIAS, DBIAS_ATOMIC, DBIAS_HEAD_SHARED,
                BLOCK_M, BLOCK_D, DOT_PRECISION,
            )
            start_m = next_m
        start_m = tile_at(full_index, edge_position(0, full_lo, p_interior_lo, p_interior_hi), tiles_per_block, not HAS_LISTS) * BLOCK_M
        for j in range(0, (p_interior_lo - full_lo) + (full_hi - p_interior_hi)):
            next_m = tile_at(full_index, edge_position(j + 1, full_lo, p_interior_lo, p_interior_hi), tiles_per_block, not HAS_LISTS) * BLOCK_M
            dk, dv, dbias_keys = _dkdv_tile(
                dk, dv, dbias_keys, k, v, start_m, offs_n,
                q_base, do_base, stride_qs, stride_dos, lse_delta_offset, Lse, Delta,
                mask_head, stride_mq, stride_mk, bias_head, stride_bq, stride_bk, dbias_head, stride_dbq, stride_dbk,
                seqlen_q, seqlen_k, band_lo, band_hi, head_dim, scale, scale_log2, softcap_log2, scale_over_cap,
                True, False, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, DBIAS, DBIAS_ATOMIC, DBIAS_HEAD_SHARED,
                BLOCK_M, BLOCK_D, DOT_PRECISION,
            )
            start_m = next_m
        if DBIAS == 1:
            if not DBIAS_HEAD_SHARED:
                _flush_key_gradient(dbias_head, offs_n, stride_dbk, seqlen_k, dbias_keys, DBIAS_ATOMIC)
                dbias_keys = tl.zeros([BLOCK_N], dtype=tl.float32)

    if DBIAS == 1:
        if DBIAS_HEAD_SHARED:
            dbias_head = DBias + chunk * stride_dbc + b64 * stride_dbb + ((kv_head * group) // dbias_head_div) * stride_dbh
            _flush_key_gradient(dbias_head, offs_n, stride_dbk, seqlen_k, dbias_keys, DBIAS_ATOMIC)

    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_n.to(tl.int64)[:, None]
    ok = (offs_n < seqlen_k)[:, None] & (offs_d < head_dim)[None, :]
    dk_offsets = b64 * stride_dkb + kv_head * stride_dkh + rows * stride_dks + offs_d[None, :]
    dv_offsets = b64 * stride_dvb + kv_head * stride_dvh + rows * stride_dvs + offs_d[None, :]
    if num_chunks > 1 and column_work > 0:
        # The chunks of this key tile add their parts in chunk order, each waiting for its turn:
        # deterministic, and no atomics on the gradients themselves. Chunks of a tile are
        # neighbours in the grid, so the ones waited for have been scheduled already.
        turn = Turns + tl.program_id(2) * tl.num_programs(1) + pid_n
        while tl.atomic_add(turn, 0, sem="acquire") != chunk:
            pass
        tl.debug_barrier()
        if chunk > 0:
            dk += tl.load(ScratchK + dk_offsets, mask=ok, other=0.0, cache_modifier=".cg")
            dv += tl.load(ScratchV + dv_offsets, mask=ok, other=0.0, cache_modifier=".cg")
        if chunk < num_chunks - 1:
            tl.store(ScratchK + dk_offsets, dk, mask=ok)
            tl.store(ScratchV + dv_offsets, dv, mask=ok)
        tl.debug_barrier()
        tl.atomic_add(turn, 1, sem="release")
    if chunk == num_chunks - 1:
        tl.store(DK + dk_offsets, dk.to(DK.dtype.element_ty), mask=ok)
        tl.store(DV + dv_offsets, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _flush_key_gradient(dbias_head, offs_n, stride_dbk, seqlen_k, values, ATOMIC: tl.constexpr):
    ptrs = dbias_head + offs_n * stride_dbk
    if ATOMIC:
        tl.atomic_add(ptrs, values, mask=offs_n < seqlen_k)
    else:
        tl.store(ptrs, values, mask=offs_n < seqlen_k)


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, start_n, offs_m,
    k_base, v_base, stride_ks, stride_vs,
    mask_rows, stride_mk, bias_rows, stride_bk,
    seqlen_k, band_lo, band_hi, head_dim,
    scale, scale_log2, softcap_log2, scale_over_cap,
    CHECK_BOUNDS: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(k_base, start_n, stride_ks, seqlen_k, head_dim, CHECK_BOUNDS, BLOCK_N, BLOCK_D)
    v = load_rows(v_base, start_n, stride_vs, seqlen_k, head_dim, CHECK_BOUNDS, BLOCK_N, BLOCK_D)
    scores = scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale_log2, softcap_log2, scale_over_cap, SOFTCAP)
    bias_ptrs = bias_rows
    mask_ptrs = mask_rows
    if HAS_BIAS:
        bias_ptrs = key_pointers(bias_rows, offs_n, stride_bk, BIAS_PER_KEY, False)
    if APPLY_MASK:
        mask_ptrs = key_pointers(mask_rows, offs_n, stride_mk, MASK_PER_KEY, False)
    s = bias_and_mask(scores, offs_m[:, None], offs_n[None, :], seqlen_k, band_lo, band_hi, bias_ptrs, mask_ptrs, HAS_BIAS, CHECK_BOUNDS, APPLY_MASK)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    p, ds, dqk = _softmax_grad(s, lse2, delta, dp, 0, scale, softcap_log2, SOFTCAP, scores)
    return dq + tl.dot(dqk.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, Lse, Delta, Mask, Bias, Lists, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_lb, stride_lh, stride_lr, list_width,
    stride_dqb, stride_dqs, stride_dqh,
    seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim,
    mask_head_div, bias_head_div, list_head_div, list_block_q, list_block_k,
    band_lo, band_hi,
    scale, scale_log2, softcap_log2, scale_over_cap,
    rows_bucket, keys_bucket,  # autotuning keys only
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LISTS: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) row tiles first, as in the forward
    b = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    kv_head = head // (num_heads // num_kv_heads)
    b64 = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_row = tl.minimum(offs_m, seqlen_q - 1).to(tl.int64)  # rows past the end read the last row
    q = load_rows(Q + b64 * stride_qb + head * stride_qh, pid_m * BLOCK_M, stride_qs, seqlen_q, head_dim, True, BLOCK_M, BLOCK_D)
    do = load_rows(DO + b64 * stride_dob + head * stride_doh, pid_m * BLOCK_M, stride_dos, seqlen_q, head_dim, True, BLOCK_M, BLOCK_D)
    lse2, delta = _load_lse2(Lse, Delta, (b * num_heads + head).to(tl.int64) * seqlen_q, offs_m, seqlen_q)
    k_base = K + b64 * stride_kb + kv_head * stride_kh
    v_base = V + b64 * stride_vb + kv_head * stride_vh
    mask_rows = Mask + b64 * stride_mb + (head // mask_head_div) * stride_mh
    bias_rows = Bias + b64 * stride_bb + (head // bias_head_div) * stride_bh
    if not MASK_PER_KEY:
        mask_rows += q_row * stride_mq
    if not BIAS_PER_KEY:
        bias_rows += q_row * stride_bq

    diagonal = seqlen_k - seqlen_q
    q_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, seqlen_q) - 1
    lo, interior_lo, interior_hi, hi = band_tiles(pid_m * BLOCK_M, q_last, seqlen_k, diagonal + band_lo, diagonal + band_hi, BLOCK_N)
    band_lo = diagonal + band_lo
    band_hi = diagonal + band_hi
    tiles_per_block = 1
    lists = Lists
    if HAS_LISTS:
        tiles_per_block = tl.where(list_block_k > 0, list_block_k // BLOCK_N, tl.cdiv(seqlen_k, BLOCK_N))
        list_row = tl.where(list_block_q > 0, pid_m // tl.maximum(list_block_q // BLOCK_M, 1), 0)
        lists = Lists + b64 * stride_lb + (head // list_head_div) * stride_lh + list_row * stride_lr
    partial_index, partial_lo, partial_hi, full_index, full_lo, p_interior_lo, p_interior_hi, full_hi = walk_plan(
        lists, list_width, tiles_per_block, lo, interior_lo, interior_hi, hi, HAS_LISTS
    )

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_MASK:
        start_n = tile_at(partial_index, partial_lo, tiles_per_block, False) * BLOCK_N
        for position in range(partial_lo, partial_hi):
            next_n = tile_at(partial_index, position + 1, tiles_per_block, False) * BLOCK_N
            dq = _dq_tile(
                dq, q, do, lse2, delta, start_n, offs_m, k_base, v_base, stride_ks, stride_vs,
                mask_rows, stride_mk, bias_rows, stride_bk, seqlen_k, band_lo, band_hi, head_dim,
                scale, scale_log2, softcap_log2, scale_over_cap,
                True, True, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, BLOCK_N, BLOCK_D, DOT_PRECISION,
            )
            start_n = next_n
    start_n = tile_at(full_index, p_interior_lo, tiles_per_block, not HAS_LISTS) * BLOCK_N
    for position in range(p_interior_lo, p_interior_hi):
        next_n = tile_at(full_index, position + 1, tiles_per_block, not HAS_LISTS) * BLOCK_N
        dq = _dq_tile(
            dq, q, do, lse2, delta, start_n, offs_m, k_base, v_base, stride_ks, stride_vs,
            mask_rows, stride_mk, bias_rows, stride_bk, seqlen_k, band_lo, band_hi, head_dim,
            scale, scale_log2, softcap_log2, scale_over_cap,
            False, False, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, BLOCK_N, BLOCK_D, DOT_PRECISION,
        )
        start_n = next_n
    start_n = tile_at(full_index, edge_position(0, full_lo, p_interior_lo, p_interior_hi), tiles_per_block, not HAS_LISTS) * BLOCK_N
    for j in range(0, (p_interior_lo - full_lo) + (full_hi - p_interior_hi)):
        next_n = tile_at(full_index, edge_position(j + 1, full_lo, p_interior_lo, p_interior_hi), tiles_per_block, not HAS_LISTS) * BLOCK_N
        dq = _dq_tile(
            dq, q, do, lse2, delta, start_n, offs_m, k_base, v_base, stride_ks, stride_vs,
            mask_rows, stride_mk, bias_rows, stride_bk, seqlen_k, band_lo, band_hi, head_dim,
            scale, scale_log2, softcap_log2, scale_over_cap,
            True, False, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, BLOCK_N, BLOCK_D, DOT_PRECISION,
        )
        start_n = next_n
    offs_d = tl.arange(0, BLOCK_D)
    dq_ptrs = DQ + b64 * stride_dqb + head * stride_dqh + offs_m.to(tl.int64)[:, None] * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(offs_m < seqlen_q)[:, None] & (offs_d < head_dim)[None, :])


_TUNING_KEY = [
    "rows_bucket", "keys_bucket", "list_block_q", "list_block_k",
    "HAS_MASK", "HAS_BIAS", "HAS_LISTS", "MASK_PER_KEY", "BIAS_PER_KEY", "SOFTCAP", "BLOCK_D",
]


def _prune_dkdv(configs, nargs, **kwargs):
    args = {**nargs, **kwargs}
    return fit_to_problem(backward_candidates(args["Q"].device, args["BLOCK_D"], "dkdv"), args)


def _prune_dq(configs, nargs, **kwargs):
    args = {**nargs, **kwargs}
    return fit_to_problem(backward_candidates(args["Q"].device, args["BLOCK_D"], "dq"), args)


_dkdv = TunedKernel(
    _dkdv_kernel, _TUNING_KEY + ["DBIAS", "DBIAS_ATOMIC", "DBIAS_HEAD_SHARED"], _prune_dkdv, reset_to_zero=["DBias", "Turns"]
)
_dq = TunedKernel(_dq_kernel, _TUNING_KEY, _prune_dq)


def bias_gradient_buffer(bias, batch, num_heads, num_kv_heads, deterministic, query_chunks):
    """The fp32 buffer the dK/dV kernel accumulates the bias gradient in, and how to read it.

    Returns ``(buffer, kind, atomic, head_shared)``; the buffer is ``[chunks, Bd, Hd, Sqb, Sk]``.
    Programs own one (query chunk, batch, kv head). Where the bias is shared across programs
    (batch or kv heads broadcast), the deterministic path gives each program its own slice
    (extra memory: B or Hkv times the bias) and sums them afterwards; the default path
    accumulates with fp32 atomics. A per-key bias also gets one slice per query chunk (summed
    afterwards); a full bias needs none, as chunks own disjoint query rows.
    """
    bb, bh, bq, bk = bias.shape
    if bk == 1:
        return None, DBIAS_NONE, False, False
    shared_batch = bb == 1 and batch > 1
    shared_kv = bh == 1 and num_kv_heads > 1
    atomic = (shared_batch or shared_kv) and not deterministic
    rows_b = batch if shared_batch and deterministic else bb
    rows_h = num_kv_heads if shared_kv and deterministic else bh
    chunks = query_chunks if bq == 1 else 1
    buffer = torch.zeros(chunks, rows_b, rows_h, bq, bk, dtype=torch.float32, device=bias.device)
    kind = DBIAS_PER_KEY if bq == 1 else DBIAS_FULL
    return buffer, kind, atomic, rows_h != num_heads


def query_chunks(seqlen_q: int) -> int:
    """Parts the query range of each key tile is split into for dK/dV.

    A key tile's whole column (every query, every head of its group) is one program's work;
    with a sparse per-key mask only a few such columns exist and the longest one sets the
    run time. Splitting each column bounds that.
    """
    return max(1, min(MAX_QUERY_CHUNKS, seqlen_q // _QUERIES_PER_CHUNK))


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    kv_lists: torch.Tensor | None,
    q_lists: torch.Tensor | None,
    list_block_q: int,
    list_block_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    bias_requires_grad: bool,
    num_query_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernels; arguments as for ``attention_forward`` plus the forward's outputs.

    ``num_query_chunks`` overrides ``query_chunks`` (for tests).

    Returns ``dq`` ``[B, Sq, H, D]``, ``dk`` and ``dv`` ``[B, Sk, Hkv, D]`` in the inputs' dtype, and
    the bias gradient in the bias's shape and dtype (None when not asked for).
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    block_d = head_dim_block(head_dim)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = torch.empty(batch, num_heads, seqlen_q, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(seqlen_q, 64), batch * num_heads)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        seqlen_q, num_heads, head_dim, BLOCK_M=64, BLOCK_D=block_d,
    )
    dk = torch.empty(batch, seqlen_k, num_kv_heads, head_dim, dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    chunks = num_query_chunks or query_chunks(seqlen_q)
    dbias_acc, dbias_kind, dbias_atomic, dbias_head_shared = None, DBIAS_NONE, False, False
    if bias is not None and bias_requires_grad:
        dbias_acc, dbias_kind, dbias_atomic, dbias_head_shared = bias_gradient_buffer(
            bias, batch, num_heads, num_kv_heads, deterministic, chunks
        )

    band_lo, band_hi = band(window_left, window_right, seqlen_q, seqlen_k)
    log2e = 1.4426950408889634
    no_lists = placeholder(q.device, torch.int32)
    no_floats = placeholder(q.device, torch.float32)
    # Absent inputs become placeholders: the kernels form (unused) pointers from them.
    common = dict(
        Q=q, K=k, V=v, DO=dout, Lse=lse, Delta=delta,
        Mask=no_lists if mask is None else kernel_view(mask), Bias=no_floats if bias is None else bias,
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
        stride_kb=k.stride(0), stride_ks=k.stride(1), stride_kh=k.stride(2),
        stride_vb=v.stride(0), stride_vs=v.stride(1), stride_vh=v.stride(2),
        stride_dob=dout.stride(0), stride_dos=dout.stride(1), stride_doh=dout.stride(2),
        **dict(zip(("stride_mb", "stride_mh", "stride_mq", "stride_mk"), broadcast_strides(mask))),
        **dict(zip(("stride_bb", "stride_bh", "stride_bq", "stride_bk"), broadcast_strides(bias))),
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        mask_head_div=head_divisor(mask, num_heads), bias_head_div=head_divisor(bias, num_heads),
        list_head_div=1 if kv_lists is None else head_divisor(kv_lists, num_heads),
        list_block_q=list_block_q, list_block_k=list_block_k,
        band_lo=band_lo, band_hi=band_hi,
        scale=softmax_scale, scale_log2=softmax_scale * log2e, softcap_log2=softcap * log2e,
        scale_over_cap=softmax_scale / softcap if softcap > 0 else 0.0,
        rows_bucket=length_bucket(seqlen_q), keys_bucket=length_bucket(seqlen_k),
        HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_LISTS=kv_lists is not None,
        MASK_PER_KEY=mask is not None and mask.shape[2] == 1,
        BIAS_PER_KEY=bias is not None and bias.shape[2] == 1,
        SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=block_d,
    )

    def list_args(lists):
        if lists is None:
            return dict(Lists=no_lists, stride_lb=0, stride_lh=0, stride_lr=0, list_width=0)
        strides = broadcast_strides(lists)
        return dict(Lists=lists, stride_lb=strides[0], stride_lh=strides[1], stride_lr=strides[2], list_width=lists.shape[-1])

    dbias_target = dbias_acc if dbias_acc is not None else no_floats
    # Chunks after the first add into fp32 scratch; one turn counter per key tile (any BLOCK_N).
    scratch_k, scratch_v, turns = no_floats, no_floats, no_lists
    if chunks > 1:
        scratch_k = torch.empty_like(dk, dtype=torch.float32)
        scratch_v = torch.empty_like(dv, dtype=torch.float32)
        turns = torch.zeros(batch * num_kv_heads * triton.cdiv(seqlen_k, _SMALLEST_BLOCK_N), dtype=torch.int32, device=q.device)
    dkdv_args = dict(
        common, **list_args(q_lists), DK=dk, DV=dv, DBias=dbias_target,
        ScratchK=scratch_k, ScratchV=scratch_v, Turns=turns,
        stride_dkb=dk.stride(0), stride_dks=dk.stride(1), stride_dkh=dk.stride(2),
        stride_dvb=dv.stride(0), stride_dvs=dv.stride(1), stride_dvh=dv.stride(2),
        stride_dbc=0 if dbias_acc is None or dbias_acc.shape[0] == 1 else dbias_acc.stride(0),
        **dict(zip(("stride_dbb", "stride_dbh", "stride_dbq", "stride_dbk"), broadcast_strides(None if dbias_acc is None else dbias_acc[0]))),
        dbias_head_div=1 if dbias_acc is None else head_divisor(dbias_acc[0], num_heads),
        DBIAS=dbias_kind, DBIAS_ATOMIC=dbias_atomic, DBIAS_HEAD_SHARED=dbias_head_shared,
    )
    _dkdv(lambda meta: (chunks, triton.cdiv(seqlen_k, meta["BLOCK_N"]), batch * num_kv_heads), dkdv_args)
    # dQ is allocated only once the dK/dV scratch is released, so the two never add up in the peak.
    del dkdv_args, scratch_k, scratch_v
    dq = torch.empty(batch, seqlen_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    dq_args = dict(
        common, **list_args(kv_lists), DQ=dq,
        stride_dqb=dq.stride(0), stride_dqs=dq.stride(1), stride_dqh=dq.stride(2),
    )
    _dq(lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * num_heads), dq_args)

    dbias = None
    if bias is not None and bias_requires_grad:
        if dbias_acc is None:
            dbias = bias.new_zeros(bias.shape)  # a bias broadcast over keys cannot change the softmax
        else:
            extra = [d for d in (0, 1) if dbias_acc.shape[d + 1] != bias.shape[d]]
            dbias = dbias_acc[0] if dbias_acc.shape[0] == 1 else dbias_acc.sum(dim=0)
            dbias = (dbias.sum(dim=extra, keepdim=True) if extra else dbias).to(bias.dtype)
    return dq, dk, dv, dbias
