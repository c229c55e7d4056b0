"""Backward pass: dQ, dK, dV, and the bias gradient in the bias's own shape.

Three launches (dQ never needs atomics):

1. ``_preprocess_kernel``: ``delta = rowsum(dO * O)`` per (batch, head, query), and the other
   kernels' zeroed workspace (``_Workspace``: queues, chunk sums, turns).
2. ``_dkdv_kernel``, grid ``(query chunks, key tiles, batch x kv heads)``: a program owns
   ``BLOCK_N`` keys of one key/value head (consecutive keys, or consecutive slots of a key
   list) and, for each query head of its group, runs ``_dkdv_tiles`` over the query tiles
   that see them (PARTIAL tiles of the summary's transposed lists, interior tiles, edge tiles),
   recomputing P and accumulating dK and dV in registers. On long sequences each column is
   split into query chunks (``query_chunks``) whose parts add up in fp32 scratch: in chunk
   order when deterministic, else by atomics. It also makes the bias gradient: for
   a per-key bias ``[., ., 1, Sk]`` the column sums of dS, kept in registers across query tiles
   and the group's heads and written once; for a full bias each dS tile.
3. ``_dq_kernel``, grid ``(query tiles, batch x heads)``: walks key tiles like the forward.

A bias broadcast over keys (``[., ., ., 1]``) shifts whole rows of scores, which the softmax
ignores: its gradient is exactly zero and takes no work.

On sm90, launches 2 and 3 run the Gluon kernels of ``hopper/`` where ``dispatch.py``'s table says they serve the call;
the Hopper dQ then starts beside dK/dV's last programs (``hopper/dq.hopper_dq``), and dK/dV's
fp32 chunk sums are written into dK and dV after it (``hopper/dkdv.write_gradients``).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.dispatch import HOPPER, device_kind, form_of, route
from flash_dma.backends.triton.forward import packed_sequences
from flash_dma.backends.triton.hopper.common import kept_keys
from flash_dma.backends.triton.hopper.dkdv import (
    count_columns,
    hopper_dkdv,
    live_walk,
    sums_shape,
    sums_words_live,
    walk_arguments,
    walked,
)
from flash_dma.backends.triton.hopper.dq import hopper_dq
from flash_dma.backends.triton.launch import Launcher, kernels_side_by_side
from flash_dma.backends.triton.layout import (
    DBIAS_FULL,
    DBIAS_NONE,
    DBIAS_PER_KEY,
    NOT_SPECIALIZED,
    SPECIALIZED,
    Call,
    broadcast_strides,
    call_signature,
    common_arguments,
    common_tensors,
    copy_engine_reads,
    grid_sizes,
    head_divisor,
    placeholder,
    walks_per_group,
)
from flash_dma.backends.triton.tiles import (
    LOG2E,
    STAGE_EDGE,
    STAGE_INTERIOR,
    STAGE_PARTIAL,
    WALK_BLOCKS,
    WALK_DENSE,
    WALK_KEYS,
    band_tiles,
    key_pointers,
    key_walk,
    mask_columns,
    listed_tiles,
    load_rows,
    load_tile,
    row_source,
    row_tile_scores,
    scores_log2,
    sequence_span,
    split_range,
    stage_tiles,
    summary_row,
    tile_indices,
    tile_start,
    visible_scores,
    walk_position,
)
from flash_dma.integers import cdiv
from flash_dma.memo import Memo, forget_memos

MAX_QUERY_CHUNKS = 8
_QUERIES_PER_CHUNK = 2048
_QUERIES_PER_ATOMIC_CHUNK = 512
_COLUMN_KEYS = 128  # keys per column when counting columns for the chunk count, whatever BLOCK_N
_COLUMNS_WANTED_PER_SM = 32  # programs per SM if every column worked: 4 with 1/8 of them working
_SMALLEST_BLOCK_N = 16
_DELTA_ROWS = 64
_ZERO_WORDS = tl.constexpr(4096)  # workspace words per zeroing program of ``_preprocess_kernel``
# The workspace's first 128 bytes, written by the preprocess's first program: the Hopper kernels'
# queues (dK/dV's counter at word 0, ``count_columns``'s counts at 1 and 2, dQ's counter at 4).
_HEADER_WORDS = tl.constexpr(32)


@triton.jit(do_not_specialize=[
    "seqlen_q", "num_heads", "workspace_words", "stride_wb", "stride_wh", "stride_wr", "walk_width", "walk_head_div", "batch",
    "seqlen_k", "num_kv_heads", "group", "walks", "list_block_q", "list_block_k", "band_lo", "band_hi", "sums_first",
])
def _preprocess_kernel(
    Out, DOut, Delta, Workspace, Walk,
    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    seqlen_q, num_heads, head_dim, workspace_words,
    stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_k, num_kv_heads, group, walks,
    list_block_q, list_block_k, band_lo, band_hi, sums_first,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, WORKSPACE: tl.constexpr, COUNT: tl.constexpr, LIVE: tl.constexpr,
    COUNT_BLOCK_M: tl.constexpr, COUNT_BLOCK_N: tl.constexpr,
):
    """What the backward's kernels need before they start, in one launch (as FlashAttention-3's
    preprocess also clears its dQ accumulator): ``delta = rowsum(dO * O)``, ``BLOCK_M`` rows of
    one (batch, head) a program; with WORKSPACE, program 0 writes the workspace's header (zeros;
    with COUNT the Hopper dK/dV columns' work, ``hopper/dkdv.count_columns``) and the others also
    zero the rest, ``workspace_words`` in all, ``_ZERO_WORDS`` each, but for the Hopper dK/dV's
    chunk sums from word ``sums_first`` on whose rows that kernel never adds to by the walk LIVE
    (``hopper/dkdv.column_live``). A program's zeroing and its delta rows go side by side: the
    walk's loads that tell whether to zero wait beside those of O and dO."""
    pid = tl.program_id(0)
    part = pid  # the workspace's chunk this program zeroes and the rows of delta it computes
    if WORKSPACE:
        part = pid - 1
        if pid == 0:
            words = tl.arange(0, _HEADER_WORDS)  # [HEADER]
            header = tl.zeros([_HEADER_WORDS], tl.int32)
            if COUNT:
                longest, total = count_columns(
                    Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_q, seqlen_k, num_kv_heads,
                    group, walks, list_block_q, list_block_k, band_lo, band_hi, COUNT_BLOCK_M, COUNT_BLOCK_N,
                )
                header = tl.where(words == 1, longest, tl.where(words == 2, total, header))
            tl.store(Workspace + words, header)
        elif part < tl.cdiv(workspace_words - _HEADER_WORDS, _ZERO_WORDS):
            first = _HEADER_WORDS + part.to(tl.int64) * _ZERO_WORDS
            live = True
            if LIVE != WALK_DENSE:
                live = sums_words_live(
                    Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_k, num_kv_heads, group, walks,
                    list_block_q, list_block_k, band_lo, band_hi, seqlen_q, head_dim, first - sums_first, _ZERO_WORDS, LIVE,
                    COUNT_BLOCK_M, COUNT_BLOCK_N,
                )
            if live:
                words = first + tl.arange(0, _ZERO_WORDS)  # [ZERO]
                tl.store(Workspace + words, tl.zeros([_ZERO_WORDS], tl.int32))  # ``_Workspace`` holds whole programs' words
    batch_heads = batch * num_heads
    if (part >= 0) & (part < tl.cdiv(seqlen_q, BLOCK_M) * batch_heads):
        # Heads first: neighbouring programs read the same rows of neighbouring heads, neighbouring
        # runs of [B, S, H, D] (docs/design-notes.md, "The delta pass").
        pid_m = part // batch_heads
        b = part % batch_heads // num_heads
        h = part % num_heads
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seqlen_q
        o = load_tile(Out + b.to(tl.int64) * stride_ob + h * stride_oh, offs_m, row_ok, stride_os, head_dim, True, BLOCK_D)
        do = load_tile(DOut + b.to(tl.int64) * stride_db + h * stride_dh, offs_m, row_ok, stride_ds, head_dim, True, BLOCK_D)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
        tl.store(Delta + (b * num_heads + h).to(tl.int64) * seqlen_q + offs_m, delta, mask=row_ok)


