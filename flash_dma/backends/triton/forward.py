"""Forward pass: online-softmax attention that walks only the tiles holding visible keys.

Grid: ``(row tiles, batch x heads, key splits)``. A program owns ``BLOCK_M`` query rows of one
head (or, with PACK_GQA, the rows of all query heads of one key/value head, so that each K/V
tile is loaded once per group) and runs ``_attn_fwd_tiles`` over up to three stretches of key
tiles, one loop per stage (see ``tiles.py`` for the walks and stages):

1. PARTIAL tiles of a block summary: element-wise mask, bounds and band checks;
2. interior tiles (every key visible to every row): no checks at all;
3. edge tiles of the causal/window band, or past the last key: bounds and band checks.

With SPLIT, the key range is cut into ``num_splits`` parts whose partial results are merged by
``_combine_splits_kernel`` through their log-sum-exps (flash-decoding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.dispatch import HOPPER, device_kind, form_of, route
from flash_dma.backends.triton.hopper.forward import hopper_forward
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import (
    NOT_SPECIALIZED,
    SPECIALIZED,
    CachePages,
    Call,
    Sequences,
    cache_tables,
    call_signature,
    common_arguments,
    common_tensors,
    copy_engine_reads,
    grid_sizes,
    sequences_signature,
    tensor_layout,
)
from flash_dma.backends.triton.tiles import (
    LN2,
    LOG2E,
    SEQ_CACHE,
    SEQ_PACKED,
    STAGE_EDGE,
    STAGE_INTERIOR,
    STAGE_PARTIAL,
    WALK_DENSE,
    WALK_KEYS,
    key_walk,
    load_rows,
    page_rows,
    row_source,
    row_tile_scores,
    sequence_span,
    stage_tiles,
    summary_row,
    tile_indices,
    tile_start,
    walk_position,
)
from flash_dma.inputs import FP8_OUT_DTYPE, dequantize, output_dtype
from flash_dma.integers import cdiv
from flash_dma.memo import Memo

MAX_SPLITS = 256
_KEYS_PER_SPLIT = 256  # fewer keys than this per split is not worth a split


@triton.jit
def _attn_fwd_tiles(
    acc, l_i, m_i, q, q_idx,
    k_source, v_source, stride_ks, stride_vs, mask_rows, stride_mk, bias_rows, stride_bk, table_row, page_size, cache_last,
    tiles, tiles_per_block, key_limit, lo, hi, gap_lo, gap_hi,
    band_lo, band_hi, head_dim, scale_log2, softcap_log2, scale_over_cap,
    STAGE: tl.constexpr, WALK: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, PAGED: tl.constexpr, TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """Online softmax over the key tiles at walk positions ``[lo, hi)`` less ``[gap_lo, gap_hi)``."""
    count = (hi - lo) - (gap_hi - gap_lo)
    tile = tile_start(tiles, walk_position(0, lo, gap_lo, gap_hi), tiles_per_block, WALK)
    for j in range(0, count):
        next_tile = tile_start(tiles, walk_position(j + 1, lo, gap_lo, gap_hi), tiles_per_block, WALK)
        keys, key_ok = tile_indices(tiles, tile, key_limit, BLOCK_N, WALK)  # [BLOCK_N]
        kv_rows = page_rows(table_row, keys, key_ok, page_size, cache_last, PAGED)
        # Copied whole, a tile starts at its first key's row; a paged one lies within one page.
        first_row = tile * BLOCK_N
        if PAGED and TMA:
            first_row = page_rows(table_row, first_row, True, page_size, cache_last, PAGED)
        _, _, s = row_tile_scores(  # [BLOCK_M, BLOCK_N]
            q, q_idx, k_source, first_row, keys, kv_rows, key_ok, stride_ks, head_dim, band_lo, band_hi,
            bias_rows, stride_bk, mask_rows, stride_mk, scale_log2, softcap_log2, scale_over_cap,
            STAGE, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, TMA, BLOCK_D, DOT_PRECISION, MASK_KIND,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead, so p = 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_rows(v_source, first_row, kv_rows, key_ok, stride_vs, head_dim, STAGE != STAGE_INTERIOR, TMA, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        if PAGED and TMA and STAGE != STAGE_INTERIOR:
            # Past the sequence, a page's rows are unwritten (NaN, say): P is 0 there, 0 x NaN is not.
            v = tl.where(key_ok[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
        m_i = m_new
        tile = next_tile
    return acc, l_i, m_i


@triton.jit(do_not_specialize=[
    *NOT_SPECIALIZED, "stride_lse_split", "stride_lse_b", "stride_lse_h", "stride_lse_q",
    "stride_table", "page_size", "cache_rows_given", "cache_last",
])
def _attn_fwd_kernel(
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
    Out, Lse,
    stride_o_split, stride_ob, stride_os, stride_oh,
    stride_lse_split, stride_lse_b, stride_lse_h, stride_lse_q,
    rows, CacheRows, BlockTable, stride_table, page_size, cache_rows_given, cache_last,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, WALK: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SEQ: tl.constexpr, MASK_KIND: tl.constexpr, TMA: tl.constexpr, PACK_GQA: tl.constexpr, SPLIT: tl.constexpr, PAGED: tl.constexpr,
    PAGE_TILES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Last row tiles first: under a causal band they hold the most work, so the grid's tail is light.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    group = num_heads // num_kv_heads
    b = pid_bh // (num_kv_heads if PACK_GQA else num_heads)
    b_tok, q_start, seqlen_q, k_start, seqlen_k = sequence_span(SeqQ, SeqK, b, seqlen_q, seqlen_k, SEQ)
    if SEQ == SEQ_PACKED:
        rows = seqlen_q  # packed sequences never pack GQA heads
    if pid_m * BLOCK_M >= rows:
        return  # a row tile past this entry's queries (the grid spans the longest)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if PACK_GQA:
        # Rows are (query, head-in-group) pairs, heads fastest: one program serves a whole group.
        kv_head = pid_bh % num_kv_heads
        q_idx = offs_m // group
        head = kv_head * group + offs_m % group
        first_head = kv_head * group
        q_lo = (pid_m * BLOCK_M) // group
        q_hi = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows) - 1) // group
    else:
        head = pid_bh % num_heads
        kv_head = head // group
        q_idx = offs_m
        first_head = head
        q_lo = pid_m * BLOCK_M
        q_hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows) - 1
    row_ok = offs_m < rows
    q_row = tl.minimum(q_idx, seqlen_q - 1).to(tl.int64)  # rows past the end read the last row
    b64 = b.to(tl.int64)
    b_tokens = b_tok.to(tl.int64)
    # The cache row of a cached entry (a paged cache is one pool of pages: its rows come from the table).
    b_kv = b_tokens
    if SEQ == SEQ_CACHE:
        b_kv = tl.load(CacheRows + b, mask=cache_rows_given != 0, other=b)
        b_kv = tl.minimum(tl.maximum(b_kv, 0), cache_last).to(tl.int64)  # as for pages (``page_rows``)
    if PAGED:
        b_kv = b_kv * 0
    table_row = BlockTable + b64 * stride_table

    if TMA and not PACK_GQA:
        # Through the copy engine the tile stays in shared memory, where the first dot reads it.
        q = row_source(
            Q + b_tokens * stride_qb + q_start.to(tl.int64) * stride_qs + head * stride_qh, seqlen_q, stride_qs, head_dim,
            True, BLOCK_M, BLOCK_D,
        ).load([pid_m * BLOCK_M, 0])  # [BLOCK_M, BLOCK_D]
    else:
        q = tl.load(  # [BLOCK_M, BLOCK_D]
            Q + b_tokens * stride_qb + ((q_start + q_row) * stride_qs + head * stride_qh)[:, None] + offs_d[None, :],
            mask=row_ok[:, None] & (offs_d < head_dim)[None, :],
            other=0.0,
        )
    kv_offset = k_start.to(tl.int64)
    # Gathered keys (a key list) are scattered: those are read row by row. So are a paged cache's,
    # unless every tile lies within one page (PAGE_TILES), copied then from the pool of pages.
    KV_TMA: tl.constexpr = TMA and WALK != WALK_KEYS and (PAGE_TILES or not PAGED)
    kv_length = seqlen_k
    if PAGED:
        kv_length = (cache_last + 1) * page_size
    k_source = row_source(K + b_kv * stride_kb + kv_offset * stride_ks + kv_head * stride_kh, kv_length, stride_ks, head_dim, KV_TMA, BLOCK_N, BLOCK_D)
    v_source = row_source(V + b_kv * stride_vb + kv_offset * stride_vs + kv_head * stride_vh, kv_length, stride_vs, head_dim, KV_TMA, BLOCK_N, BLOCK_D)
    # Per-key mask/bias: one base pointer shared by every row; otherwise one pointer per row.
    # A cache's bias is stored with its keys, so it follows their rows.
    mask_rows = Mask + b64 * stride_mb
    if MASK_PER_KEY:
        mask_rows += (first_head // mask_head_div).to(tl.int64) * stride_mh
    else:
        mask_rows += (head // mask_head_div).to(tl.int64) * stride_mh + q_row * stride_mq
    bias_rows = Bias + (b_kv if SEQ == SEQ_CACHE else b64) * stride_bb
    if BIAS_PER_KEY:
        bias_rows += (first_head // bias_head_div).to(tl.int64) * stride_bh
    else:
        bias_rows += (head // bias_head_div).to(tl.int64) * stride_bh + q_row * stride_bq
    walk = Walk + b64 * stride_wb + (first_head // walk_head_div) * stride_wh

    # Key tiles that the causal/window band leaves visible to these rows: this split's share.
    band_lo += seqlen_k - seqlen_q
    band_hi += seqlen_k - seqlen_q
    lists, tiles_per_block, key_limit, partial_lo, partial_hi, lo, interior_lo, interior_hi, hi = key_walk(
        walk, walk_width, summary_row(pid_m, list_block_q, BLOCK_M) * stride_wr, seqlen_k, q_lo, q_hi, band_lo, band_hi, list_block_k,
        split, tl.num_programs(2), WALK, BLOCK_N,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The stages of the walk (tiles.py): PARTIAL tiles where a mask is read (every tile, for a mask
    # without a summary), then the band's interior and edge tiles.
    FIRST_STAGE: tl.constexpr = STAGE_PARTIAL if HAS_MASK else STAGE_INTERIOR
    LAST_STAGE: tl.constexpr = STAGE_PARTIAL if HAS_MASK and WALK == WALK_DENSE else STAGE_EDGE
    for stage in tl.static_range(FIRST_STAGE, LAST_STAGE + 1):
        tiles, stage_lo, stage_hi, gap_lo, gap_hi = stage_tiles(
            stage, WALK, lists, walk_width, partial_lo, partial_hi, lo, interior_lo, interior_hi, hi,
        )
        acc, l_i, m_i = _attn_fwd_tiles(
            acc, l_i, m_i, q, q_idx, k_source, v_source, stride_ks, stride_vs, mask_rows, stride_mk, bias_rows, stride_bk,
            table_row, page_size, cache_last, tiles, tiles_per_block, key_limit, stage_lo, stage_hi, gap_lo, gap_hi,
            band_lo, band_hi, head_dim, scale_log2, softcap_log2, scale_over_cap,
            stage, WALK, HAS_BIAS, SOFTCAP, MASK_PER_KEY, BIAS_PER_KEY, PAGED, KV_TMA, BLOCK_N, BLOCK_D, DOT_PRECISION, MASK_KIND,
        )

    # Rows with no visible key: out = 0, lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    q_out = q_start + q_idx.to(tl.int64)
    tl.store(
        Out + split * stride_o_split + b_tokens * stride_ob + (q_out * stride_os + head * stride_oh)[:, None] + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d < head_dim)[None, :],
    )
    tl.store(
        Lse + split * stride_lse_split + b_tokens * stride_lse_b + head * stride_lse_h + q_out * stride_lse_q,
        lse,
        mask=row_ok,
    )


@triton.jit(do_not_specialize=["num_splits", "seqlen_q", "num_heads", "stride_o_split", "stride_lse_split"])
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
    lse_s = tl.load(LseSplits + offs_s * stride_lse_split + row, mask=split_ok, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2((lse_s - m) * LOG2E)
    total = tl.sum(weight, 0)
    partial = tl.load(  # [BLOCK_S, BLOCK_D]
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


forward_launcher = Launcher(
    _attn_fwd_kernel,
    tensors=("Q", "K", "V", "Mask", "Bias", "Walk", "SeqQ", "SeqK", "Out", "Lse", "CacheRows", "BlockTable"),
    specialized=(*SPECIALIZED, "stride_o_split", "stride_ob", "stride_os", "stride_oh", "rows"),
)
combine_launcher = Launcher(_combine_splits_kernel, tensors=("OutSplits", "LseSplits", "Out", "Lse"), specialized=("head_dim",))


def split_count(programs: int, seqlen_k: int, device: torch.device) -> int:
    """Split-KV parts: about two programs per multiprocessor (measured faster than one wave at Sk = 512K)."""
    sms = configs.multiprocessor_count(device)
    return 1 if programs >= sms else max(1, min(2 * sms // programs, seqlen_k // _KEYS_PER_SPLIT, MAX_SPLITS))


def packed_sequences(call: Call) -> Sequences | None:
    """The kernels' description of a call's packed (varlen) sequences, or None for a plain batch."""
    if call.cu_seqlens_q is None:
        return None
    return Sequences(SEQ_PACKED, call.cu_seqlens_q, call.cu_seqlens_k, call.cu_seqlens_q.shape[0] - 1, call.max_seqlen_q, call.max_seqlen_k)


def attention_forward(
    call: Call, num_splits: int | None = None, sequences: Sequences | None = None, cache: CachePages | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel of ``call`` (it walks ``kv_lists`` or the key list).

    Args:
        call: q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` (last dimension contiguous), mask
            and bias ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` or None (with a key list the mask is not read),
            a summary's ``kv_lists`` ``[Bl, Hl, NQB, 2, 2, NKB + 1]`` with its block sizes (0 for an
            axis of one block), or a key list ``[Bm, Hm, 2, Sk + 1]`` (``key_list.py``).
        num_splits: split-KV parts; None picks them from the problem and the GPU.
        sequences: cached entries (``layout.Sequences``); packed ones come from the call. Then B,
            Sq and Sk above are the entries and their longest lengths; masks, biases and lists are
            per entry.
        cache: with cached entries, where their keys are (then the bias, per key, is stored with
            the keys: ``[B_cache, Hm, 1, S_cache]``, or ``[1, Hm, 1, pages * page_size]`` paged).

    Returns:
        ``out`` and ``lse`` in the layout of q: ``[B, Sq, H, D]`` in q's dtype and ``[B, H, Sq]`` float32.
    """
    sequences = sequences or packed_sequences(call)
    indexed = cache is not None and (cache.rows is not None or cache.block_table is not None)
    page_size = cache.page_size if cache is not None and cache.block_table is not None else 0
    signature = (call_signature(call), sequences_signature(sequences), indexed, page_size, num_splits, device_kind(call.q.device))
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.remember(signature, _plan(call, sequences, num_splits, indexed, page_size))
    q, k, key_list, kv_lists = call.q, call.k, call.key_list, call.kv_lists
    if call.descale is not None and not plan.hopper:  # FP8 without a kernel of its own: dequantized
        q_descale, k_descale, v_descale = call.descale.unbind(-1)
        dequantized = call._replace(q=dequantize(q, q_descale), k=dequantize(k, k_descale), v=dequantize(call.v, v_descale), descale=None)
        out, lse = attention_forward(dequantized, num_splits, sequences, cache)
        return out.to(FP8_OUT_DTYPE), lse
    out = torch.empty(q.shape, dtype=output_dtype(q.dtype), device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    if plan.hopper:
        hopper_forward(call, out, lse, signature, sequences, cache)
        return out, lse
    pack_gqa, rows, num_splits = plan.pack_gqa, plan.rows, plan.num_splits
    list_block_q, list_block_k = call.list_block_q, call.list_block_k
    batch, _, seqlen_k = grid_sizes(q, k, sequences)
    num_heads, head_dim, num_kv_heads = q.shape[2], q.shape[3], k.shape[2]
    walked = key_list if key_list is not None else kv_lists
    if num_splits > 1:
        out_target = torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device)
        lse_target = torch.empty(num_splits, q.shape[0], q.shape[1], num_heads, dtype=torch.float32, device=q.device)
    else:
        out_target, lse_target = out.unsqueeze(0), lse
    block_d = configs.head_dim_block(head_dim)
    heads = num_kv_heads if pack_gqa else num_heads
    decode = rows <= 64
    cache_rows, table, kernel_page_size, cache_last = cache_tables(cache, k)
    paged = page_size > 0
    def kv_reads() -> tuple[bool, bool, int]:
        """``(tma, page_tiles, fit_block_k)``: whether K/V tiles are copied whole (TMA), whether a
        paged cache's are (key tiles of a power of two up to the page size lie within one page),
        and the largest key tile. Decided once per layout, by ``build`` and ``candidates``."""
        tma = copy_engine_reads(block_d, seqlen_k, q, k, call.v)
        page_tiles = paged and tma and page_size >= configs.MIN_TILE and page_size & (page_size - 1) == 0
        return tma, page_tiles, min(b for b in (list_block_k, page_size if page_tiles else 0, 1 << 30) if b > 0)

    def build():
        runtime, flags = common_arguments(call, kv_lists, pack_gqa, sequences)
        tma, page_tiles, fit_block_k = kv_reads()
        if num_splits > 1:
            lse_strides = (lse_target.stride(0), lse_target.stride(1), lse_target.stride(3), lse_target.stride(2))
        else:
            lse_strides = (0, *lse.stride())
        args = [
            *runtime, out_target, lse_target, *out_target.stride()[:4], *lse_strides, rows,
            cache_rows, table, table.stride(0) if paged else 0, kernel_page_size,
            int(cache is not None and cache.rows is not None), cache_last,
            *flags, tma, pack_gqa, num_splits > 1, paged, page_tiles, block_d,
        ]
        key = (q.dtype, *flags, tma, pack_gqa, num_splits > 1, paged, page_tiles, block_d, decode,
               configs.length_bucket(seqlen_k), list_block_q, fit_block_k)
        return args, key

    def candidates():
        fit_block_k = kv_reads()[2]
        return configs.fit_to_problem(configs.forward_candidates(q.device, block_d, decode), rows, list_block_q, fit_block_k)

    layout = (signature, tensor_layout(cache_rows), tensor_layout(table), page_size)
    forward_launcher.launch(
        layout, [*common_tensors(call, walked, sequences), out_target, lse_target, cache_rows, table],
        build, candidates, lambda meta: (cdiv(rows, meta["BLOCK_M"]), batch * heads, num_splits),
    )
    if num_splits > 1:
        splits_block = configs.next_power_of_2(num_splits)
        total_q = q.shape[0] * q.shape[1]
        combine_launcher.launch(
            (layout, splits_block), [out_target, lse_target, out, lse],
            lambda: (
                [out_target, lse_target, out, lse, num_splits, q.shape[1], num_heads, head_dim,
                 out_target.stride(0), lse_target.stride(0), splits_block, block_d],
                (splits_block, block_d),
            ),
            configs.single_program_config, lambda meta: (total_q * num_heads,),
        )
    return out, lse


