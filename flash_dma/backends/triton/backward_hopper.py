"""Hopper dK/dV: the dK/dV kernel of ``backward.py`` as a warp-specialised, persistent Gluon kernel.

The Triton dK/dV kernel keeps dK and dV of 64 keys, their K and V, and the S and dP tiles in one
warpgroup's registers, and spills (``tools/compile_report.py``); its loads, products and
epilogue take turns. Here, as in FlashAttention-3's backward, the roles run side by side:

- a *loader* warp takes work items from a queue (an atomic counter: items differ widely in
  length under causal and sparse masks, so a static split would leave programs idle), walks
  each item's query tiles (``tiles.key_walk`` along the query axis, PARTIAL tiles first) and
  copies K and V once per item and Q and dO per tile with TMA. With each Q tile it stages the
  tile's number, its head and the rows' log-sum-exps and deltas in shared memory.
- two *gradient* warpgroups each own 64 of an item's 128 keys: dK and dV stay in registers
  (2 x 64 of their 240) while they compute ``S^T = K Q^T`` and ``dP^T = V dO^T`` from shared
  memory, and ``dV += P^T dO`` and ``dK += dS^T Q`` with P and dS from registers.

A work item is (key tile, query chunk, batch, key/value head); it visits every query head of the
group, so K and V are read once per item. Items are taken first key tiles first (under a causal
band they see the most queries). With several query chunks, their parts are added by fp32
atomics into zeroed scratch, which the caller converts; with one, dK and dV are written directly.

It serves the common case (``hopper_dkdv_supported``): Hopper, fp16/bf16, D = 64 or 128, no
softcap, a dense walk or a block summary, a per-key mask and bias (or none), any band, GQA, not
deterministic (its chunks add up in no fixed order). Everything else takes ``backward.py``.
"""

# No `from __future__ import annotations`: the aggregates below need their field types as objects.
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flash_dma.backends.triton import configs, tiles
from flash_dma.backends.triton.forward_hopper import (
    HEAD_DIMS,
    hopper_forward_supported,
    _Item,
    _Problem,
    _get,
    _init_barriers,
    _jit_with_runtime_scalars,
    _key_walk,
    _PLAIN,
    _load_partition,
    _put,
    _record,
    _row_statistics,
    _store_rows,
    _summary_row,
    _take_rows,
    _tile_at,
    _tile_count,
    _tile_descriptor,
    _tma_load,
    _visible_scores,
    _wait_for_scores,
    walked_keys,
)
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import (
    WALK_BLOCKS,
    WALK_DENSE,
    broadcast_strides,
    common_layout,
    diagonal_band,
    head_divisor,
    kernel_view,
    placeholder,
    tensor_layout,
    tma_aligned,
)
from flash_dma.block_mask import cdiv

# Query rows per tile (wgmma's N for S^T and dP^T) and keys per work item (64 per warpgroup).
TILE = triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=1, maxnreg=168)
_Q_STAGES = {64: 3, 128: 2}  # Q/dO tiles in flight; with two K/V buffers, D = 128 fills 192 KB
_GRADIENT_REGISTERS = gl.constexpr(240)
_LOADER_REGISTERS = gl.constexpr(24)


@_record
class _DkdvProblem:
    """What every partition reads: descriptors, pointers, strides, sizes and constexprs."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    Lse: gl.tensor
    Delta: gl.tensor
    Mask: gl.tensor
    Bias: gl.tensor
    Walk: gl.tensor
    DK: gl.tensor
    DV: gl.tensor
    ScratchK: gl.tensor
    ScratchV: gl.tensor
    DBias: gl.tensor
    Queue: gl.tensor
    stride_mb: gl.tensor
    stride_mh: gl.tensor
    stride_mk: gl.tensor
    stride_bb: gl.tensor
    stride_bh: gl.tensor
    stride_bk: gl.tensor
    stride_wb: gl.tensor
    stride_wh: gl.tensor
    stride_wr: gl.tensor
    walk_width: gl.tensor
    stride_gb: gl.tensor
    stride_gs: gl.tensor
    stride_gh: gl.tensor
    stride_dbc: gl.tensor
    stride_dbb: gl.tensor
    stride_dbh: gl.tensor
    stride_dbk: gl.tensor
    batch: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    num_heads: gl.tensor
    num_kv_heads: gl.tensor
    group: gl.tensor
    chunks: gl.tensor
    items: gl.tensor
    mask_head_div: gl.tensor
    bias_head_div: gl.tensor
    walk_head_div: gl.tensor
    dbias_head_div: gl.tensor
    list_block_q: gl.tensor
    list_block_k: gl.tensor
    band_lo: gl.tensor
    band_hi: gl.tensor
    scale: gl.tensor
    scale_log2: gl.tensor
    HAS_MASK: gl.constexpr
    HAS_BIAS: gl.constexpr
    WALK: gl.constexpr
    DBIAS: gl.constexpr
    DBIAS_ATOMIC: gl.constexpr
    DBIAS_HEAD_SHARED: gl.constexpr
    HEAD_DIM: gl.constexpr
    Q_STAGES: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr


@_record
class _DkdvBuffers:
    """Shared memory: the queue's next items (index, tile count), two K/V tiles (this item's and
    the next's), a ring of Q/dO tiles with their tile numbers, heads, LSEs and deltas, the barriers."""

    item_index: gl.shared_memory_descriptor
    item_tiles: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    tiles: gl.shared_memory_descriptor
    heads: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
    item_ready: gl.shared_memory_descriptor
    item_empty: gl.shared_memory_descriptor
    kv_ready: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor


@gluon.jit
def _column_position(p, index):
    """``(key_tile, chunk, batch, kv_head)`` of work item ``index``: key tiles from the first,
    then the chunks of one column side by side."""
    per_tile = p.chunks * p.batch * p.num_kv_heads
    rest = index % per_tile
    batch_head = rest // p.chunks
    return index // per_tile, rest % p.chunks, batch_head // p.num_kv_heads, batch_head % p.num_kv_heads


@gluon.jit
def _head_walk(p, key_tile, chunk, batch, head):
    """The query tiles that see key tile ``key_tile`` for query head ``head``, chunk ``chunk`` of
    them: ``tiles.key_walk`` along the other axis (``key - query`` in the band: ``query - key``
    in its negation), over the transposed summary."""
    k_first = key_tile * p.BLOCK_N
    walk = p.Walk + batch.to(gl.int64) * p.stride_wb + (head // p.walk_head_div).to(gl.int64) * p.stride_wh
    row_offset = _summary_row(key_tile, p.list_block_k, p.BLOCK_N).to(gl.int64) * p.stride_wr
    lists, tiles_per_block, query_limit, partial_lo, partial_hi, lo, _, _, hi = _key_walk(
        walk, p.walk_width, row_offset, p.seqlen_q, k_first, gl.minimum(k_first + p.BLOCK_N, p.seqlen_k) - 1,
        -p.band_hi, -p.band_lo, p.list_block_q, chunk, p.chunks, p.WALK, p.BLOCK_M,
    )
    return _Item(key_tile, batch, head, lists, tiles_per_block, query_limit, partial_lo, partial_hi, lo, hi)


@gluon.jit
def _item_tiles(p, key_tile, chunk, batch, kv_head):
    """Query tiles of a work item over the group's heads."""
    count = 0
    for g in range(p.group):
        count += _tile_count(_head_walk(p, key_tile, chunk, batch, kv_head * p.group + g))
    return count


@gluon.jit
def _publish(bufs, published, index, count):
    """Hand work item ``index`` (``count`` query tiles; index -1: no more) to the gradient warpgroups."""
    slot = published % 2
    mbarrier.wait(bufs.item_empty.index(slot), (published // 2) & 1 ^ 1)
    _put(bufs.item_index.index(slot), index)
    _put(bufs.item_tiles.index(slot), count)
    mbarrier.arrive(bufs.item_ready.index(slot), count=1)


@gluon.jit
def _take(bufs, taken):
    """The next work item of the queue: ``(index, count)`` as published."""
    slot = taken % 2
    mbarrier.wait(bufs.item_ready.index(slot), (taken // 2) & 1)
    index = _get(bufs.item_index.index(slot))
    count = _get(bufs.item_tiles.index(slot))
    mbarrier.arrive(bufs.item_empty.index(slot), count=1)
    return index, count


@gluon.jit
def _load_columns(p, bufs):
    """One warp: takes work items off the queue; for each, K and V, then for each query tile of
    each head its number, head, LSEs and deltas (``_row_statistics``), and Q and dO. Items without tiles are skipped when chunks add up in zeroed scratch."""
    q_bytes: gl.constexpr = 2 * p.q_desc.block_type.nbytes
    kv_bytes: gl.constexpr = 2 * p.k_desc.block_type.nbytes
    row_layout: gl.constexpr = gl.BlockedLayout([p.BLOCK_M // 32], [32], [1], [0])
    published = 0
    kv_loaded = 0
    loaded = 0  # Q/dO tiles so far: the ring position
    index = gl.atomic_add(p.Queue, 1)
    while index < p.items:
        key_tile, chunk, batch, kv_head = _column_position(p, index)
        count = _item_tiles(p, key_tile, chunk, batch, kv_head)
        if (count > 0) | (p.chunks == 1):
            _publish(bufs, published, index, count)
            published += 1
        if count > 0:
            kv = kv_loaded % 2
            mbarrier.wait(bufs.kv_empty.index(kv), (kv_loaded // 2) & 1 ^ 1)
            mbarrier.expect(bufs.kv_ready.index(kv), kv_bytes)
            _tma_load(p.k_desc, [batch, key_tile * p.BLOCK_N, kv_head, 0], bufs.kv_ready.index(kv), bufs.k.index(kv))
            _tma_load(p.v_desc, [batch, key_tile * p.BLOCK_N, kv_head, 0], bufs.kv_ready.index(kv), bufs.v.index(kv))
            kv_loaded += 1
            for g in range(p.group):
                it = _head_walk(p, key_tile, chunk, batch, kv_head * p.group + g)
                row_offset = (batch * p.num_heads + it.head).to(gl.int64) * p.seqlen_q
                for j in range(_tile_count(it)):
                    tile, _ = _tile_at(p, it, j)
                    # Read before waiting for the buffer: the loads overlap the wait.
                    lse, delta = _row_statistics(p, row_offset, tile * p.BLOCK_M + gl.arange(0, p.BLOCK_M, row_layout))
                    stage = loaded % p.Q_STAGES
                    mbarrier.wait(bufs.q_empty.index(stage), (loaded // p.Q_STAGES) & 1 ^ 1)
                    _put(bufs.tiles.index(stage), tile)
                    _put(bufs.heads.index(stage), g)
                    bufs.lse.index(stage).store(lse)
                    bufs.delta.index(stage).store(delta)
                    mbarrier.expect(bufs.q_ready.index(stage), q_bytes)
                    _tma_load(p.q_desc, [batch, tile * p.BLOCK_M, it.head, 0], bufs.q_ready.index(stage), bufs.q.index(stage))
                    _tma_load(p.do_desc, [batch, tile * p.BLOCK_M, it.head, 0], bufs.q_ready.index(stage), bufs.do.index(stage))
                    loaded += 1
        index = gl.atomic_add(p.Queue, 1)
    _publish(bufs, published, -1, 0)


@gluon.jit
def _key_scores(p, batch, head, keys):
    """Scores the keys add for query head ``head``: their bias in log2 units, -inf where the mask
    drops them or past the last key. A per-key mask is the same for every query, so applying it
    everywhere is exact (FULL tiles keep every key anyway)."""
    key_ok = keys < p.seqlen_k
    scores = gl.full(keys.shape, 0.0, gl.float32, keys.type.layout)
    b64 = batch.to(gl.int64)
    if p.HAS_BIAS:
        bias_row = p.Bias + b64 * p.stride_bb + (head // p.bias_head_div).to(gl.int64) * p.stride_bh
        scores = gl.load(bias_row + keys * p.stride_bk, mask=key_ok, other=0.0).to(gl.float32) * tiles.LOG2E
    if p.HAS_MASK:
        mask_row = p.Mask + b64 * p.stride_mb + (head // p.mask_head_div).to(gl.int64) * p.stride_mh
        key_ok = key_ok & (gl.load(mask_row + keys * p.stride_mk, mask=key_ok, other=0) != 0)
    return gl.where(key_ok, scores, float("-inf"))


@gluon.jit
def _flush_bias_gradient(p, chunk, batch, head, keys, values):
    """Write (or add, when programs share the row) a head's per-key bias gradient."""
    row = (
        p.DBias + chunk * p.stride_dbc + batch.to(gl.int64) * p.stride_dbb
        + (head // p.dbias_head_div).to(gl.int64) * p.stride_dbh
    )
    ptrs = row + keys.to(gl.int64) * p.stride_dbk
    if p.DBIAS_ATOMIC:
        gl.atomic_add(ptrs, values, mask=keys < p.seqlen_k)
    else:
        gl.store(ptrs, values, mask=keys < p.seqlen_k)


@gluon.jit
def _gradient_keys(p, bufs, HALF: gl.constexpr):
    """One warpgroup: keys ``[HALF * 64, HALF * 64 + 64)`` of every work item it takes. Tiles are
    ``[keys, queries]``."""
    KEYS: gl.constexpr = p.BLOCK_N // 2
    D: gl.constexpr = p.HEAD_DIM
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = p.q_desc.dtype

    taken = 0
    kv_taken = 0
    consumed = 0  # Q/dO tiles so far: the ring position, as in the loader
    index, count = _take(bufs, taken)
    while index >= 0:
        taken += 1
        key_tile, chunk, batch, kv_head = _column_position(p, index)
        first_key = key_tile * p.BLOCK_N + HALF * KEYS
        keys = first_key + gl.arange(0, KEYS, keys_of_s)  # [KEYS]
        dk = gl.zeros([KEYS, D], gl.float32, acc_layout)
        dv = gl.zeros([KEYS, D], gl.float32, acc_layout)
        dbias = gl.zeros([KEYS], gl.float32, keys_of_s)
        head = kv_head * p.group
        if count > 0:
            kv = kv_taken % 2
            mbarrier.wait(bufs.kv_ready.index(kv), (kv_taken // 2) & 1)
            k = bufs.k.index(kv).reshape([p.BLOCK_N, D]).slice(HALF * KEYS, KEYS)  # [KEYS, D]
            v = bufs.v.index(kv).reshape([p.BLOCK_N, D]).slice(HALF * KEYS, KEYS)
            key_scores = _key_scores(p, batch, head, keys)
            for _ in range(count):
                stage = consumed % p.Q_STAGES
                mbarrier.wait(bufs.q_ready.index(stage), (consumed // p.Q_STAGES) & 1)
                tile_head = kv_head * p.group + _get(bufs.heads.index(stage))
                if tile_head != head:  # the loader walks the group's heads in order
                    if p.DBIAS and not p.DBIAS_HEAD_SHARED:
                        _flush_bias_gradient(p, chunk, batch, head, keys, dbias)
                        dbias = gl.zeros([KEYS], gl.float32, keys_of_s)
                    head = tile_head
                    key_scores = _key_scores(p, batch, head, keys)
                q = bufs.q.index(stage).reshape([p.BLOCK_M, D])
                do = bufs.do.index(stage).reshape([p.BLOCK_M, D])
                zeros = gl.zeros([KEYS, p.BLOCK_M], gl.float32, s_layout)
                st = warpgroup_mma(k, q.permute((1, 0)), zeros, use_acc=False, is_async=True)  # [KEYS, BLOCK_M]
                dpt = warpgroup_mma(v, do.permute((1, 0)), zeros, use_acc=False, is_async=True)  # [KEYS, BLOCK_M]
                st = warpgroup_mma_wait(1, deps=[st])
                s = st * p.scale_log2 + key_scores[:, None]
                first_row = _get(bufs.tiles.index(stage)) * p.BLOCK_M
                # Only tiles that the band cuts need checks (keys past the end score -inf, rows past
                # the end have LSE +inf).
                if (first_key - first_row - p.BLOCK_M + 1 < p.band_lo) | (first_key + KEYS - 1 - first_row > p.band_hi):
                    offset = keys[:, None] - (first_row + gl.arange(0, p.BLOCK_M, rows_of_s))[None, :]
                    s = gl.where((offset >= p.band_lo) & (offset <= p.band_hi), s, float("-inf"))
                pt = gl.exp2(s - bufs.lse.index(stage).load(rows_of_s)[None, :])
                dpt = warpgroup_mma_wait(0, deps=[dpt])
                ds = pt * (dpt - bufs.delta.index(stage).load(rows_of_s)[None, :])
                if p.DBIAS:
                    dbias += gl.sum(ds, 1)
                # Both products are issued once S^T and dP^T are spent: their registers hold P^T and dS^T.
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), operand_layout), do, dv, is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds.to(dtype), operand_layout), q, dk, is_async=True)
                dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
                mbarrier.arrive(bufs.q_empty.index(stage), count=1)
                consumed += 1
            mbarrier.arrive(bufs.kv_empty.index(kv), count=1)
            kv_taken += 1
            if p.DBIAS:
                _flush_bias_gradient(p, chunk, batch, head, keys, dbias)

        dk = dk * p.scale  # dS is the gradient of scale * q.k
        out_keys = gl.convert_layout(keys, gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, D, gl.SliceLayout(0, acc_layout))
        offsets = (
            batch.to(gl.int64) * p.stride_gb + kv_head * p.stride_gh + (out_keys.to(gl.int64) * p.stride_gs)[:, None]
            + cols[None, :]
        )
        ok = (out_keys < p.seqlen_k)[:, None]
        if p.chunks == 1:
            gl.store(p.DK + offsets, dk.to(p.DK.dtype.element_ty), mask=ok)
            gl.store(p.DV + offsets, dv.to(p.DV.dtype.element_ty), mask=ok)
        else:
            gl.atomic_add(p.ScratchK + offsets, dk, mask=ok, sem="relaxed")
            gl.atomic_add(p.ScratchV + offsets, dv, mask=ok, sem="relaxed")
        index, count = _take(bufs, taken)


@gluon.jit
def _gradient_lower(p, bufs):
    _gradient_keys(p, bufs, 0)


@gluon.jit
def _gradient_upper(p, bufs):
    _gradient_keys(p, bufs, 1)


@_jit_with_runtime_scalars
def _dkdv_hopper_kernel(
    Q, K, V, DO, Lse, Delta, Mask, Bias, Walk, DK, DV, ScratchK, ScratchV, DBias, Queue,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_mh, stride_mk, stride_bb, stride_bh, stride_bk,
    stride_wb, stride_wh, stride_wr, walk_width,
    stride_gb, stride_gs, stride_gh, stride_dbc, stride_dbb, stride_dbh, stride_dbk,
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group, chunks, items,
    mask_head_div, bias_head_div, walk_head_div, dbias_head_div, list_block_q, list_block_k,
    band_lo, band_hi, scale, scale_log2,
    HAS_MASK: gl.constexpr, HAS_BIAS: gl.constexpr, WALK: gl.constexpr,
    DBIAS: gl.constexpr, DBIAS_ATOMIC: gl.constexpr, DBIAS_HEAD_SHARED: gl.constexpr,
    HEAD_DIM: gl.constexpr, Q_STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
):
    # Descriptors of the whole [B, S, heads, D] tensors, made once per (persistent) program.
    q_desc = _tile_descriptor(Q, batch, seqlen_q, num_heads, stride_qb, stride_qs, stride_qh, BLOCK_M, BLOCK_M, HEAD_DIM)
    do_desc = _tile_descriptor(DO, batch, seqlen_q, num_heads, stride_dob, stride_dos, stride_doh, BLOCK_M, BLOCK_M, HEAD_DIM)
    k_desc = _tile_descriptor(K, batch, seqlen_k, num_kv_heads, stride_kb, stride_ks, stride_kh, BLOCK_N, BLOCK_N, HEAD_DIM)
    v_desc = _tile_descriptor(V, batch, seqlen_k, num_kv_heads, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_N, HEAD_DIM)
    barrier: gl.constexpr = mbarrier.MBarrierLayout()
    bufs = _DkdvBuffers(
        gl.allocate_shared_memory(gl.int32, [2, 1], _PLAIN),
        gl.allocate_shared_memory(gl.int32, [2, 1], _PLAIN),
        gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout),
        gl.allocate_shared_memory(q_desc.dtype, [Q_STAGES] + q_desc.block_type.shape, q_desc.layout),
        gl.allocate_shared_memory(do_desc.dtype, [Q_STAGES] + do_desc.block_type.shape, do_desc.layout),
        gl.allocate_shared_memory(gl.int32, [Q_STAGES, 1], _PLAIN),
        gl.allocate_shared_memory(gl.int32, [Q_STAGES, 1], _PLAIN),
        gl.allocate_shared_memory(gl.float32, [Q_STAGES, BLOCK_M], _PLAIN),
        gl.allocate_shared_memory(gl.float32, [Q_STAGES, BLOCK_M], _PLAIN),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], barrier),
    )
    for i in gl.static_range(2):
        mbarrier.init(bufs.item_ready.index(i), count=1)
        mbarrier.init(bufs.item_empty.index(i), count=2)  # both gradient warpgroups release it
        mbarrier.init(bufs.kv_ready.index(i), count=1)
        mbarrier.init(bufs.kv_empty.index(i), count=2)
    for i in gl.static_range(Q_STAGES):
        mbarrier.init(bufs.q_ready.index(i), count=1)
        mbarrier.init(bufs.q_empty.index(i), count=2)
    p = _DkdvProblem(
        q_desc, k_desc, v_desc, do_desc, Lse, Delta, Mask, Bias, Walk, DK, DV, ScratchK, ScratchV, DBias, Queue,
        stride_mb, stride_mh, stride_mk, stride_bb, stride_bh, stride_bk, stride_wb, stride_wh, stride_wr, walk_width,
        stride_gb, stride_gs, stride_gh, stride_dbc, stride_dbb, stride_dbh, stride_dbk,
        batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group, chunks, items,
        mask_head_div, bias_head_div, walk_head_div, dbias_head_div, list_block_q, list_block_k,
        band_lo, band_hi, scale, scale_log2,
        HAS_MASK, HAS_BIAS, WALK, DBIAS, DBIAS_ATOMIC, DBIAS_HEAD_SHARED, HEAD_DIM, Q_STAGES, BLOCK_M, BLOCK_N,
    )
    gl.warp_specialize(
        [(_gradient_lower, (p, bufs)), (_gradient_upper, (p, bufs)), (_load_columns, (p, bufs))],
        [4, 1], [_GRADIENT_REGISTERS, _LOADER_REGISTERS],
    )


@_record
class _DqBuffers:
    """Shared memory as in the forward (``forward_hopper._Buffers``), plus dO and each item's LSEs
    and deltas. The dQ kernel's problem is the forward's ``_Problem``, its output in ``Out``."""

    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    counts: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
    spans: gl.shared_memory_descriptor
    positions: gl.shared_memory_descriptor
    key_scores: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor


@gluon.jit
def _dq_rows(p, bufs, HALF: gl.constexpr):
    """One warpgroup: rows ``[HALF * 64, HALF * 64 + 64)`` of every work item of this program
    (the forward's items and walk). Per key tile: ``S = Q K^T`` and ``dP = dO V^T`` from shared
    memory, ``dQ += dS K`` with dS from registers."""
    ROWS: gl.constexpr = p.BLOCK_M // 2
    D: gl.constexpr = p.HEAD_DIM
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = p.q_desc.dtype
    # Staged key scores are read while the two products run (ptxas issues the loads between them),
    # not after S is waited for: up to 3% off the backward with a bias (docs/benchmarks.md,
    # "Backward profile"). Without key scores there is nothing to read early.
    READ_KEYS_EARLY: gl.constexpr = p.HAS_BIAS or p.HAS_MASK or p.WALK == tiles.WALK_KEYS

    consumed = 0  # K/V tiles so far: the ring position, as in the loader
    items_done = 0
    for index in range(gl.program_id(0), p.items, gl.num_programs(0)):
        batch, head, first_row, rows, q_slot, count = _take_rows(p, bufs, index, items_done, HALF, rows_of_s)
        q = bufs.q.index(q_slot).reshape([p.BLOCK_M, D]).slice(HALF * ROWS, ROWS)  # [ROWS, D]
        do = bufs.do.index(q_slot).reshape([p.BLOCK_M, D]).slice(HALF * ROWS, ROWS)
        lse2 = bufs.lse.index(q_slot).slice(HALF * ROWS, ROWS).load(rows_of_s)  # [ROWS]
        delta = bufs.delta.index(q_slot).slice(HALF * ROWS, ROWS).load(rows_of_s)
        dq = gl.zeros([ROWS, D], gl.float32, acc_layout)
        for _ in range(count):
            stage = consumed % p.KV_STAGES
            phase = (consumed // p.KV_STAGES) & 1
            zeros = gl.zeros([ROWS, p.BLOCK_N], gl.float32, s_layout)
            mbarrier.wait(bufs.k_ready.index(stage), phase)
            k = bufs.k.index(stage).reshape([p.BLOCK_N, D])
            qk = warpgroup_mma(q, k.permute((1, 0)), zeros, use_acc=False, is_async=True)  # [ROWS, BLOCK_N]
            mbarrier.wait(bufs.v_ready.index(stage), phase)
            dp = warpgroup_mma(do, bufs.v.index(stage).reshape([p.BLOCK_N, D]).permute((1, 0)), zeros, use_acc=False, is_async=True)
            qk, staged = _wait_for_scores(p, bufs, qk, 1, stage, keys_of_s, READ_KEYS_EARLY)
            s = _visible_scores(p, bufs, qk, staged, stage, first_row, rows, keys_of_s, ROWS)  # [ROWS, BLOCK_N]
            probs = gl.exp2(s - lse2[:, None])
            dp = warpgroup_mma_wait(0, deps=[dp])
            mbarrier.arrive(bufs.v_empty.index(stage), count=1)
            ds = probs * (dp - delta[:, None])
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), operand_layout), k, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq])
            mbarrier.arrive(bufs.k_empty.index(stage), count=1)
            consumed += 1
        _store_rows(p, bufs, q_slot, HALF, batch, first_row, head, dq * p.scale)  # dS is the gradient of scale * q.k
        items_done += 1


@gluon.jit
def _dq_lower(p, bufs):
    _dq_rows(p, bufs, 0)


@gluon.jit
def _dq_upper(p, bufs):
    _dq_rows(p, bufs, 1)


@_jit_with_runtime_scalars
def _dq_hopper_kernel(
    Q, K, V, DO, Lse, Delta, Mask, Bias, Walk, DQ,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh,
    stride_mb, stride_mh, stride_mk, stride_bb, stride_bh, stride_bk,
    stride_wb, stride_wh, stride_wr, walk_width,
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group, items, row_blocks,
    mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
    band_lo, band_hi, scale, scale_log2,
    HAS_MASK: gl.constexpr, HAS_BIAS: gl.constexpr, WALK: gl.constexpr, HEAD_DIM: gl.constexpr, KV_STAGES: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
):
    q_desc = _tile_descriptor(Q, batch, seqlen_q, num_heads, stride_qb, stride_qs, stride_qh, BLOCK_M, BLOCK_M, HEAD_DIM)
    do_desc = _tile_descriptor(DO, batch, seqlen_q, num_heads, stride_dob, stride_dos, stride_doh, BLOCK_M, BLOCK_M, HEAD_DIM)
    dq_desc = _tile_descriptor(DQ, batch, seqlen_q, num_heads, stride_dqb, stride_dqs, stride_dqh, BLOCK_M // 2, BLOCK_M, HEAD_DIM)
    k_desc = _tile_descriptor(K, batch, seqlen_k, num_kv_heads, stride_kb, stride_ks, stride_kh, BLOCK_N, BLOCK_N, HEAD_DIM)
    v_desc = _tile_descriptor(V, batch, seqlen_k, num_kv_heads, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_N, HEAD_DIM)
    barrier: gl.constexpr = mbarrier.MBarrierLayout()
    bufs = _DqBuffers(
        gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout),
        gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout),
        gl.allocate_shared_memory(k_desc.dtype, [KV_STAGES] + k_desc.block_type.shape, k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [KV_STAGES] + v_desc.block_type.shape, v_desc.layout),
        gl.allocate_shared_memory(gl.int32, [2, 1], _PLAIN),
        gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], _PLAIN),
        gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], _PLAIN),
        gl.allocate_shared_memory(gl.int32, [2 * KV_STAGES, 1], _PLAIN),
        gl.allocate_shared_memory(gl.int32, [KV_STAGES, BLOCK_N], _PLAIN),
        gl.allocate_shared_memory(gl.float32, [KV_STAGES, BLOCK_N], _PLAIN),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
    )
    _init_barriers(bufs, KV_STAGES)
    p = _Problem(
        q_desc, k_desc, v_desc, do_desc, dq_desc, DQ, Delta, Lse, Mask, Bias, Walk, stride_dqb, stride_dqs, stride_dqh,
        seqlen_q * num_heads, seqlen_q, stride_mb, stride_mh, stride_mk, stride_bb, stride_bh, stride_bk, stride_wb, stride_wh, stride_wr, walk_width,
        seqlen_q, seqlen_k, num_heads, group, items, row_blocks,
        mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
        band_lo, band_hi, scale, scale_log2,
        HAS_MASK, HAS_BIAS, WALK, HEAD_DIM, KV_STAGES, BLOCK_M, BLOCK_N, True,
    )
    gl.warp_specialize(
        [(_dq_lower, (p, bufs)), (_dq_upper, (p, bufs)), (_load_partition, (p, bufs))],
        [4, 1], [_GRADIENT_REGISTERS, _LOADER_REGISTERS],
    )


def hopper_dkdv_supported(q, k, v, dout, lse, mask, bias, key_list, list_block_q, list_block_k, softcap, deterministic) -> bool:
    """Whether ``hopper_dkdv`` serves this plain (not varlen) backward."""
    if os.environ.get("FLASH_DMA_HOPPER", "1") == "0" or configs.triton_interpreting() or not configs.is_hopper(q.device):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or deterministic:
        return False
    if q.shape[3] not in HEAD_DIMS or key_list is not None or softcap > 0:
        return False
    if (mask is not None and mask.shape[2] != 1) or (bias is not None and bias.shape[2] != 1):
        return False
    if list_block_q % TILE.kwargs["BLOCK_M"] or list_block_k % TILE.kwargs["BLOCK_N"] or q.numel() == 0 or k.numel() == 0:
        return False
    return lse.is_contiguous() and tma_aligned(q, k, v, dout)


hopper_dkdv_launcher = Launcher(
    _dkdv_hopper_kernel,
    tensors=("Q", "K", "V", "DO", "Lse", "Delta", "Mask", "Bias", "Walk", "DK", "DV", "ScratchK", "ScratchV", "DBias", "Queue"),
    specialized=(),
)


def hopper_dkdv(
    q, k, v, dout, lse, delta, mask, bias, q_lists, list_block_q, list_block_k, softmax_scale, window_left, window_right,
    dk, dv, dbias_acc, dbias_flags, chunks,
) -> None:
    """Write ``dk`` and ``dv`` ``[B, Sk, Hkv, D]`` (and the per-key bias gradient into ``dbias_acc``,
    ``[chunks, Bd, Hd, 1, Sk]`` float32, zeroed), as ``backward._launch_dkdv`` would.

    q, dout: ``[B, Sq, H, D]``; k, v: ``[B, Sk, Hkv, D]``; lse, delta: ``[B, H, Sq]`` float32,
    contiguous; mask, bias: per key, ``[1|B, 1|Hkv|H, 1, Sk]`` or None; q_lists: the transposed
    summary, or None. ``dbias_flags`` is ``(kind, atomic, head_shared)`` of
    ``backward.bias_gradient_buffer``; ``chunks`` splits each key tile's queries.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    device = q.device
    items = chunks * cdiv(seqlen_k, TILE.kwargs["BLOCK_N"]) * batch * num_kv_heads
    scratch_k = scratch_v = placeholder(device, torch.float32)
    if chunks > 1:
        scratch_k = torch.zeros(dk.shape, dtype=torch.float32, device=device)
        scratch_v = torch.zeros(dv.shape, dtype=torch.float32, device=device)
    queue = torch.zeros(1, dtype=torch.int32, device=device)
    dbias_slice = None if dbias_acc is None else dbias_acc[0]
    tensors = [
        q, k, v, dout, lse, delta, placeholder(device, torch.uint8) if mask is None else kernel_view(mask),
        placeholder(device, q.dtype) if bias is None else bias, placeholder(device, torch.int32) if q_lists is None else q_lists,
        dk, dv, scratch_k, scratch_v, placeholder(device, torch.float32) if dbias_acc is None else dbias_acc, queue,
    ]

    def build():
        mask_strides, bias_strides, dbias_strides = broadcast_strides(mask), broadcast_strides(bias), broadcast_strides(dbias_slice)
        flags = (
            mask is not None, bias is not None, WALK_DENSE if q_lists is None else WALK_BLOCKS, *dbias_flags,
            head_dim, _Q_STAGES[head_dim],
        )
        args = [
            *tensors, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
            mask_strides[0], mask_strides[1], mask_strides[3], bias_strides[0], bias_strides[1], bias_strides[3],
            *broadcast_strides(q_lists)[:3], 0 if q_lists is None else q_lists.shape[-1],
            *dk.stride()[:3], 0 if dbias_acc is None or dbias_acc.shape[0] == 1 else dbias_acc.stride(0),
            dbias_strides[0], dbias_strides[1], dbias_strides[3],
            batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, num_heads // num_kv_heads, chunks, items,
            head_divisor(mask, num_heads), head_divisor(bias, num_heads), head_divisor(q_lists, num_heads),
            head_divisor(dbias_slice, num_heads), list_block_q, list_block_k,
            *diagonal_band(window_left, window_right, seqlen_q, seqlen_k), softmax_scale, softmax_scale * tiles.LOG2E.value,
            *flags,
        ]
        return args, (q.dtype, dk.dtype, *flags)

    layout = (
        common_layout(q, k, v, mask, bias, q_lists, None), dout.stride(), tensor_layout(dk), tensor_layout(dbias_acc),
        list_block_q, list_block_k, softmax_scale, window_left, window_right, chunks, dbias_flags,
    )
    hopper_dkdv_launcher.launch(
        layout, tensors, build, lambda: [TILE], lambda meta: (min(items, configs.multiprocessor_count(device)),),
    )
    if chunks > 1:
        dk.copy_(scratch_k)
        dv.copy_(scratch_v)


DQ_TILE = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=1, maxnreg=168)
_DQ_KV_STAGES = {64: 3, 128: 2}  # with two Q/dO buffers, D = 128 fills 192 KB


def hopper_dq_supported(q, k, v, dout, lse, mask, bias, kv_lists, key_list, list_block_q, list_block_k, softcap) -> bool:
    """Whether ``hopper_dq`` serves this plain (not varlen) backward: what the Hopper forward serves."""
    return (
        hopper_forward_supported(q, k, v, mask, bias, kv_lists, key_list, list_block_q, list_block_k, softcap)
        and lse.is_contiguous() and tma_aligned(dout)
    )


hopper_dq_launcher = Launcher(
    _dq_hopper_kernel, tensors=("Q", "K", "V", "DO", "Lse", "Delta", "Mask", "Bias", "Walk", "DQ"), specialized=(),
)


def hopper_dq(
    q, k, v, dout, lse, delta, mask, bias, kv_lists, key_list, list_block_q, list_block_k, softmax_scale, window_left,
    window_right, dq,
) -> None:
    """Write ``dq`` ``[B, Sq, H, D]`` as the Triton dQ kernel would; arguments as for ``hopper_dkdv``,
    with ``kv_lists`` or ``key_list`` what the forward walks."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    row_blocks = cdiv(seqlen_q, DQ_TILE.kwargs["BLOCK_M"])
    items = row_blocks * batch * num_heads
    k, v, walk, walk_flag = walked_keys(k, v, kv_lists, key_list)
    tensors = [
        q, k, v, dout, lse, delta, placeholder(q.device, torch.uint8) if mask is None else kernel_view(mask),
        placeholder(q.device, q.dtype) if bias is None else bias,
        placeholder(q.device, torch.int32) if walk is None else walk, dq,
    ]

    def build():
        mask_strides, bias_strides = broadcast_strides(mask), broadcast_strides(bias)
        flags = (mask is not None, bias is not None, walk_flag, head_dim, _DQ_KV_STAGES[head_dim])
        args = [
            *tensors, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3],
            mask_strides[0], mask_strides[1], mask_strides[3], bias_strides[0], bias_strides[1], bias_strides[3],
            *broadcast_strides(walk)[:3], 0 if walk is None else walk.shape[-1],
            batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, num_heads // num_kv_heads, items, row_blocks,
            head_divisor(mask, num_heads), head_divisor(bias, num_heads), head_divisor(walk, num_heads),
            list_block_q, list_block_k, *diagonal_band(window_left, window_right, seqlen_q, seqlen_k),
            softmax_scale, softmax_scale * tiles.LOG2E.value, *flags,
        ]
        return args, (q.dtype, dq.dtype, *flags)

    layout = (
        common_layout(q, k, v, mask, bias, walk, None), dout.stride(), tensor_layout(dq), list_block_q, list_block_k,
        softmax_scale, window_left, window_right,
    )
    hopper_dq_launcher.launch(
        layout, tensors, build, lambda: [DQ_TILE], lambda meta: (min(items, configs.multiprocessor_count(q.device)),),
    )