@triton.jit
def softmax_grad(s, lse2, delta, dp, Q_AXIS: tl.constexpr, scale, softcap_log2, SOFTCAP: tl.constexpr, scores):
    """``(P, dS, dQK)``: probabilities, the score gradient (the bias gradient) and the gradient of ``q.k``.

    ``lse2`` and ``delta`` run along axis ``Q_AXIS`` of the tile; ``scores`` are the log2-domain
    scores before bias, from which the softcap derivative ``1 - tanh^2`` is recovered.
    """
    if Q_AXIS == 0:
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
def _dkdv_tiles(
    dk, dv, dbias_keys, k, v, keys, key_ok,
    q_base, do_base, stride_qs, stride_dos, lse_delta_offset, Lse, Delta,
    mask_head, stride_mq, stride_mk, bias_head, stride_bq, stride_bk, dbias_head, stride_dbq, stride_dbk,
    tiles, tiles_per_block, lo, hi, gap_lo, gap_hi,
    seqlen_q, band_lo, band_hi, head_dim, scale, scale_log2, softcap_log2, scale_over_cap,
    STAGE: tl.constexpr, WALK: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr,
    DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, DBIAS_HEAD_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """Accumulate dK, dV (and the bias gradient) over the query tiles at walk positions
    ``[lo, hi)`` less ``[gap_lo, gap_hi)``. Tiles are ``[keys, queries]``."""
    count = (hi - lo) - (gap_hi - gap_lo)
    # As in the forward, each step reads the next tile's list entry one step ahead.
    tile = tile_start(tiles, walk_position(0, lo, gap_lo, gap_hi), tiles_per_block, WALK)
    for j in range(0, count):
        next_tile = tile_start(tiles, walk_position(j + 1, lo, gap_lo, gap_hi), tiles_per_block, WALK)
        offs_m, q_ok = tile_indices(tiles, tile, seqlen_q, BLOCK_M, WALK)  # [BLOCK_M]
        q = load_tile(q_base, offs_m, q_ok, stride_qs, head_dim, STAGE != STAGE_INTERIOR, BLOCK_D)  # [BLOCK_M, BLOCK_D]
        do = load_tile(do_base, offs_m, q_ok, stride_dos, head_dim, STAGE != STAGE_INTERIOR, BLOCK_D)  # [BLOCK_M, BLOCK_D]
        lse2, delta = _load_lse2(Lse, Delta, lse_delta_offset, offs_m, seqlen_q)  # [BLOCK_M]
        qk = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        scores = scores_log2(qk, scale_log2, softcap_log2, scale_over_cap, SOFTCAP)
        q_row = tl.minimum(offs_m, seqlen_q - 1).to(tl.int64)  # rows past the end read the last row
        bias_rows = bias_head if BIAS_PER_KEY else bias_head + q_row * stride_bq
        mask_rows = mask_head if MASK_PER_KEY else mask_head + q_row * stride_mq
        s = visible_scores(
            scores, offs_m[None, :], keys[:, None], key_ok[:, None], band_lo, band_hi,
            key_pointers(bias_rows, keys, stride_bk, BIAS_PER_KEY, True),
            key_pointers(mask_rows, mask_columns(keys, MASK_KIND), stride_mk, MASK_PER_KEY, True),
            HAS_BIAS, STAGE, MASK_KIND,
        )
        dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        p, ds, dqk = softmax_grad(s, lse2, delta, dp, 1, scale, softcap_log2, SOFTCAP, scores)
        dv += tl.dot(p.to(do.dtype), do, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_D]
        dk += tl.dot(dqk.to(q.dtype), q, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_D]
        if DBIAS == 1:
            dbias_keys += tl.sum(ds, 1)
        if DBIAS == 2:
            ptrs = dbias_head + (keys.to(tl.int64) * stride_dbk)[:, None] + (offs_m * stride_dbq)[None, :]
            ok = key_ok[:, None] & q_ok[None, :]
            if DBIAS_ATOMIC:
                tl.atomic_add(ptrs, ds, mask=ok)
            elif DBIAS_HEAD_SHARED:
                # The group's heads share this gradient; only this program touches it, in order.
                tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + ds, mask=ok)
            else:
                tl.store(ptrs, ds, mask=ok)
        tile = next_tile
    return dk, dv, dbias_keys


@triton.jit
def _flush_key_gradient(dbias_head, keys, key_real, stride_dbk, values, ATOMIC: tl.constexpr):
    ptrs = dbias_head + keys.to(tl.int64) * stride_dbk
    if ATOMIC:
        tl.atomic_add(ptrs, values, mask=key_real)
    else:
        tl.store(ptrs, values, mask=key_real)