class _Plan(NamedTuple):
    """What a forward launch decides from its layout alone (memoised per layout in :data:`_PLANS`)."""

    hopper: bool  # the Gluon kernel of ``hopper/forward.py`` serves it (``dispatch.py``)
    pack_gqa: bool  # a GQA group's heads packed into one tile's rows
    rows: int  # rows of a tile's program: queries, times the group with pack_gqa
    num_splits: int  # split-KV parts


_PLANS = Memo()


def _plan(call: Call, sequences: Sequences | None, num_splits: int | None, indexed: bool, page_size: int) -> _Plan:
    q, k = call.q, call.k
    batch, seqlen_q, seqlen_k = grid_sizes(q, k, sequences)
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    group = num_heads // num_kv_heads
    walked = call.key_list if call.key_list is not None else call.kv_lists
    walk_heads = 1 if walked is None else walked.shape[1]
    # Packing a group's heads into one tile needs one walk shared by all of its rows.
    pack_gqa = (
        group > 1 and seqlen_q * group <= 64 and walk_heads in (1, num_kv_heads) and call.list_block_q == 0
        and (sequences is None or sequences.kind != SEQ_PACKED)
    )
    rows = seqlen_q * group if pack_gqa else seqlen_q
    if num_splits is None:
        programs = batch * (num_kv_heads if pack_gqa else num_heads) * cdiv(rows, 64)
        num_splits = split_count(programs, seqlen_k, q.device)
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    split = num_splits > 1 or pack_gqa
    hopper = route("forward", form_of("forward", call, sequences, split=split, indexed=indexed, page_size=page_size)) == HOPPER
    if not hopper and sequences is not None and sequences.kind == SEQ_PACKED:
        # A split is chosen from the longest sequence's size; the Hopper forward, which takes packed
        # sequences whole, needs none.
        hopper = route("forward", form_of("forward", call, sequences)) == HOPPER
    return _Plan(hopper, pack_gqa, rows, num_splits)
