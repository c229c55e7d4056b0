"""Hopper forward: the forward kernel of ``forward.py`` as a warp-specialised, persistent Gluon kernel.

On sm90 the plain Triton forward keeps one 8-warp program per multiprocessor whose loads, math
and epilogue take turns: measured, 8.8 us of fixed cost per program and 2.44 us per 128 x 128
tile (docs/benchmarks.md), so a query block with a short tile list spends a third of its time
waiting. Here the roles run side by side, as in FlashAttention-3:

- a *loader* warp walks each work item's tile list (the walk of ``tiles.key_walk``, PARTIAL
  tiles first) and copies Q, K and V with TMA into shared-memory rings, running ahead across
  work items. It alone reads the walk, the mask and the bias: with each K tile it stages the
  span of its keys' positions and their scores (bias in log2 units, -inf where the mask drops
  a key).
- two *softmax* warpgroups each own 64 of a work item's 128 query rows. They issue the next
  tile's ``S = Q K^T`` before this tile's softmax, so that ``O += P V`` runs during it, check
  only the tiles that the band or the end of the keys cuts, and write the output and LSE.

The grid is persistent: one program per multiprocessor takes work items (row block, batch,
head) in turn, the last row blocks first (under a causal band they hold the most tiles).

It serves the prefill/training forward of the common case (``hopper_forward_supported``): Hopper,
fp16/bf16, D = 64 or 128, a dense walk, a block summary with per-key mask and bias (or none), or
a key list, any causal/window band, GQA. A key list's kept keys are gathered once per call
(``key_list.gather_kept_keys``), so that TMA copies whole tiles of them; the loader then also
stages each tile's key positions, for the band checks. Everything else takes ``forward.py``.
Outputs are those of ``forward.attention_forward``, so the backward is shared.
"""

# No `from __future__ import annotations`: the aggregates below need their field types as objects.
import inspect
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from flash_dma.backends.triton import configs, tiles
from flash_dma.backends.triton.key_list import gather_kept_keys
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import (
    WALK_KEYS,
    broadcast_strides,
    common_layout,
    diagonal_band,
    head_divisor,
    kernel_view,
    placeholder,
    tensor_layout,
    tma_aligned,
    walk_kind,
)
from flash_dma.block_mask import cdiv

# The walk's index arithmetic is shared with the Triton kernels: scalar code runs as Gluon as is.
_key_walk = gluon.jit(tiles.key_walk.fn)
_summary_row = gluon.jit(tiles.summary_row.fn)
_summary_list = gluon.jit(tiles.summary_list.fn)
_tile_start = gluon.jit(tiles.tile_start.fn)
# Triton 3.9 renamed the TMA copies (and refuses the old names).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# Query rows per work item (64 per softmax warpgroup: wgmma's M) and keys per tile.
TILE = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=4, num_stages=1, maxnreg=168)
HEAD_DIMS = (64, 128)
_KV_STAGES = {64: 3, 128: 2}  # K/V tiles in flight; with two Q buffers, D = 128 fills 192 KB of shared memory
# Registers per thread: each softmax warpgroup 240, the loader 24 (setmaxnreg); the kernel
# starts with TILE.maxnreg over its 3 warpgroups, and 2 x 128 x 240 + 128 x 24 <= 168 x 384.
_SOFTMAX_REGISTERS = gl.constexpr(240)
_LOADER_REGISTERS = gl.constexpr(24)
_PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # rows of small shared arrays


def _record(cls):
    """Triton's ``aggregate`` with a constructor that takes the fields in order (Triton 3.6 wants
    one written out; later versions make the same one)."""
    fields = dict(cls.__annotations__)

    def __init__(self, *values):
        for name, value in zip(fields, values, strict=True):
            setattr(self, name, gl.constexpr(value) if fields[name] is gl.constexpr else value)

    cls.__init__ = gluon.constexpr_function(__init__)
    record = aggregate(cls)
    record.fields = fields
    return record