@triton.jit(do_not_specialize=[
    *NOT_SPECIALIZED, "stride_dbc", "stride_dbb", "stride_dbh", "stride_dbq", "stride_dbk", "dbias_head_div",
])
def _dkdv_kernel(
    Q, K, V, Mask, Bias, Walk, SeqQ, SeqK,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_wb, stride_wh, stride_wr, walk_width,
    seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim,
    mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
    band_lo, band_hi, scale, scale_log2, softcap_log2, scale_over_cap,
    DO, Lse, Delta, DK, DV, DBias, ScratchK, ScratchV, Turns,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dbc, stride_dbb, stride_dbh, stride_dbq, stride_dbk, dbias_head_div,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, WALK: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SEQ: tl.constexpr, MASK_KIND: tl.constexpr, DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, DBIAS_HEAD_SHARED: tl.constexpr,
    CHUNKS_IN_ORDER: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    chunk = tl.program_id(0)
    num_chunks = tl.num_programs(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2) // num_kv_heads
    kv_head = tl.program_id(2) % num_kv_heads
    group = num_heads // num_kv_heads
    lse_rows = seqlen_q  # LSE and delta rows per (batch row, head): every query of the token tensors
    b_tok, q_start, seqlen_q, k_start, seqlen_k = sequence_span(SeqQ, SeqK, b, seqlen_q, seqlen_k, SEQ)
    if (pid_n * BLOCK_N >= seqlen_k) & (WALK != WALK_KEYS):
        return  # a key tile past this entry's keys (the grid spans the longest)
    b64 = b.to(tl.int64)
    b_tokens = b_tok.to(tl.int64)
    q_offset = q_start.to(tl.int64)
    k_offset = k_start.to(tl.int64)
    band_lo += seqlen_k - seqlen_q
    band_hi += seqlen_k - seqlen_q

    # This program's keys: consecutive ones, or consecutive slots of the key list (kept keys, then dropped).
    if WALK == WALK_KEYS:
        order = Walk + b64 * stride_wb + ((kv_head * group) // walk_head_div) * stride_wh
        kept = tl.load(order + walk_width + seqlen_k)
        slots = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        listed = slots < walk_width - 1
        keys = tl.load(order + slots, mask=listed, other=0)  # [BLOCK_N]
        key_real = listed & (keys < seqlen_k)  # a packed entry's list runs on over padding past its keys
        key_ok = slots < kept
        k_first = tl.min(tl.where(key_ok, keys, seqlen_k), 0)
        k_last = tl.max(tl.where(key_ok, keys, -1), 0)
    else:
        keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < seqlen_k
        key_real = key_ok
        k_first = pid_n * BLOCK_N
        k_last = tl.minimum(pid_n * BLOCK_N + BLOCK_N, seqlen_k) - 1

    # Query tiles that see any of these keys: q - k must lie in [-band_hi, -band_lo].
    lo, interior_lo, interior_hi, hi = band_tiles(k_first, k_last, seqlen_q, -band_hi, -band_lo, BLOCK_M)
    if WALK == WALK_KEYS:
        # Slots past the kept keys need checks everywhere; a tile of dropped keys only writes zeros.
        interior_hi = tl.where((pid_n + 1) * BLOCK_N <= kept, interior_hi, interior_lo)
        hi = tl.where(pid_n * BLOCK_N < kept, hi, lo)
    tiles_per_block = 1
    lists_row = 0
    # Listed query tiles of this key tile's whole column, over the group's heads. Under a sparse
    # mask most columns are empty: they load nothing and take no part in adding up the chunks.
    column_work = hi - lo
    if WALK == WALK_BLOCKS:
        # At least 1: an empty varlen entry (seqlen 0) has no tiles, yet its walk divides by this.
        tiles_per_block = tl.where(list_block_q > 0, list_block_q // BLOCK_M, tl.maximum(tl.cdiv(seqlen_q, BLOCK_M), 1))
        lists_row = summary_row(pid_n, list_block_k, BLOCK_N)
        column_work = 0
        for g in range(0, group):
            lists = Walk + b64 * stride_wb + ((kv_head * group + g) // walk_head_div) * stride_wh + lists_row * stride_wr
            p_lo, p_hi, f_lo, _, _, f_hi = listed_tiles(lists, walk_width, tiles_per_block, lo, lo, lo, hi)
            column_work += (p_hi - p_lo) + (f_hi - f_lo)
    # This program's share of the column's query tiles (the chunks add up at the end).
    lo, interior_lo, interior_hi, hi = split_range(lo, interior_lo, interior_hi, hi, chunk, num_chunks)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dbias_keys = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Under a sparse mask most columns are empty: they read nothing more (their zeroed
    # gradients are written below, by the last chunk).
    if column_work > 0:
        k_base = K + b_tokens * stride_kb + k_offset * stride_ks + kv_head * stride_kh
        v_base = V + b_tokens * stride_vb + k_offset * stride_vs + kv_head * stride_vh
        k = load_tile(k_base, keys, key_ok, stride_ks, head_dim, True, BLOCK_D)
        v = load_tile(v_base, keys, key_ok, stride_vs, head_dim, True, BLOCK_D)

        # Query tiles are walked densely inside the band unless a summary lists them; stages as in the forward.
        query_walk: tl.constexpr = WALK_BLOCKS if WALK == WALK_BLOCKS else WALK_DENSE
        FIRST_STAGE: tl.constexpr = STAGE_PARTIAL if HAS_MASK else STAGE_INTERIOR
        LAST_STAGE: tl.constexpr = STAGE_PARTIAL if HAS_MASK and query_walk == WALK_DENSE else STAGE_EDGE
        for g in range(0, group):
            head = kv_head * group + g
            q_base = Q + b_tokens * stride_qb + q_offset * stride_qs + head * stride_qh
            do_base = DO + b_tokens * stride_dob + q_offset * stride_dos + head * stride_doh
            lse_delta_offset = (b_tokens * num_heads + head) * lse_rows + q_offset
            mask_head = Mask + b64 * stride_mb + (head // mask_head_div).to(tl.int64) * stride_mh
            bias_head = Bias + b64 * stride_bb + (head // bias_head_div).to(tl.int64) * stride_bh
            dbias_head = DBias + chunk * stride_dbc + b64 * stride_dbb + (head // dbias_head_div).to(tl.int64) * stride_dbh
            lists = Walk
            partial_lo, partial_hi, t_lo, t_interior_lo, t_interior_hi, t_hi = lo, lo, lo, interior_lo, interior_hi, hi
            if WALK == WALK_BLOCKS:
                lists = Walk + b64 * stride_wb + (head // walk_head_div) * stride_wh + lists_row * stride_wr
                partial_lo, partial_hi, t_lo, t_interior_lo, t_interior_hi, t_hi = listed_tiles(
                    lists, walk_width, tiles_per_block, lo, interior_lo, interior_hi, hi
                )
            for stage in tl.static_range(FIRST_STAGE, LAST_STAGE + 1):
                tiles, stage_lo, stage_hi, gap_lo, gap_hi = stage_tiles(
                    stage, query_walk, lists, walk_width, partial_lo, partial_hi, t_lo, t_interior_lo, t_interior_hi, t_hi,
                )
                dk, dv, dbias_keys = _dkdv_tiles(
                    dk, dv, dbias_keys, k, v, keys, key_ok,
                    q_base, do_base, stride_qs, stride_dos, lse_delta_offset, Lse, Delta,
                    mask_head, stride_mq, stride_mk, bias_head, stride_bq, stride_bk, dbias_head, stride_dbq, stride_dbk,
                    tiles, tiles_per_block, stage_lo, stage_hi, gap_lo, gap_hi,
                    seqlen_q, band_lo, band_hi, head_dim, scale, scale_log2, softcap_log2, scale_over_cap,
                    stage, query_walk, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY,
                    DBIAS, DBIAS_ATOMIC, DBIAS_HEAD_SHARED, BLOCK_M, BLOCK_D, DOT_PRECISION, MASK_KIND,
                )
            if DBIAS == 1:
                if not DBIAS_HEAD_SHARED:
                    _flush_key_gradient(dbias_head, keys, key_real, stride_dbk, dbias_keys, DBIAS_ATOMIC)
                    dbias_keys = tl.zeros([BLOCK_N], dtype=tl.float32)

        if DBIAS == 1:
            if DBIAS_HEAD_SHARED:
                dbias_head = DBias + chunk * stride_dbc + b64 * stride_dbb + ((kv_head * group) // dbias_head_div).to(tl.int64) * stride_dbh
                _flush_key_gradient(dbias_head, keys, key_real, stride_dbk, dbias_keys, DBIAS_ATOMIC)

    offs_d = tl.arange(0, BLOCK_D)
    rows = (k_offset + keys)[:, None]
    ok = key_real[:, None] & (offs_d < head_dim)[None, :]
    dk_offsets = b_tokens * stride_dkb + kv_head * stride_dkh + rows * stride_dks + offs_d[None, :]
    dv_offsets = b_tokens * stride_dvb + kv_head * stride_dvh + rows * stride_dvs + offs_d[None, :]
    finisher = chunk == num_chunks - 1
    if num_chunks > 1 and column_work > 0:
        turn = Turns + tl.program_id(2) * tl.num_programs(1) + pid_n
        if CHUNKS_IN_ORDER:
            # The chunks of this key tile add their parts in chunk order, each waiting for its
            # turn: deterministic. Chunks of a tile are neighbours in the grid, so the ones
            # waited for have been scheduled already.
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
        else:
            # Each chunk adds its part into the zeroed scratch; the last to arrive writes the
            # sum. Nobody waits: a chain of turns would hold an SM per chunk while it spins.
            tl.atomic_add(ScratchK + dk_offsets, dk, mask=ok, sem="relaxed")
            tl.atomic_add(ScratchV + dv_offsets, dv, mask=ok, sem="relaxed")
            tl.debug_barrier()
            finisher = tl.atomic_add(turn, 1, sem="acq_rel") == num_chunks - 1
            if finisher:
                dk = tl.load(ScratchK + dk_offsets, mask=ok, other=0.0, cache_modifier=".cg")
                dv = tl.load(ScratchV + dv_offsets, mask=ok, other=0.0, cache_modifier=".cg")
    if finisher:
        tl.store(DK + dk_offsets, dk.to(DK.dtype.element_ty), mask=ok)
        tl.store(DV + dv_offsets, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, offs_m,
    k_source, v_source, stride_ks, stride_vs, mask_rows, stride_mk, bias_rows, stride_bk,
    tiles, tiles_per_block, key_limit, lo, hi, gap_lo, gap_hi,
    band_lo, band_hi, head_dim, scale, scale_log2, softcap_log2, scale_over_cap,
    STAGE: tl.constexpr, WALK: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """Accumulate dQ over the key tiles at walk positions ``[lo, hi)`` less ``[gap_lo, gap_hi)``."""
    count = (hi - lo) - (gap_hi - gap_lo)
    tile = tile_start(tiles, walk_position(0, lo, gap_lo, gap_hi), tiles_per_block, WALK)
    for j in range(0, count):
        next_tile = tile_start(tiles, walk_position(j + 1, lo, gap_lo, gap_hi), tiles_per_block, WALK)
        keys, key_ok = tile_indices(tiles, tile, key_limit, BLOCK_N, WALK)  # [BLOCK_N]
        k, scores, s = row_tile_scores(  # [BLOCK_N, BLOCK_D], then [BLOCK_M, BLOCK_N]
            q, offs_m, k_source, tile * BLOCK_N, keys, keys, key_ok, stride_ks, head_dim, band_lo, band_hi,
            bias_rows, stride_bk, mask_rows, stride_mk, scale_log2, softcap_log2, scale_over_cap,
            STAGE, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, TMA, BLOCK_D, DOT_PRECISION, MASK_KIND,
        )
        v = load_rows(v_source, tile * BLOCK_N, keys, key_ok, stride_vs, head_dim, STAGE != STAGE_INTERIOR, TMA, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        p, ds, dqk = softmax_grad(s, lse2, delta, dp, 0, scale, softcap_log2, SOFTCAP, scores)
        dq += tl.dot(dqk.to(k.dtype), k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
        tile = next_tile
    return dq


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _dq_kernel(
    Q, K, V, Mask, Bias, Walk, SeqQ, SeqK,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_wb, stride_wh, stride_wr, walk_width,
    seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim,
    mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
    band_lo, band_hi, scale, scale_log2, softcap_log2, scale_over_cap,
    DO, Lse, Delta, DQ,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, WALK: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SEQ: tl.constexpr, MASK_KIND: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) row tiles first, as in the forward
    b = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    kv_head = head // (num_heads // num_kv_heads)
    lse_rows = seqlen_q
    b_tok, q_start, seqlen_q, k_start, seqlen_k = sequence_span(SeqQ, SeqK, b, seqlen_q, seqlen_k, SEQ)
    if pid_m * BLOCK_M >= seqlen_q:
        return  # a row tile past this entry's queries (the grid spans the longest)
    b64 = b.to(tl.int64)
    b_tokens = b_tok.to(tl.int64)
    q_offset = q_start.to(tl.int64)
    k_offset = k_start.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen_q
    q_row = tl.minimum(offs_m, seqlen_q - 1).to(tl.int64)  # rows past the end read the last row
    q_base = Q + b_tokens * stride_qb + q_offset * stride_qs + head * stride_qh
    q = load_tile(q_base, offs_m, row_ok, stride_qs, head_dim, True, BLOCK_D)
    do = load_tile(DO + b_tokens * stride_dob + q_offset * stride_dos + head * stride_doh, offs_m, row_ok, stride_dos, head_dim, True, BLOCK_D)
    lse2, delta = _load_lse2(Lse, Delta, (b_tokens * num_heads + head) * lse_rows + q_offset, offs_m, seqlen_q)
    KV_TMA: tl.constexpr = TMA and WALK != WALK_KEYS  # gathered keys are read row by row
    k_source = row_source(K + b_tokens * stride_kb + k_offset * stride_ks + kv_head * stride_kh, seqlen_k, stride_ks, head_dim, KV_TMA, BLOCK_N, BLOCK_D)
    v_source = row_source(V + b_tokens * stride_vb + k_offset * stride_vs + kv_head * stride_vh, seqlen_k, stride_vs, head_dim, KV_TMA, BLOCK_N, BLOCK_D)
    mask_rows = Mask + b64 * stride_mb + (head // mask_head_div).to(tl.int64) * stride_mh
    bias_rows = Bias + b64 * stride_bb + (head // bias_head_div).to(tl.int64) * stride_bh
    if not MASK_PER_KEY:
        mask_rows += q_row * stride_mq
    if not BIAS_PER_KEY:
        bias_rows += q_row * stride_bq

    band_lo += seqlen_k - seqlen_q
    band_hi += seqlen_k - seqlen_q
    q_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, seqlen_q) - 1
    lists, tiles_per_block, key_limit, partial_lo, partial_hi, lo, interior_lo, interior_hi, hi = key_walk(
        Walk + b64 * stride_wb + (head // walk_head_div) * stride_wh, walk_width,
        summary_row(pid_m, list_block_q, BLOCK_M) * stride_wr, seqlen_k,
        pid_m * BLOCK_M, q_last, band_lo, band_hi, list_block_k, 0, 1, WALK, BLOCK_N,
    )
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    FIRST_STAGE: tl.constexpr = STAGE_PARTIAL if HAS_MASK else STAGE_INTERIOR  # as in the forward
    LAST_STAGE: tl.constexpr = STAGE_PARTIAL if HAS_MASK and WALK == WALK_DENSE else STAGE_EDGE
    for stage in tl.static_range(FIRST_STAGE, LAST_STAGE + 1):
        tiles, stage_lo, stage_hi, gap_lo, gap_hi = stage_tiles(
            stage, WALK, lists, walk_width, partial_lo, partial_hi, lo, interior_lo, interior_hi, hi,
        )
        dq = _dq_tiles(
            dq, q, do, lse2, delta, offs_m, k_source, v_source, stride_ks, stride_vs, mask_rows, stride_mk, bias_rows, stride_bk,
            tiles, tiles_per_block, key_limit, stage_lo, stage_hi, gap_lo, gap_hi,
            band_lo, band_hi, head_dim, scale, scale_log2, softcap_log2, scale_over_cap,
            stage, WALK, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, KV_TMA, BLOCK_N, BLOCK_D, DOT_PRECISION, MASK_KIND,
        )
    offs_d = tl.arange(0, BLOCK_D)
    dq_ptrs = DQ + b_tokens * stride_dqb + head * stride_dqh + (q_offset + offs_m)[:, None] * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d < head_dim)[None, :])


_GRADIENT_STRIDES = ("stride_dob", "stride_dos", "stride_doh")
preprocess_launcher = Launcher(
    _preprocess_kernel, tensors=("Out", "DOut", "Delta", "Workspace", "Walk"),
    specialized=("stride_ob", "stride_os", "stride_oh", "stride_db", "stride_ds", "stride_dh", "head_dim"),
)
dkdv_launcher = Launcher(
    _dkdv_kernel,
    tensors=(
        "Q", "K", "V", "Mask", "Bias", "Walk", "SeqQ", "SeqK",
        "DO", "Lse", "Delta", "DK", "DV", "DBias", "ScratchK", "ScratchV", "Turns",
    ),
    specialized=(*SPECIALIZED, *_GRADIENT_STRIDES, "stride_dkb", "stride_dks", "stride_dkh", "stride_dvb", "stride_dvs", "stride_dvh"),
    reset_to_zero=("DBias", "ScratchK", "ScratchV", "Turns"),
)
dq_launcher = Launcher(
    _dq_kernel,
    tensors=("Q", "K", "V", "Mask", "Bias", "Walk", "SeqQ", "SeqK", "DO", "Lse", "Delta", "DQ"),
    specialized=(*SPECIALIZED, *_GRADIENT_STRIDES, "stride_dqb", "stride_dqs", "stride_dqh"),
)


class BiasGradient(NamedTuple):
    """How the dK/dV kernel makes the bias gradient (:func:`bias_gradient`): in a zeroed buffer
    ``[chunks, Bd, Hd, Sqb, Sk]`` of ``dtype``, then summed over its chunks and, where ``Bd`` or
    ``Hd`` is a multiple of the bias's own, over each bias row's slices (:func:`sum_bias_gradient`)."""

    shape: tuple[int, int, int, int, int]
    dtype: torch.dtype
    kind: int  # DBIAS_FULL or DBIAS_PER_KEY
    atomic: bool
    head_shared: bool


def bias_gradient(
    bias, batch, num_heads, num_kv_heads, seqlen_k, deterministic, query_chunks, hopper=False, per_head_walk=False,
) -> BiasGradient | None:
    """How the dK/dV kernel makes the gradient of ``bias``; None when it is zero and takes no work.

    Programs own one (query chunk, batch, kv head). Where the bias is shared across programs
    (batch or kv heads broadcast), the deterministic path gives each program its own slice
    (extra memory: B or Hkv times the bias) and sums them afterwards; the default path
    accumulates with fp32 atomics. So do a per-key bias's query chunks, or, deterministic, each
    chunk gets a slice of its own (summed afterwards); a full bias needs neither, as chunks own
    disjoint query rows.

    The ``hopper`` kernel writes each element of a per-pair gradient once, in the bias's dtype
    (it adds a group's heads in registers), unless programs share it; a walk that differs per
    query head (``per_head_walk``) keeps a group's heads apart, so they add by atomics too, or,
    deterministic, each head gets its own slice.
    """
    bb, bh, bq, bk = bias.shape
    # A bias broadcast over several keys shifts whole rows, which the softmax ignores. Over one
    # key it is that key's bias: its gradient is 0 in a problem of its own, but not in a part of
    # a larger softmax (context parallelism's calls), so it is computed.
    if bk == 1 and seqlen_k > 1:
        return None
    shared_batch = bb == 1 and batch > 1
    shared_kv = bh == 1 and num_kv_heads > 1
    full = bq > 1
    chunked = not full and query_chunks > 1
    heads_apart = hopper and full and per_head_walk and bh != num_heads
    atomic = (shared_batch or shared_kv or heads_apart or chunked) and not deterministic
    rows_b = batch if shared_batch and deterministic else bb
    rows_h = bh
    if deterministic:
        rows_h = num_heads if heads_apart else num_kv_heads if shared_kv else bh
    chunks = query_chunks if chunked and deterministic else 1
    summed = (rows_b, rows_h) != (bb, bh)
    dtype = bias.dtype if hopper and full and not atomic and not summed else torch.float32
    return BiasGradient((chunks, rows_b, rows_h, bq, bk), dtype, DBIAS_FULL if full else DBIAS_PER_KEY, atomic, rows_h != num_heads)


def sum_bias_gradient(acc: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The bias gradient in ``bias``'s shape and dtype from the kernel's buffer ``acc``
    ``[chunks, Bd, Hd, Sqb, Sk]`` (:class:`BiasGradient`): summed over the chunks, then over the
    slices of each bias row (``Bd``, ``Hd`` multiples of the bias's), by torch, in a fixed order."""
    bb, bh, bq, bk = bias.shape
    _, rows_b, rows_h = acc.shape[:3]
    dbias = acc[0] if acc.shape[0] == 1 else acc.sum(dim=0)
    if (rows_b, rows_h) != (bb, bh):
        dbias = dbias.view(bb, rows_b // bb, bh, rows_h // bh, bq, bk).sum(dim=(1, 3))
    return dbias.to(bias.dtype)


def query_chunks(
    seqlen_q: int, seqlen_k: int, kv_entries: int, in_order: bool, device: torch.device, queued: bool = False, masked: bool = True,
    counted: bool = False,
) -> int:
    """Parts the query range of each key tile is split into for dK/dV.

    A key tile's whole column (every query, every head of its group) is one program's work;
    with a sparse per-key mask only a few such columns exist and the longest one sets the
    run time. Splitting each column bounds that. ``kv_entries`` is B x Hkv.

    - In order (deterministic, the Triton kernel): a chunk waits for the one before it,
      holding its SM, so chunks stay long (2048 queries each).
    - By atomics: enough programs for a mask that keeps 1/8 of the columns, at least 512
      queries each. H100, bf16, llm shape, keep 1/8, dK/dV kernel (ms) by chunks:

      | S | 1 | 4 | 8 | 16 | 32 |
      |---|---|---|---|---|---|
      | 4K | 0.81 | 0.24 | 0.16 | 0.16 | 0.19 |
      | 16K | 3.38 | 1.30 | 1.04 | 1.07 | 1.29 |
      | 32K | 6.90 | 3.55 | 3.27 | 3.31 | 3.80 |

      (Past the best, more chunks add atomics and K/V loads.)

    - ``queued``: the Hopper kernel (``hopper/dkdv.py``), one program per SM taking items off
      a queue, wants about 1.5 non-empty items per SM, and no more: a mask (element-wise or a
      block summary alone) is taken to keep 1/8 of the columns, no mask all of them. Its time
      (ms) by chunks, same shapes, and the per-query-block top-k of the topkq suite (16K, every
      column used but sparse, the sink column by every query):

      | case | 1 | 2 | 4 | 8 | 16 |
      |---|---|---|---|---|---|
      | 16K keep 1/8 | 1.62 | 0.85 | **0.63** | 0.66 | 0.81 |
      | 32K keep 1/8 | 3.26 | **1.81** | 1.95 | 2.04 | 2.35 |
      | 16K no mask | **3.40** | 3.77 | 3.85 | 4.31 | 4.89 |
      | 16K topkq | 1.70 | 1.00 | **0.96** | 1.12 | 1.30 |

    - ``counted``: the Hopper kernel walking a block summary counts the work of every column
      itself (``hopper/dkdv._counted_chunks``), so the mask's real density, not an assumed 1/8,
      picks the chunks; this gives the most it may take.
    """
    if in_order:
        return max(1, min(MAX_QUERY_CHUNKS, seqlen_q // _QUERIES_PER_CHUNK))
    columns = max(kv_entries * cdiv(seqlen_k, _COLUMN_KEYS), 1)
    if counted:
        wanted = MAX_QUERY_CHUNKS
    elif queued:
        working = cdiv(columns, 8) if masked else columns
        wanted = cdiv(3 * configs.multiprocessor_count(device), 2 * working)
    else:
        wanted = cdiv(_COLUMNS_WANTED_PER_SM * configs.multiprocessor_count(device), columns)
    return max(1, min(MAX_QUERY_CHUNKS, seqlen_q // _QUERIES_PER_ATOMIC_CHUNK, wanted))


_forced: tuple[int, bool] | None = None  # (chunks, counted), set by forced_query_chunks


@contextlib.contextmanager
def forced_query_chunks(chunks: int | None, counted: bool = False):
    """Inside, every backward splits each key tile's queries into ``chunks`` parts, whatever
    :func:`query_chunks` would choose (None: leave it the choice); ``counted``: into at most
    ``chunks``, where the Hopper kernel counts its columns' work (``hopper/dkdv.count_columns``) as it
    does unforced. For the tests and fuzz trials that take the chunks' path on short sequences,
    and the chunk sweeps of ``tools/kernel_times.py``. Process-wide: not for calls running in
    other threads."""
    global _forced
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks: expected None or a count >= 1, got {chunks}")
    outer = _forced
    _forced = None if chunks is None else (chunks, counted)
    changed = _forced != outer
    if changed:
        forget_memos()  # the chunks of a layout seen before are remembered
    try:
        yield
    finally:
        _forced = outer
        if changed:
            forget_memos()


def _zeroed_parts(
    call: Call, hopper_dkdv: bool, hopper_dq: bool, chunks: int, sequences, gradient: BiasGradient | None,
) -> dict | None:
    """The parts of the backward's workspace (``_Workspace``) that its kernels need zeroed, by
    name, as ``(dtype, shape)``: ``sums``, dK's and dV's chunks added by atomics ``[2, B, Sk, Hkv,
    D]`` float32 (the Hopper kernel's ``[2, *hopper/dkdv.sums_shape]``); ``turns``, the Triton
    dK/dV kernel's counter per key tile (any BLOCK_N), ``[B * Hkv * cdiv(Sk, 16)]`` int32;
    ``dbias``, the float32 buffer of the bias ``gradient``, where the workspace lives to the
    backward's end anyway (dQ beside dK/dV) and the gradient is cast to the bias's dtype after
    (so that nothing returned holds the workspace): no allocation and fill of its own. None when
    there is nothing to zero, not even the Hopper kernels' queues."""
    parts = {}
    if chunks > 1 and not call.deterministic:
        parts["sums"] = (torch.float32, (2, *(sums_shape(call) if hopper_dkdv else call.k.shape)))
    if chunks > 1 and not hopper_dkdv:
        batch, _, seqlen_k = grid_sizes(call.q, call.k, sequences)
        parts["turns"] = (torch.int32, (batch * call.k.shape[2] * cdiv(seqlen_k, _SMALLEST_BLOCK_N),))
    if gradient is not None and hopper_dq and gradient.dtype == torch.float32 and call.bias.dtype != torch.float32:
        parts["dbias"] = (torch.float32, gradient.shape)
    return parts if parts or hopper_dkdv or hopper_dq else None


def _zeroing_programs(words: int) -> int:
    """The programs of ``_preprocess_kernel`` that zero a workspace of ``words`` (its header aside)."""
    return cdiv(words - _HEADER_WORDS.value, _ZERO_WORDS.value)


class _Workspace(NamedTuple):
    """Where the backward's zeroed scratch lies in its one int32 allocation: a header of
    ``_HEADER_WORDS`` (the Hopper kernels' queues), then each part of ``_zeroed_parts`` from a
    128-byte boundary, seen in its dtype (4 bytes) and shape; ``words`` in all, rounded up to whole
    zeroing programs so that their stores need no bounds (and vectorise)."""

    words: int
    parts: tuple  # (name, first word, dtype, shape) each

    @classmethod
    def of(cls, parts: dict) -> _Workspace:
        placed, words = [], _HEADER_WORDS.value
        for name, (dtype, shape) in parts.items():
            placed.append((name, words, dtype, shape))
            words += cdiv(math.prod(shape), _HEADER_WORDS.value) * _HEADER_WORDS.value
        return cls(_HEADER_WORDS.value + _zeroing_programs(words) * _ZERO_WORDS.value, tuple(placed))

    def allocate(self, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The workspace, and its parts' views by name. Its contents are ``_preprocess``'s to write."""
        workspace = torch.empty(self.words, dtype=torch.int32, device=device)
        views = {
            name: workspace[first: first + math.prod(shape)].view(dtype).view(shape) for name, first, dtype, shape in self.parts
        }
        return workspace, views

    def first_word(self, name: str) -> int | None:
        """Where part ``name`` starts, None if there is no such part."""
        return next((first for part, first, _, _ in self.parts if part == name), None)


def _preprocess(
    call: Call, out: torch.Tensor, dout: torch.Tensor, workspace: torch.Tensor | None, counted: bool,
    live_sums: tuple[int, int] | None, signature: tuple,
) -> torch.Tensor:
    """Launch ``_preprocess_kernel``: ``workspace`` (``_Workspace``) zeroed, with ``counted`` the
    Hopper dK/dV columns' work in its header; ``live_sums`` ``(first word, walk)``: where the
    Hopper dK/dV's chunk sums start, of which only the rows the walk says it adds to are zeroed
    (``hopper/dkdv.live_walk``). Returns ``delta`` ``[B, H, Sq]`` float32. ``signature``: the
    layouts of the call, of ``dout`` and of the gradients (``attention_backward``'s)."""
    q = call.q
    batch, token_rows, num_heads, head_dim = q.shape  # delta is per token: packed sequences need no bounds
    delta = torch.empty(batch, num_heads, token_rows, dtype=torch.float32, device=q.device)
    has_workspace = workspace is not None
    words = workspace.numel() if has_workspace else 0
    sums_first, live = live_sums or (0, WALK_DENSE.value)
    walk_kind = WALK_BLOCKS.value if counted else live
    walk_tensor = walked(call, walk_kind)
    walk = placeholder(q.device, torch.int32) if walk_tensor is None else walk_tensor
    if not has_workspace:
        workspace = walk  # a placeholder: nothing is written
    programs = cdiv(token_rows, _DELTA_ROWS) * batch * num_heads
    if has_workspace:  # the header's, and as many as zero the workspace or compute delta
        programs = 1 + max(programs, _zeroing_programs(words))

    def build():
        block_d = configs.head_dim_block(head_dim)
        walk_args, tile = walk_arguments(call, walk_kind)
        args = [
            out, dout, delta, workspace, walk, *out.stride()[:3], *dout.stride()[:3], token_rows, num_heads, head_dim,
            words, *walk_args, sums_first, _DELTA_ROWS, block_d, has_workspace, counted, live, *tile,
        ]
        return args, (out.dtype, block_d, has_workspace, counted, live)

    preprocess_launcher.launch(
        (signature, out.dtype, dout.dtype, out.stride(), words, counted, live_sums), [out, dout, delta, workspace, walk], build,
        configs.single_program_config, lambda meta: (programs,),
    )
    return delta


def _launch_dkdv(call, dout, lse, delta, dk, dv, dbias_acc, dbias_flags, chunks, in_order, sequences, signature, sums, turns):
    """The dK/dV launch of ``attention_backward``. Query chunks add up in fp32: in chunk order
    when ``in_order``, else by atomics into ``sums`` (``_Workspace``), each key tile's last
    chunk writing it; ``turns`` (zeroed) counts each key tile's chunks, their turns or arrivals
    (both None with one chunk; ``sums`` None in order).
    ``signature``: the layouts of the call, of ``dout`` and of the gradients (``attention_backward``'s)."""
    q, k = call.q, call.k
    batch, seqlen_q, seqlen_k = grid_sizes(q, k, sequences)
    num_heads, head_dim, num_kv_heads = q.shape[2], q.shape[3], k.shape[2]
    device = q.device
    block_d = configs.head_dim_block(head_dim)
    list_block_q, list_block_k = call.list_block_q, call.list_block_k
    no_floats = placeholder(device, torch.float32)
    scratch_k, scratch_v = no_floats, no_floats
    if chunks > 1:
        scratch_k, scratch_v = torch.empty((2, *dk.shape), dtype=torch.float32, device=device) if in_order else sums
    else:
        turns = placeholder(device, torch.int32)
    walk = call.key_list if call.key_list is not None else call.q_lists
    own = [dout, lse, delta, dk, dv, no_floats if dbias_acc is None else dbias_acc, scratch_k, scratch_v, turns]

    def build():
        runtime, flags = common_arguments(call, call.q_lists, sequences=sequences)
        dbias_slice = None if dbias_acc is None else dbias_acc[0]
        args = [
            *runtime, *own, *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            0 if dbias_acc is None or dbias_acc.shape[0] == 1 else dbias_acc.stride(0),
            *broadcast_strides(dbias_slice), head_divisor(dbias_slice, num_heads),
            *flags, *dbias_flags, in_order, block_d,
        ]
        key = (q.dtype, *flags, *dbias_flags, in_order, block_d, configs.length_bucket(seqlen_q),
               configs.length_bucket(seqlen_k), list_block_q, list_block_k)
        return args, key

    def candidates():
        return configs.fit_to_problem(configs.backward_candidates(device, block_d, "dkdv"), seqlen_q, list_block_q, list_block_k)

    layout = (signature, chunks, dbias_flags)
    dkdv_launcher.launch(
        layout, [*common_tensors(call, walk, sequences), *own], build, candidates,
        lambda meta: (chunks, cdiv(seqlen_k, meta["BLOCK_N"]), batch * num_kv_heads),
    )


def _launch_dq(call, dout, lse, delta, dq, sequences, signature):
    """The Triton dQ launch of ``attention_backward``. ``signature``: the layouts of the call, of
    ``dout`` and of ``dq`` (``attention_backward``'s)."""
    q, k = call.q, call.k
    batch, seqlen_q, seqlen_k = grid_sizes(q, k, sequences)
    num_heads, head_dim = q.shape[2], q.shape[3]
    device = q.device
    block_d = configs.head_dim_block(head_dim)
    walk = call.key_list if call.key_list is not None else call.kv_lists

    def build():
        runtime, flags = common_arguments(call, call.kv_lists, sequences=sequences)
        tma = copy_engine_reads(block_d, seqlen_k, k, call.v)
        args = [*runtime, dout, lse, delta, dq, *dout.stride()[:3], *dq.stride()[:3], *flags, tma, block_d]
        key = (q.dtype, *flags, tma, block_d, configs.length_bucket(seqlen_q), configs.length_bucket(seqlen_k),
               call.list_block_q, call.list_block_k)
        return args, key

    def candidates():
        return configs.fit_to_problem(configs.backward_candidates(device, block_d, "dq"), seqlen_q, call.list_block_q, call.list_block_k)

    dq_launcher.launch(
        signature,
        [*common_tensors(call, walk, sequences), dout, lse, delta, dq], build, candidates,
        lambda meta: (cdiv(seqlen_q, meta["BLOCK_M"]), batch * num_heads),
    )


def attention_backward(
    dout: torch.Tensor,
    call: Call,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias_requires_grad: bool,
    num_query_chunks: int | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernels of ``call`` (see ``forward.attention_forward``) for the
    forward's ``out`` ``[B, Sq, H, D]`` and ``lse`` ``[B, H, Sq]``.

    ``num_query_chunks`` overrides ``query_chunks`` (for tests).

    Returns ``dq`` ``[B, Sq, H, D]``, ``dk`` and ``dv`` ``[B, Sk, Hkv, D]`` in ``grad_dtype`` (default:
    the inputs' dtype) and layout, and the bias gradient in the bias's shape and dtype (None when
    not asked for).
    """
    q, k, bias = call.q, call.k, call.bias
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    lse = lse.contiguous()
    grad_dtype = grad_dtype or q.dtype
    bias_requires_grad = bias is not None and bias_requires_grad
    # The layout of everything the passes read but out and lse (whose own layouts key the preprocess launch).
    signature = (
        call_signature(call), dout.stride(), dout.data_ptr() % 16 == 0, device_kind(q.device), bias_requires_grad,
        num_query_chunks, grad_dtype,
    )
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.remember(signature, _plan(call, dout, bias_requires_grad, num_query_chunks))
    sequences = packed_sequences(call)
    device = q.device
    dk = torch.empty(k.shape, dtype=grad_dtype, device=device)
    dv = torch.empty_like(dk)
    workspace, parts = plan.workspace.allocate(device) if plan.workspace is not None else (None, {})
    delta = _preprocess(call, out, dout, workspace, plan.counted, plan.live_sums, signature)
    gradient = plan.bias_gradient
    dbias_acc = parts.get("dbias")
    if gradient is not None and dbias_acc is None:
        dbias_acc = torch.zeros(gradient.shape, dtype=gradient.dtype, device=device)
    dbias_flags = (DBIAS_NONE, False, False) if gradient is None else (gradient.kind, gradient.atomic, gradient.head_shared)
    finish_dkdv = kept = None
    if plan.hopper_dkdv or plan.hopper_dq:
        kept = kept_keys(call)  # a key list's kept keys, gathered once for both
    with kernels_side_by_side():
        if plan.hopper_dq:
            # The Hopper dQ kernel runs behind dK/dV, on the multiprocessors dK/dV's programs free
            # (``hopper_dq``): all it uses is made before dK/dV starts.
            dq = torch.empty(q.shape, dtype=grad_dtype, device=device)
        if plan.hopper_dkdv:
            finish_dkdv = hopper_dkdv(
                call, dout, lse, delta, dk, dv, dbias_acc, dbias_flags, plan.chunks, plan.counted, workspace[:3],
                parts.get("sums"), kept, signature, sequences,
            )
        else:
            _launch_dkdv(
                call, dout, lse, delta, dk, dv, dbias_acc, dbias_flags, plan.chunks, call.deterministic, sequences, signature,
                parts.get("sums"), parts.get("turns"),
            )
        if plan.hopper_dq:
            hopper_dq(call, dout, lse, delta, dq, workspace[4:5], kept, signature, sequences)
    if finish_dkdv is not None:
        finish_dkdv()
    if not plan.hopper_dq:
        # dQ is allocated once the dK/dV scratch (the workspace, a Hopper call's slices, held by
        # its ``finish``) and the gathered keys are released, so they never add up in the peak.
        workspace = parts = finish_dkdv = kept = None
        dq = torch.empty(q.shape, dtype=grad_dtype, device=device)
        _launch_dq(call, dout, lse, delta, dq, sequences, signature)

    dbias = None
    if gradient is not None:
        dbias = sum_bias_gradient(dbias_acc, bias)
    elif bias_requires_grad:
        dbias = bias.new_zeros(bias.shape)  # a bias broadcast over keys cannot change the softmax
    return dq, dk, dv, dbias


class _Plan(NamedTuple):
    """What a backward decides from its layout alone (memoised per layout in :data:`_PLANS`)."""

    hopper_dkdv: bool  # the Gluon kernels of ``hopper/`` serve dK/dV, and dQ (``dispatch.py``)
    hopper_dq: bool
    chunks: int  # query chunks of dK/dV (``query_chunks``)
    counted: bool  # the Hopper dK/dV kernel takes at most ``chunks``, as its columns' work wants
    live_sums: tuple[int, int] | None  # where its chunk sums start in the workspace, and the walk that tells their live rows
    bias_gradient: BiasGradient | None  # None when not asked for, or zero
    workspace: _Workspace | None  # the zeroed scratch, None when there is none


_PLANS = Memo()


def _plan(call: Call, dout: torch.Tensor, bias_requires_grad: bool, num_query_chunks: int | None) -> _Plan:
    sequences = packed_sequences(call)
    batch, seqlen_q, seqlen_k = grid_sizes(call.q, call.k, sequences)
    num_heads, num_kv_heads = call.q.shape[2], call.k.shape[2]
    hopper_dkdv = route("dkdv", form_of("dkdv", call, sequences, dout=dout)) == HOPPER
    hopper_dq = route("dq", form_of("dq", call, sequences, dout=dout)) == HOPPER
    masked = call.mask is not None or call.q_lists is not None or call.key_list is not None
    forced, may_count = (num_query_chunks, False) if num_query_chunks else (_forced or (None, True))
    # The Hopper kernel counts the columns' work where it walks a block summary over fixed
    # sequences and the chunks add up by atomics (deterministic ones keep a slice each).
    counted = (
        may_count and hopper_dkdv and call.q_lists is not None and call.key_list is None and sequences is None
        and not call.deterministic
    )
    # The Hopper kernel's chunks run side by side whether or not they add up in order.
    chunks = forced or query_chunks(
        seqlen_q, seqlen_k, batch * num_kv_heads, call.deterministic and not hopper_dkdv, call.q.device, hopper_dkdv, masked,
        counted,
    )
    counted = counted and chunks > 1
    gradient = None
    if bias_requires_grad:
        per_head_walk = walks_per_group(call.q_lists, num_heads, num_kv_heads) > 1
        gradient = bias_gradient(
            call.bias, batch, num_heads, num_kv_heads, seqlen_k, call.deterministic, chunks, hopper_dkdv, per_head_walk,
        )
    zeroed = _zeroed_parts(call, hopper_dkdv, hopper_dq, chunks, sequences, gradient)
    workspace = None if zeroed is None else _Workspace.of(zeroed)
    sums_first = None if workspace is None else workspace.first_word("sums")
    live_sums = (sums_first, live_walk(call, sequences)) if hopper_dkdv and sums_first is not None else None
    return _Plan(hopper_dkdv, hopper_dq, chunks, counted, live_sums, gradient, workspace)