@_record
class _Problem:
    """What every partition reads: descriptors, pointers, strides, sizes and constexprs. The
    Hopper dQ kernel (``backward_hopper.py``) fills it too: its output is ``Out`` (``o_desc``
    the descriptor of it, of one warpgroup's rows), and with GRADIENT its loader also reads
    ``do_desc`` and ``Delta``."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    o_desc: tma.tensor_descriptor
    Out: gl.tensor
    Delta: gl.tensor
    Lse: gl.tensor
    Mask: gl.tensor
    Bias: gl.tensor
    Walk: gl.tensor
    stride_ob: gl.tensor
    stride_os: gl.tensor
    stride_oh: gl.tensor
    stride_lse_b: gl.tensor
    stride_lse_h: gl.tensor
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
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    num_heads: gl.tensor
    group: gl.tensor
    items: gl.tensor
    row_blocks: gl.tensor
    mask_head_div: gl.tensor
    bias_head_div: gl.tensor
    walk_head_div: gl.tensor
    list_block_q: gl.tensor
    list_block_k: gl.tensor
    band_lo: gl.tensor
    band_hi: gl.tensor
    scale: gl.tensor
    scale_log2: gl.tensor
    HAS_MASK: gl.constexpr
    HAS_BIAS: gl.constexpr
    WALK: gl.constexpr
    HEAD_DIM: gl.constexpr
    KV_STAGES: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    GRADIENT: gl.constexpr


@_record
class _Buffers:
    """Shared memory: two Q tiles (this item's and the next's) with their tile counts, a ring of
    K/V tiles with the spans and (key lists) positions of their keys and their key scores (bias,
    -inf where masked), the barriers. Only the loader reads the walk, mask and bias in global memory."""

    q: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    counts: gl.shared_memory_descriptor
    spans: gl.shared_memory_descriptor
    positions: gl.shared_memory_descriptor
    key_scores: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor


@_record
class _Item:
    """One work item: a row block of one (batch, head), and where its key tiles lie in its walk
    (``tiles.key_walk``): PARTIAL tiles at positions ``[partial_lo, partial_hi)`` of the summary's
    PARTIAL list, the others at ``[lo, hi)`` of the FULL list (or of every tile, dense, or of the
    key list's first ``key_limit`` slots)."""

    row_block: gl.tensor
    batch: gl.tensor
    head: gl.tensor
    lists: gl.tensor
    tiles_per_block: gl.tensor
    key_limit: gl.tensor
    partial_lo: gl.tensor
    partial_hi: gl.tensor
    lo: gl.tensor
    hi: gl.tensor


@gluon.jit
def _item_position(p, index):
    """``(row_block, batch, head)`` of work item ``index``: row blocks from the last, (batch, head) fastest."""
    batch_heads = p.items // p.row_blocks
    return p.row_blocks - 1 - index // batch_heads, (index % batch_heads) // p.num_heads, index % p.num_heads


@gluon.jit
def _take_rows(p, bufs, index, items_done, HALF: gl.constexpr, rows_layout: gl.constexpr):
    """Work item ``index`` for warpgroup ``HALF``, once the loader has staged its Q (slot
    ``items_done % 2``): ``(batch, head, first_row, rows, q_slot, count)``, ``rows`` its 64 rows
    in ``rows_layout`` and ``count`` its key tiles."""
    ROWS: gl.constexpr = p.BLOCK_M // 2
    row_block, batch, head = _item_position(p, index)
    first_row = row_block * p.BLOCK_M + HALF * ROWS
    rows = first_row + gl.arange(0, ROWS, rows_layout)  # [ROWS]
    q_slot = items_done % 2
    mbarrier.wait(bufs.q_ready.index(q_slot), (items_done // 2) & 1)
    return batch, head, first_row, rows, q_slot, _get(bufs.counts.index(q_slot))


@gluon.jit
def _store_rows(p, bufs, q_slot, HALF: gl.constexpr, batch, first_row, head, values):
    """A warpgroup's output rows, ``values`` ``[ROWS, D]`` from ``first_row`` on, into ``p.Out``
    ``[B, Sq, H, D]`` (rows past Sq are clipped), then its half of Q slot ``q_slot`` released.

    They leave through that half of the Q tile, whose last product is done, and a TMA store:
    stored from registers, the rows took about 4 us per work item at D = 128, a fifth of a
    16K keep-1/8 item. The loader refills the slot once the store has read it.
    """
    ROWS: gl.constexpr = p.BLOCK_M // 2
    if p.Out.dtype.element_ty == p.q_desc.dtype:
        q_tile = bufs.q.index(q_slot)  # [1, BLOCK_M, 1, D]
        q_tile.reshape([p.BLOCK_M, p.HEAD_DIM]).slice(HALF * ROWS, ROWS).store(values.to(p.q_desc.dtype))
        fence_async_shared()
        _tma_store(p.o_desc, [batch, first_row, head, 0], q_tile.slice(HALF * ROWS, ROWS, dim=1))
        tma.store_wait(0)
    else:  # float32 (a dQ summed over several calls): too wide for Q's tile
        layout: gl.constexpr = values.type.layout
        rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
        cols = gl.arange(0, p.HEAD_DIM, gl.SliceLayout(0, layout))
        ptrs = (
            p.Out + batch.to(gl.int64) * p.stride_ob + head.to(gl.int64) * p.stride_oh
            + (rows.to(gl.int64) * p.stride_os)[:, None] + cols[None, :]
        )
        gl.store(ptrs, values.to(p.Out.dtype.element_ty), mask=(rows < p.seqlen_q)[:, None])
    mbarrier.arrive(bufs.q_empty.index(q_slot), count=1)


@gluon.jit
def _item(p, index):
    """Work item ``index`` and its walk (the Triton forward's ``tiles.key_walk``, one split)."""
    row_block, batch, head = _item_position(p, index)
    q_lo = row_block * p.BLOCK_M
    walk = p.Walk + batch.to(gl.int64) * p.stride_wb + (head // p.walk_head_div).to(gl.int64) * p.stride_wh
    row_offset = _summary_row(row_block, p.list_block_q, p.BLOCK_M).to(gl.int64) * p.stride_wr
    lists, tiles_per_block, key_limit, partial_lo, partial_hi, lo, _, _, hi = _key_walk(
        walk, p.walk_width, row_offset, p.seqlen_k, q_lo, gl.minimum(q_lo + p.BLOCK_M, p.seqlen_q) - 1,
        p.band_lo, p.band_hi, p.list_block_k, 0, 1, p.WALK, p.BLOCK_N,
    )
    return _Item(row_block, batch, head, lists, tiles_per_block, key_limit, partial_lo, partial_hi, lo, hi)


@gluon.jit
def _tile_count(it):
    return (it.partial_hi - it.partial_lo) + (it.hi - it.lo)


@gluon.jit
def _tile_at(p, it, j):
    """The j-th key tile of a work item, PARTIAL ones first: ``(tile, partial)``."""
    partials = it.partial_hi - it.partial_lo
    partial = j < partials
    position = gl.where(partial, it.partial_lo + j, it.lo + j - partials)
    tile = position
    if p.WALK == tiles.WALK_BLOCKS:
        tile = _tile_start(_summary_list(it.lists, p.walk_width, partial == 0, 0), position, it.tiles_per_block, p.WALK)
    return tile, partial


@gluon.jit
def _put(slot, value):
    """Store scalar ``value`` in a one-element shared slot."""
    slot.store(gl.full([1], value, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))


@gluon.jit
def _get(slot):
    """The scalar in a one-element shared slot."""
    return gl.max(slot.load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), 0)


@gluon.jit
def _load_key_tile(p, bufs, it, j, loaded, bias_row, mask_row, kv_head):
    """The j-th key tile of work item ``it`` into ring position ``loaded``: the span of its keys'
    positions (with a key list also the positions), its key scores (bias in log2 units, -inf for
    keys masked out or past the end), K and V."""
    KEYS: gl.constexpr = p.WALK == tiles.WALK_KEYS
    SCORED: gl.constexpr = p.HAS_BIAS or p.HAS_MASK or KEYS
    key_layout: gl.constexpr = gl.BlockedLayout([p.BLOCK_N // 32], [32], [1], [0])
    tile, partial = _tile_at(p, it, j)
    first_key = tile * p.BLOCK_N
    if SCORED:  # read before waiting for the buffer: the loads overlap the wait
        keys = first_key + gl.arange(0, p.BLOCK_N, key_layout)  # [BLOCK_N]
        key_ok = keys < p.seqlen_k
        if KEYS:  # slots of the key list: kept positions (ascending) up to its kept count
            key_ok = keys < it.key_limit
            keys = gl.load(it.lists + keys, mask=key_ok, other=0)
            first_key = gl.min(gl.where(key_ok, keys, p.seqlen_k), 0)
        scores = gl.full([p.BLOCK_N], 0.0, gl.float32, key_layout)
        if p.HAS_BIAS:
            scores = gl.load(bias_row + keys * p.stride_bk, mask=key_ok, other=0.0).to(gl.float32) * tiles.LOG2E
        if p.HAS_MASK:
            key_ok = key_ok & (gl.load(mask_row + keys * p.stride_mk, mask=key_ok & partial, other=1) != 0)
        scores = gl.where(key_ok, scores, float("-inf"))
    stage = loaded % p.KV_STAGES
    phase = (loaded // p.KV_STAGES) & 1 ^ 1
    # K (with the tile's number and key scores) and V have rings of their own: K is free once
    # S = Q K^T is done, a tile before V.
    kv_bytes: gl.constexpr = p.k_desc.block_type.nbytes
    mbarrier.wait(bufs.k_empty.index(stage), phase)
    # The span of the tile's key positions: a key list's first and last kept ones, else the tile number.
    _put(bufs.spans.index(stage), first_key if KEYS else tile)
    if KEYS:
        _put(bufs.spans.index(p.KV_STAGES + stage), gl.max(keys, 0))
        bufs.positions.index(stage).store(keys)
    if SCORED:
        bufs.key_scores.index(stage).store(scores)
    mbarrier.expect(bufs.k_ready.index(stage), kv_bytes)
    _tma_load(p.k_desc, [it.batch, tile * p.BLOCK_N, kv_head, 0], bufs.k_ready.index(stage), bufs.k.index(stage))
    mbarrier.wait(bufs.v_empty.index(stage), phase)
    mbarrier.expect(bufs.v_ready.index(stage), kv_bytes)
    _tma_load(p.v_desc, [it.batch, tile * p.BLOCK_N, kv_head, 0], bufs.v_ready.index(stage), bufs.v.index(stage))


@gluon.jit
def _load_partition(p, bufs):
    """One warp: for each work item its tile count and Q (with GRADIENT also dO, and the rows'
    LSEs in log2 units and deltas), then its key tiles (``_load_key_tile``)."""
    q_bytes: gl.constexpr = p.q_desc.block_type.nbytes * (2 if p.GRADIENT else 1)
    row_layout: gl.constexpr = gl.BlockedLayout([p.BLOCK_M // 32], [32], [1], [0])
    loaded = 0  # K/V tiles so far: the ring position
    items_done = 0
    for index in range(gl.program_id(0), p.items, gl.num_programs(0)):
        it = _item(p, index)
        b64 = it.batch.to(gl.int64)
        bias_row = p.Bias + b64 * p.stride_bb + (it.head // p.bias_head_div).to(gl.int64) * p.stride_bh
        mask_row = p.Mask + b64 * p.stride_mb + (it.head // p.mask_head_div).to(gl.int64) * p.stride_mh
        count = _tile_count(it)
        q_slot = items_done % 2
        if p.GRADIENT:
            rows = it.row_block * p.BLOCK_M + gl.arange(0, p.BLOCK_M, row_layout)  # [BLOCK_M]
            row_offset = (it.batch * p.num_heads + it.head).to(gl.int64) * p.seqlen_q
            lse, delta = _row_statistics(p, row_offset, rows)
        mbarrier.wait(bufs.q_empty.index(q_slot), (items_done // 2) & 1 ^ 1)
        _put(bufs.counts.index(q_slot), count)
        if p.GRADIENT:
            bufs.lse.index(q_slot).store(lse)
            bufs.delta.index(q_slot).store(delta)
        mbarrier.expect(bufs.q_ready.index(q_slot), q_bytes)
        row_tile = [it.batch, it.row_block * p.BLOCK_M, it.head, 0]
        _tma_load(p.q_desc, row_tile, bufs.q_ready.index(q_slot), bufs.q.index(q_slot))
        if p.GRADIENT:
            _tma_load(p.do_desc, row_tile, bufs.q_ready.index(q_slot), bufs.do.index(q_slot))
        kv_head = it.head // p.group
        for j in range(count):
            _load_key_tile(p, bufs, it, j, loaded, bias_row, mask_row, kv_head)
            loaded += 1
        items_done += 1


@gluon.jit
def _row_statistics(p, row_offset, rows):
    """LSEs (log2 units; +inf for rows that see no key, or past the end: their gradients are 0)
    and deltas of query rows ``rows`` of one (batch, head), for the backward kernels."""
    row_ok = rows < p.seqlen_q
    lse = gl.load(p.Lse + row_offset + rows, mask=row_ok, other=float("inf"))
    lse = gl.where(lse == float("-inf"), float("inf"), lse) * tiles.LOG2E
    return lse, gl.load(p.Delta + row_offset + rows, mask=row_ok, other=0.0)


@gluon.jit
def _staged_keys(p, bufs, stage, keys_layout: gl.constexpr):
    """What the loader staged with the K tile at ring position ``stage``: ``(first_key, last_key,
    key_scores)``, the span of its key positions and its key scores ``[BLOCK_N]``."""
    KEYS: gl.constexpr = p.WALK == tiles.WALK_KEYS
    if KEYS:
        first_key = _get(bufs.spans.index(stage))
        last_key = _get(bufs.spans.index(p.KV_STAGES + stage))
    else:  # the tile's own BLOCK_N keys
        first_key = _get(bufs.spans.index(stage)) * p.BLOCK_N
        last_key = first_key + p.BLOCK_N - 1
    key_scores = gl.zeros([p.BLOCK_N], gl.float32, keys_layout)  # unread where there are none
    if p.HAS_BIAS or p.HAS_MASK or KEYS:
        key_scores = bufs.key_scores.index(stage).load(keys_layout)
    return first_key, last_key, key_scores


@gluon.jit
def _wait_for_scores(p, bufs, qk, pending: gl.constexpr, stage, keys_layout: gl.constexpr, READ_KEYS_EARLY: gl.constexpr):
    """Wait for the product ``qk`` (``pending`` later products may still run) and read what the
    loader staged with its K tile (``_staged_keys``): ``(qk, staged)``. With ``READ_KEYS_EARLY``
    the shared-memory reads are issued before the wait, so their latency overlaps the product;
    whether that pays depends on where ptxas then places them (the callers say)."""
    if READ_KEYS_EARLY:
        staged = _staged_keys(p, bufs, stage, keys_layout)
    qk = warpgroup_mma_wait(pending, deps=[qk])
    if not READ_KEYS_EARLY:
        staged = _staged_keys(p, bufs, stage, keys_layout)
    return qk, staged


@gluon.jit
def _visible_scores(p, bufs, qk, staged, stage, first_row, rows, keys_layout: gl.constexpr, ROWS: gl.constexpr):
    """Log2-domain scores of a product tile ``qk`` ``[ROWS, BLOCK_N]`` with the tile's key scores
    added, and -inf where the band or the end of the keys cuts it (only edge tiles are checked:
    those whose span of key positions the band or the end cuts). ``staged`` is
    ``_staged_keys(p, bufs, stage, keys_layout)``."""
    KEYS: gl.constexpr = p.WALK == tiles.WALK_KEYS
    first_key, last_key, key_scores = staged
    s = qk * p.scale_log2
    if p.HAS_BIAS or p.HAS_MASK or KEYS:
        s = s + key_scores[None, :]
    edge = (first_key - first_row - ROWS + 1 < p.band_lo) | (last_key - first_row > p.band_hi) | (last_key >= p.seqlen_k)
    if edge:
        if KEYS:
            keys = bufs.positions.index(stage).load(keys_layout)  # [BLOCK_N]
        else:
            keys = first_key + gl.arange(0, p.BLOCK_N, keys_layout)
        offset = keys[None, :] - rows[:, None]
        visible = (keys < p.seqlen_k)[None, :] & (offset >= p.band_lo) & (offset <= p.band_hi)
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _thread_row_sums(x):
    """Row sums of a wgmma tile ``x`` ``[ROWS, N]`` over each thread's own columns only: ``[ROWS, 4]``.

    The tile gives each thread of a row's quad the columns ``8 j + 2 t + e`` (thread ``t``), so
    these sums need no shuffles; the quad's four partial sums are added once per work item.
    """
    ROWS: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    return gl.sum(gl.sum(x.reshape([ROWS, N // 8, 4, 2]), 3), 1)


@gluon.jit
def _online_softmax(s, m_i, l_i):
    """One tile of the online softmax: ``(probs, m_new, alpha, l_new)``, with ``l`` the rows'
    sums per thread (``_thread_row_sums``)."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead, so p = 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    probs = gl.exp2(s - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return probs, m_new, alpha, l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + _thread_row_sums(probs)


@gluon.jit
def _softmax_rows(p, bufs, HALF: gl.constexpr):
    """One warpgroup: rows ``[HALF * 64, HALF * 64 + 64)`` of every work item of this program.

    Within a work item, the product of the next tile ``S = Q K^T`` is issued with ``O += P V`` of
    this one, before the next softmax, as in FlashAttention-3's intra-warpgroup overlap. ptxas
    (triton 3.6) still places the wait for ``P V`` before that softmax (docs/benchmarks.md), so
    the tensor cores overlap a warpgroup's softmax only with the other warpgroup's products.
    """
    ROWS: gl.constexpr = p.BLOCK_M // 2
    D: gl.constexpr = p.HEAD_DIM
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_of_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = p.q_desc.dtype
    # Whether a tile's staged keys are read before its product is waited for (their shared-memory
    # latency then overlaps it), chosen by measurement (llm shape, keep 1/8): 3.6% faster at D = 64
    # (16K); 4-6% slower at D = 128 (16K-128K), where ptxas issues the loads between the two products.
    READ_KEYS_EARLY: gl.constexpr = D == 64

    consumed = 0  # K/V tiles so far: the ring position, as in the loader
    items_done = 0
    for index in range(gl.program_id(0), p.items, gl.num_programs(0)):
        batch, head, first_row, rows, q_slot, count = _take_rows(p, bufs, index, items_done, HALF, rows_of_s)
        q = bufs.q.index(q_slot).reshape([p.BLOCK_M, D]).slice(HALF * ROWS, ROWS)  # [ROWS, D]

        m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_of_s)
        l_i = _thread_row_sums(gl.zeros([ROWS, p.BLOCK_N], gl.float32, s_layout))  # zeros, in the sums' layout
        acc = gl.zeros([ROWS, D], gl.float32, o_layout)
        if count > 0:
            stage = consumed % p.KV_STAGES
            mbarrier.wait(bufs.k_ready.index(stage), (consumed // p.KV_STAGES) & 1)
            k = bufs.k.index(stage).reshape([p.BLOCK_N, D])
            qk = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([ROWS, p.BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            qk, staged = _wait_for_scores(p, bufs, qk, 0, stage, keys_of_s, READ_KEYS_EARLY)
            s = _visible_scores(p, bufs, qk, staged, stage, first_row, rows, keys_of_s, ROWS)
            mbarrier.arrive(bufs.k_empty.index(stage), count=1)
            probs, m_i, _, l_i = _online_softmax(s, m_i, l_i)
            for _ in range(1, count):
                following = (consumed + 1) % p.KV_STAGES
                mbarrier.wait(bufs.k_ready.index(following), ((consumed + 1) // p.KV_STAGES) & 1)
                k = bufs.k.index(following).reshape([p.BLOCK_N, D])
                qk = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([ROWS, p.BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
                mbarrier.wait(bufs.v_ready.index(stage), (consumed // p.KV_STAGES) & 1)
                v = bufs.v.index(stage).reshape([p.BLOCK_N, D])
                acc = warpgroup_mma(gl.convert_layout(probs.to(dtype), p_layout), v, acc, is_async=True)
                # The product of the next tile; P V may still run.
                qk, staged = _wait_for_scores(p, bufs, qk, 1, following, keys_of_s, READ_KEYS_EARLY)
                s = _visible_scores(p, bufs, qk, staged, following, first_row, rows, keys_of_s, ROWS)  # [ROWS, BLOCK_N]
                mbarrier.arrive(bufs.k_empty.index(following), count=1)
                probs, m_i, alpha, l_i = _online_softmax(s, m_i, l_i)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(bufs.v_empty.index(stage), count=1)
                acc = acc * gl.convert_layout(alpha, rows_of_o)[:, None]
                consumed += 1
                stage = following
            mbarrier.wait(bufs.v_ready.index(stage), (consumed // p.KV_STAGES) & 1)
            v = bufs.v.index(stage).reshape([p.BLOCK_N, D])
            acc = warpgroup_mma(gl.convert_layout(probs.to(dtype), p_layout), v, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(bufs.v_empty.index(stage), count=1)
            consumed += 1

        # Rows with no visible key: out = 0, lse = -inf.
        l_i = gl.convert_layout(gl.sum(l_i, 1), rows_of_s)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.convert_layout(l_safe, rows_of_o)[:, None]
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * tiles.LN2)
        _store_rows(p, bufs, q_slot, HALF, batch, first_row, head, out)
        lse_row = p.Lse + batch.to(gl.int64) * p.stride_lse_b + head.to(gl.int64) * p.stride_lse_h
        gl.store(lse_row + rows, lse, mask=rows < p.seqlen_q)
        items_done += 1


@gluon.jit
def _tile_descriptor(
    T, batch, length, heads, stride_b, stride_s, stride_h,
    ROWS: gl.constexpr, LAYOUT_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):
    """The TMA descriptor of a whole ``[B, S, heads, D]`` tensor, in tiles of ``ROWS`` rows of one
    head, laid out in shared memory as tiles of ``LAYOUT_ROWS`` rows are (``_store_rows`` writes
    a warpgroup's half of a Q tile)."""
    return tma.make_tensor_descriptor(
        T, [batch, length, heads, HEAD_DIM], [stride_b, stride_s, stride_h, 1], [1, ROWS, 1, HEAD_DIM],
        gl.NVMMASharedLayout.get_default_for([1, LAYOUT_ROWS, 1, HEAD_DIM], T.dtype.element_ty),
    )


@gluon.jit
def _init_barriers(bufs, KV_STAGES: gl.constexpr):
    """The barriers of the two Q slots and of the K/V ring (the forward's and the dQ kernel's):
    the loader's copies fill a slot, and both math warpgroups release it."""
    for i in gl.static_range(2):
        mbarrier.init(bufs.q_ready.index(i), count=1)
        mbarrier.init(bufs.q_empty.index(i), count=2)
    for i in gl.static_range(KV_STAGES):
        mbarrier.init(bufs.k_ready.index(i), count=1)
        mbarrier.init(bufs.v_ready.index(i), count=1)
        mbarrier.init(bufs.k_empty.index(i), count=2)
        mbarrier.init(bufs.v_empty.index(i), count=2)


def _jit_with_runtime_scalars(fn):
    """``gluon.jit`` that never specialises the int and float parameters (lower-case, not
    constexpr): a value of 1 would become a constant, which the aggregates' tensor fields do not
    take, and ``launch.Launcher`` wants every int parameter classified."""
    params = inspect.signature(fn).parameters.items()
    return gluon.jit(fn, do_not_specialize=[n for n, p in params if n[0].islower() and p.annotation is inspect.Parameter.empty])


@gluon.jit
def _softmax_lower(p, bufs):
    _softmax_rows(p, bufs, 0)


@gluon.jit
def _softmax_upper(p, bufs):
    _softmax_rows(p, bufs, 1)


@_jit_with_runtime_scalars
def _attn_fwd_hopper_kernel(
    Q, K, V, Out, Lse, Mask, Bias, Walk,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
    stride_mb, stride_mh, stride_mk, stride_bb, stride_bh, stride_bk,
    stride_wb, stride_wh, stride_wr, walk_width,
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group, items, row_blocks,
    mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
    band_lo, band_hi, scale_log2,
    HAS_MASK: gl.constexpr, HAS_BIAS: gl.constexpr, WALK: gl.constexpr, HEAD_DIM: gl.constexpr, KV_STAGES: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
):
    # Descriptors of the whole [B, S, heads, D] tensors, made once per (persistent) program.
    q_desc = _tile_descriptor(Q, batch, seqlen_q, num_heads, stride_qb, stride_qs, stride_qh, BLOCK_M, BLOCK_M, HEAD_DIM)
    k_desc = _tile_descriptor(K, batch, seqlen_k, num_kv_heads, stride_kb, stride_ks, stride_kh, BLOCK_N, BLOCK_N, HEAD_DIM)
    v_desc = _tile_descriptor(V, batch, seqlen_k, num_kv_heads, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_N, HEAD_DIM)
    o_desc = _tile_descriptor(Out, batch, seqlen_q, num_heads, stride_ob, stride_os, stride_oh, BLOCK_M // 2, BLOCK_M, HEAD_DIM)
    bufs = _Buffers(
        gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout),
        gl.allocate_shared_memory(k_desc.dtype, [KV_STAGES] + k_desc.block_type.shape, k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [KV_STAGES] + v_desc.block_type.shape, v_desc.layout),
        gl.allocate_shared_memory(gl.int32, [2, 1], _PLAIN),
        gl.allocate_shared_memory(gl.int32, [2 * KV_STAGES, 1], _PLAIN),  # spans: first keys, then last keys
        gl.allocate_shared_memory(gl.int32, [KV_STAGES, BLOCK_N], _PLAIN),
        gl.allocate_shared_memory(gl.float32, [KV_STAGES, BLOCK_N], _PLAIN),
        gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout()),
    )
    _init_barriers(bufs, KV_STAGES)
    p = _Problem(
        q_desc, k_desc, v_desc, q_desc, o_desc, Out, Lse, Lse, Mask, Bias, Walk,  # no dO, no delta
        stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
        stride_mb, stride_mh, stride_mk, stride_bb, stride_bh, stride_bk,
        stride_wb, stride_wh, stride_wr, walk_width,
        seqlen_q, seqlen_k, num_heads, group, items, row_blocks,
        mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
        band_lo, band_hi, scale_log2, scale_log2,
        HAS_MASK, HAS_BIAS, WALK, HEAD_DIM, KV_STAGES, BLOCK_M, BLOCK_N, False,
    )
    gl.warp_specialize(
        [(_softmax_lower, (p, bufs)), (_softmax_upper, (p, bufs)), (_load_partition, (p, bufs))],
        [4, 1], [_SOFTMAX_REGISTERS, _LOADER_REGISTERS],
    )


def hopper_forward_supported(q, k, v, mask, bias, kv_lists, key_list, list_block_q, list_block_k, softcap) -> bool:
    """Whether ``hopper_forward`` serves this plain (not varlen, not cached, not split) forward."""
    if os.environ.get("FLASH_DMA_HOPPER", "1") == "0" or configs.triton_interpreting() or not configs.is_hopper(q.device):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[3] not in HEAD_DIMS or softcap > 0:
        return False
    # A mask is read per key, on the PARTIAL tiles of a summary (a key list replaces its mask); a bias per key.
    if mask is not None and (kv_lists is None or mask.shape[2] != 1):
        return False
    if bias is not None and bias.shape[2] != 1:
        return False
    if list_block_q % TILE.kwargs["BLOCK_M"] or list_block_k % TILE.kwargs["BLOCK_N"] or q.numel() == 0 or k.numel() == 0:
        return False
    return tma_aligned(q, k, v)


def walked_keys(k, v, kv_lists, key_list) -> tuple:
    """``(k, v, walk, WALK)`` as the Hopper forward and dQ kernels read them: with a key list, its
    kept keys gathered (``key_list.gather_kept_keys``) and the list walked; else the summary's
    lists (or none)."""
    if key_list is None:
        return k, v, kv_lists, walk_kind(kv_lists, None)
    return *gather_kept_keys(k, v, key_list), key_list, WALK_KEYS


hopper_launcher = Launcher(_attn_fwd_hopper_kernel, tensors=("Q", "K", "V", "Out", "Lse", "Mask", "Bias", "Walk"), specialized=())


def hopper_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    kv_lists: torch.Tensor | None,
    key_list: torch.Tensor | None,
    list_block_q: int,
    list_block_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Write ``out`` ``[B, Sq, H, D]`` and ``lse`` ``[B, H, Sq]`` float32, as ``attention_forward`` would.

    q: ``[B, Sq, H, D]``; k, v: ``[B, Sk, Hkv, D]``; mask, bias: per key, ``[1|B, 1|Hkv|H, 1, Sk]``
    or None; kv_lists: the summary's ``[Bl, Hl, NQB, 2, 2, NKB + 1]`` or None; key_list: a per-key
    mask's ``[Bm, Hm, 2, Sk + 1]`` (then mask is None) or None (``forward.py``).
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    row_blocks = cdiv(seqlen_q, TILE.kwargs["BLOCK_M"])
    items = row_blocks * batch * num_heads
    k, v, walk, walk_flag = walked_keys(k, v, kv_lists, key_list)
    tensors = [
        q, k, v, out, lse, placeholder(q.device, torch.uint8) if mask is None else kernel_view(mask),
        placeholder(q.device, q.dtype) if bias is None else bias, placeholder(q.device, torch.int32) if walk is None else walk,
    ]

    def build():
        mask_strides, bias_strides = broadcast_strides(mask), broadcast_strides(bias)
        flags = (mask is not None, bias is not None, walk_flag, head_dim, _KV_STAGES[head_dim])
        args = [
            *tensors, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), mask_strides[0], mask_strides[1], mask_strides[3],
            bias_strides[0], bias_strides[1], bias_strides[3],
            *broadcast_strides(walk)[:3], 0 if walk is None else walk.shape[-1],
            batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, num_heads // num_kv_heads, items, row_blocks,
            head_divisor(mask, num_heads), head_divisor(bias, num_heads), head_divisor(walk, num_heads),
            list_block_q, list_block_k, *diagonal_band(window_left, window_right, seqlen_q, seqlen_k), softmax_scale * tiles.LOG2E.value,
            *flags,
        ]
        return args, (q.dtype, *flags)

    layout = (
        common_layout(q, k, v, mask, bias, walk, None), tensor_layout(out), tensor_layout(lse), list_block_q, list_block_k,
        softmax_scale, window_left, window_right,
    )
    hopper_launcher.launch(
        layout, tensors, build, lambda: [TILE], lambda meta: (min(items, configs.multiprocessor_count(q.device)),),
    )
