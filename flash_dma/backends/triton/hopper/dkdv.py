"""Hopper dK/dV: the dK/dV kernel of ``../backward.py`` as a warp-specialised, persistent Gluon kernel.

The Triton dK/dV kernel keeps dK and dV of 64 keys, their K and V, and the S and dP tiles in one
warpgroup's registers, and spills (``tools/compile_report.py``); its loads, products and
epilogue take turns. Here, as in FlashAttention-3's backward, the roles run side by side:

- a *loader* warp takes work items from a queue (an atomic counter: items differ widely in
  length under causal and sparse masks, so a static split would leave programs idle), walks
  each item's query tiles (``tiles.key_walk`` along the query axis, PARTIAL tiles first) and
  copies K and V once per item and Q and dO per tile with TMA. With each Q tile it stages the
  tile's number, its head, whether its pair bits are read, and the rows' log-sum-exps and deltas.
- two *gradient* warpgroups each own 64 of an item's 128 keys: dK and dV stay in registers
  (2 x 64 of their 240) while they compute ``S^T = K Q^T`` and ``dP^T = V dO^T`` from shared
  memory, and ``dV += P^T dO`` and ``dK += dS^T Q`` with P and dS from registers. They read a
  per-key mask and bias once per head, and a per-pair bias and a BitMask's bits per tile
  (transposed: ``KEYS_FIRST`` in ``common.py``).

A work item is (key tile, query chunk, batch, key/value head); it visits every query head of the
group, so K and V are read once per item. Items are taken first key tiles first (under a causal
band they see the most queries). With one query chunk, dK and dV are written directly. With
several, their parts add up in fp32 scratch: by atomics into zeroed scratch, or, deterministic
(SLICES), each chunk into a slice of its own; ``write_gradients`` then writes dK and dV from it
(the slices summed in chunk order). The scratch holds the items' slots, each column's rows
together (``sums_shape``), and only the rows the kernel adds to are zeroed and read
(``column_live``). Walking a block summary, the chunks follow the mask's real density: a Triton
function counts every column's query tiles first, in the backward's preprocess
(``count_columns``), and the loader takes as many chunks as make the longest column's items no
larger than a program's share (``_counted_chunks``), up to the host's count. (Chunks that waited
for their turn to add, as the Triton kernel's do, made the step 2.9x slower: a chunk's program
can be two items behind its neighbours'.)

With a key list (a per-key mask's kept keys, ``key_list.py``) an item's keys are slots of the
list, gathered as for the forward (``common.walked_keys``); dK and dV go back to the keys' own
rows (``_column_keys``). At head dims 192 and 256 (``ROLES``) an item is 64 keys that both
warpgroups take, one keeping dV and the other dK, as one warpgroup's registers hold one 64 x 256
fp32 accumulator but not two.

The bias gradient: per key, the column sums of dS (flushed per head, or once for a bias the
group shares); per pair, dS itself, each tile written once. For a per-pair bias the group's
heads share, the loader visits a tile's heads one after the other (``HEADS_INNER``) and the
warpgroups add their dS before writing; where programs share it (a bias broadcast over the
batch or the key/value heads, or a walk that differs per head) it is added by fp32 atomics.
"""

# No `from __future__ import annotations`: the records below need their field types as objects.
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flash_dma.backends.triton import configs, tiles
from flash_dma.backends.triton.hopper.common import (
    BIAS_KEYS,
    BIAS_PAIRS,
    COMMON_TENSORS,
    LOADER_REGISTERS,
    MASK_BITS,
    MASK_INTERVALS,
    MASK_KEYS,
    MATH_REGISTERS,
    MAX_REGISTERS,
    PLAIN,
    TILES,
    WORD_BITS,
    Item,
    cta_barrier,
    expect_after_stores,
    get,
    head_dim_tile,
    hopper_arguments,
    hopper_tensors,
    entry_span,
    entry_tables,
    input_base,
    interval_rows,
    jit_with_runtime_scalars,
    kept_by_bits,
    launch_band,
    let_next_kernel_start,
    log2_scores,
    pair_bias,
    pair_bias_staged,
    pair_inside,
    pair_offsets,
    put,
    query_walk,
    record,
    row_statistics,
    softcap_slope,
    staged_buffers,
    staged_descriptors,
    staged_pair_row,
    tile_at,
    tile_count,
    tile_descriptor,
    tma_load,
    tests_pairs,
    tma_store,
    walked_keys,
    wide_tiles,
    words_staged,
)
from flash_dma.backends.triton.launch import Launcher, hold
from flash_dma.backends.triton.layout import (
    DBIAS_FULL,
    DBIAS_PER_KEY,
    Call,
    Sequences,
    broadcast_strides,
    head_divisor,
    placeholder,
    walks_per_group,
)
from flash_dma.integers import cdiv

TILE = triton.Config(dict(zip(("BLOCK_M", "BLOCK_N"), TILES["dkdv"])), num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
# Head dims 192 and 256 (tiles of 256 columns): items of 64 keys, which both gradient warpgroups
# share, one keeping dV and the other dK (``ROLES``): a 64 x 256 fp32 accumulator is 128 of a
# warpgroup's 240 registers, so one warpgroup cannot keep both. One K/V buffer (64 KB) and two
# Q/dO stages (128 KB) fill 192 KB of shared memory.
WIDE_TILE = triton.Config(dict(BLOCK_M=TILE.kwargs["BLOCK_M"], BLOCK_N=64), num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
Q_STAGES = {32: 3, 64: 3, 128: 2, 256: 2}  # Q/dO tiles in flight per tile head dim; with two K/V buffers, D = 128 fills 192 KB
_PER_KEY = gl.constexpr(DBIAS_PER_KEY)
_FULL = gl.constexpr(DBIAS_FULL)


@record
class _Problem:
    """What every partition reads: descriptors, pointers, strides, sizes and constexprs."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    words_desc: tma.tensor_descriptor
    bias_desc: tma.tensor_descriptor
    dbias_desc: tma.tensor_descriptor
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
    SeqQ: gl.tensor
    SeqK: gl.tensor
    stride_mb: gl.tensor
    stride_mh: gl.tensor
    stride_mq: gl.tensor
    stride_mk: gl.tensor
    stride_bb: gl.tensor
    stride_bh: gl.tensor
    stride_bq: gl.tensor
    stride_bk: gl.tensor
    stride_wb: gl.tensor
    stride_wh: gl.tensor
    stride_wr: gl.tensor
    walk_width: gl.tensor
    stride_gb: gl.tensor  # the rows the items write: dK's and dV's with one chunk, else the chunk sums'
    stride_gs: gl.tensor
    stride_gh: gl.tensor
    stride_dbc: gl.tensor
    stride_dbb: gl.tensor
    stride_dbh: gl.tensor
    stride_dbq: gl.tensor
    stride_dbk: gl.tensor
    batch: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    num_heads: gl.tensor
    num_kv_heads: gl.tensor
    group: gl.tensor
    chunks: gl.tensor  # per column in ``items``; with ``counted``, the most the loader's queue takes
    items: gl.tensor
    counted: gl.tensor  # whether ``count_columns`` counted the columns' work (``_counted_chunks``)
    entries: gl.tensor  # packed sequences: how many (``batch`` is then the token tensors', 1)
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
    softcap_log2: gl.tensor
    scale_over_cap: gl.tensor
    MASK: gl.constexpr
    BIAS: gl.constexpr
    WALK: gl.constexpr
    DBIAS: gl.constexpr
    DBIAS_ATOMIC: gl.constexpr
    DBIAS_HEAD_SHARED: gl.constexpr
    HEADS_INNER: gl.constexpr
    HEAD_DIM: gl.constexpr  # the tiles' head dim (``head_dim_tile(COLUMNS)``)
    COLUMNS: gl.constexpr  # the inputs' head dim
    STAGED_BIAS: gl.constexpr
    STAGED_DBIAS: gl.constexpr
    SOFTCAP: gl.constexpr
    SLICES: gl.constexpr
    Q_STAGES: gl.constexpr
    KV_BUFFERS: gl.constexpr  # K/V tiles in shared memory: this item's and the next's, or one (ROLES)
    ROLES: gl.constexpr  # the warpgroups share an item's keys, one keeping dV and the other dK (D = 256)
    SEQ: gl.constexpr  # ``tiles.SEQ_FIXED`` or ``SEQ_PACKED`` (``SeqQ`` and ``SeqK`` its cu_seqlens)
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr


@record
class _Buffers:
    """Shared memory: the queue's next items (index, tile count), two K/V tiles (this item's and
    the next's), a ring of Q/dO tiles with their BitMask words and per-pair bias
    (``common.staged_buffers``), tile numbers, heads, whether their pair bits are read, LSEs and
    deltas; each gradient warpgroup's tile of a per-pair bias gradient on its way out; the barriers."""

    item_index: gl.shared_memory_descriptor
    item_tiles: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    words: gl.shared_memory_descriptor
    bias: gl.shared_memory_descriptor
    dbias: gl.shared_memory_descriptor
    tiles: gl.shared_memory_descriptor
    heads: gl.shared_memory_descriptor
    partial: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
    item_ready: gl.shared_memory_descriptor
    item_empty: gl.shared_memory_descriptor
    kv_ready: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor


@gluon.jit
def _entries(p):
    """Batch entries the work items span: sequences when packed."""
    if p.SEQ == tiles.SEQ_PACKED:
        return p.entries
    else:
        return p.batch


@gluon.jit
def _column_position(p, index, chunks):
    """``(key_tile, chunk, batch, kv_head)`` of work item ``index`` of a queue of ``chunks``
    chunks per column: key tiles from the first, then the chunks of one column side by side
    (``batch``: the entry, a sequence when packed)."""
    per_tile = chunks * _entries(p) * p.num_kv_heads
    rest = index % per_tile
    batch_head = rest // chunks
    return index // per_tile, rest % chunks, batch_head // p.num_kv_heads, batch_head % p.num_kv_heads


@gluon.jit
def _item_index(p, key_tile, chunk, batch, kv_head):
    """The index of a work item in a queue of ``p.chunks`` chunks per column (``_column_position``'s
    inverse): how the loader names the items it hands on, whatever chunks its queue has."""
    return ((key_tile * _entries(p) + batch) * p.num_kv_heads + kv_head) * p.chunks + chunk


@gluon.jit
def _counted_chunks(p):
    """Query chunks for the columns' work that ``count_columns`` counted (``p.Queue[1:3]``): the
    longest column's query tiles over the mean per program, rounded, so that no item outweighs
    a program's share, at least 1 and at most the host's ``p.chunks``. ``backward.query_chunks``
    alone can only assume how much of a mask is kept (1/8): a sparser mask left most SMs without
    items, a denser one paid for chunks' additions it did not need."""
    longest = gl.load(p.Queue + 1)
    total = gl.maximum(gl.load(p.Queue + 2), 1)
    wanted = (2 * longest * gl.num_programs(0) + total) // (2 * total)
    return gl.minimum(gl.maximum(wanted, 1), p.chunks)


@gluon.jit
def _column_keys(p, first_slot, batch, kv_head, span, KEYS: gl.constexpr, layout: gl.constexpr):
    """``KEYS`` columns of a work item from ``first_slot`` on: ``(keys, kept, k_first, k_last)``,
    their key positions, the count of kept slots (``_slots_below``), and bounds of the kept
    positions (``k_first > k_last`` when none is; consecutive keys' ``k_last`` may lie past the
    entry's end). Consecutive keys, or with a key list (WALK_KEYS, the keys
    gathered in list order: ``walked_keys``) consecutive slots of its order, kept positions
    ascending up to its count, then the dropped ones: every key is some item's slot, so dK and dV
    are written once for each, zeros for the dropped ones."""
    slots = first_slot + gl.arange(0, KEYS, layout)  # [KEYS]
    if p.WALK == tiles.WALK_KEYS:
        order = input_base(p.Walk, p.stride_wb, p.stride_wh, p.walk_head_div, batch, kv_head * p.group)
        kept = gl.load(order + p.walk_width + span.seqlen_k)  # the rank of position Sk: the kept count
        keys = gl.load(order + slots, mask=slots < span.seqlen_k, other=0)
        key_ok = slots < kept
        k_first = gl.min(gl.where(key_ok, keys, span.seqlen_k), 0)
        k_last = gl.max(gl.where(key_ok, keys, -1), 0)
    else:
        keys = slots
        kept = span.seqlen_k
        k_first = first_slot
        k_last = first_slot + KEYS - 1
    return keys, kept, k_first, k_last


@gluon.jit
def _slots_below(first_slot, limit, KEYS: gl.constexpr, layout: gl.constexpr):
    """Which of the ``KEYS`` slots from ``first_slot`` on lie below ``limit``: the kept count (those
    attended), or the entry's key count (those whose gradients are written: a key list's order is
    a permutation of the keys)."""
    return first_slot + gl.arange(0, KEYS, layout) < limit


@gluon.jit
def _head_walk(p, key_tile, chunk, chunks, batch, head, span, k_first, k_last):
    """The query tiles that see the keys ``[k_first, k_last]`` of key tile ``key_tile`` for query
    head ``head``, chunk ``chunk`` of ``chunks``: ``tiles.query_walk``, over the transposed
    summary (or densely under a key list), within the entry's ``span``."""
    QUERY_WALK: gl.constexpr = tiles.WALK_DENSE if p.WALK == tiles.WALK_KEYS else p.WALK
    walk = input_base(p.Walk, p.stride_wb, p.stride_wh, p.walk_head_div, batch, head)
    lists, tiles_per_block, query_limit, partial_lo, partial_hi, lo, _, _, hi = query_walk(
        walk, p.walk_width, p.stride_wr, key_tile, k_first, k_last, span.seqlen_q, span.seqlen_k, span.band_lo, span.band_hi,
        p.list_block_q, p.list_block_k, chunk, chunks, QUERY_WALK, p.BLOCK_M, p.BLOCK_N,
    )
    if (p.SEQ == tiles.SEQ_PACKED) or (p.WALK == tiles.WALK_KEYS):
        # A key tile past its sequence's keys (the items span the longest), or of dropped keys only: no tiles.
        none = k_first > k_last
        partial_hi = gl.where(none, partial_lo, partial_hi)
        hi = gl.where(none, lo, hi)
    return Item(key_tile, batch, head, lists, tiles_per_block, query_limit, partial_lo, partial_hi, lo, hi)


@gluon.jit
def _item_tiles(p, key_tile, chunk, chunks, batch, kv_head, span, k_first, k_last):
    """Query tiles of a work item over the group's heads."""
    count = 0
    for g in range(p.group):
        count += tile_count(_head_walk(p, key_tile, chunk, chunks, batch, kv_head * p.group + g, span, k_first, k_last))
    return count


@gluon.jit
def _publish(bufs, published, index, count):
    """Hand work item ``index`` (``count`` query tiles; index -1: no more) to the gradient warpgroups."""
    slot = published % 2
    mbarrier.wait(bufs.item_empty.index(slot), (published // 2) & 1 ^ 1)
    put(bufs.item_index.index(slot), index)
    put(bufs.item_tiles.index(slot), count)
    mbarrier.arrive(bufs.item_ready.index(slot), count=1)


@gluon.jit
def _take(bufs, taken):
    """The next work item of the queue: ``(index, count)`` as published."""
    slot = taken % 2
    mbarrier.wait(bufs.item_ready.index(slot), (taken // 2) & 1)
    index = get(bufs.item_index.index(slot))
    count = get(bufs.item_tiles.index(slot))
    mbarrier.arrive(bufs.item_empty.index(slot), count=1)
    return index, count


@gluon.jit
def _load_query_tile(p, bufs, loaded, batch, head, g, key_tile, tile, partial, span, row_layout: gl.constexpr):
    """Query tile ``tile`` of head ``head`` (the group's ``g``-th) into ring position ``loaded``:
    its number, head, whether its pair bits are read, its rows' LSEs and deltas
    (``common.row_statistics``), Q and dO, and its pairs with key tile ``key_tile``'s keys: a
    BitMask's words and a staged per-pair bias."""
    words_bytes: gl.constexpr = p.words_desc.block_type.nbytes if words_staged(p.MASK, p.BLOCK_N) else 0
    bias_bytes: gl.constexpr = p.bias_desc.block_type.nbytes if pair_bias_staged(p.BIAS, p.STAGED_BIAS) else 0
    q_bytes: gl.constexpr = 2 * p.q_desc.block_type.nbytes + words_bytes + bias_bytes
    # LSE and delta are [B, H, Sq] (packed: [1, H, total]); the entry's rows start at q_start.
    row_offset = (span.tokens * p.num_heads + head).to(gl.int64) * p.seqlen_q + span.q_start
    bias_base = input_base(p.Bias, p.stride_bb, p.stride_bh, p.bias_head_div, batch, head)
    # Read before waiting for the buffer: the loads overlap the wait.
    lse, delta = row_statistics(p, row_offset, tile * p.BLOCK_M + gl.arange(0, p.BLOCK_M, row_layout), bias_base, span.seqlen_q)
    stage = loaded % p.Q_STAGES
    mbarrier.wait(bufs.q_empty.index(stage), (loaded // p.Q_STAGES) & 1 ^ 1)
    put(bufs.tiles.index(stage), tile)
    put(bufs.heads.index(stage), g)
    if tests_pairs(p.MASK):
        put(bufs.partial.index(stage), partial.to(gl.int32))
    bufs.lse.index(stage).store(lse)
    bufs.delta.index(stage).store(delta)
    expect_after_stores(bufs.q_ready.index(stage), q_bytes)
    row_tile = [span.tokens, span.q_start + tile * p.BLOCK_M, head, 0]
    tma_load(p.q_desc, row_tile, bufs.q_ready.index(stage), bufs.q.index(stage))
    tma_load(p.do_desc, row_tile, bufs.q_ready.index(stage), bufs.do.index(stage))
    if words_staged(p.MASK, p.BLOCK_N):
        row = staged_pair_row(p.Mask, p.stride_mb, p.stride_mh, p.stride_mq, p.mask_head_div, batch, head, tile * p.BLOCK_M)
        tma_load(p.words_desc, [row, key_tile * (p.BLOCK_N // WORD_BITS)], bufs.q_ready.index(stage), bufs.words.index(stage))
    if pair_bias_staged(p.BIAS, p.STAGED_BIAS):
        row = staged_pair_row(p.Bias, p.stride_bb, p.stride_bh, p.stride_bq, p.bias_head_div, batch, head, tile * p.BLOCK_M)
        tma_load(p.bias_desc, [row, key_tile * p.BLOCK_N], bufs.q_ready.index(stage), bufs.bias.index(stage))


@gluon.jit
def _load_column(p, bufs, index, chunks, published, kv_loaded, loaded):
    """Queue entry ``index`` for ``_load_columns``: its item published (as the ``published``-th), K
    and V into buffer position ``kv_loaded``, its query tiles from ring position ``loaded``.
    Returns the three counts after it."""
    kv_bytes: gl.constexpr = 2 * p.k_desc.block_type.nbytes
    row_layout: gl.constexpr = gl.BlockedLayout([p.BLOCK_M // 32], [32], [1], [0])
    key_layout: gl.constexpr = gl.BlockedLayout([p.BLOCK_N // 32], [32], [1], [0])

    key_tile, chunk, batch, kv_head = _column_position(p, index, chunks)
    span = entry_span(p, batch)
    _, _, k_first, k_last = _column_keys(p, key_tile * p.BLOCK_N, batch, kv_head, span, p.BLOCK_N, key_layout)
    count = _item_tiles(p, key_tile, chunk, chunks, batch, kv_head, span, k_first, k_last)
    if (count > 0) | (p.chunks == 1) | p.SLICES:
        _publish(bufs, published, _item_index(p, key_tile, chunk, batch, kv_head), count)
        published += 1
    if count > 0:
        kv = kv_loaded % p.KV_BUFFERS
        mbarrier.wait(bufs.kv_empty.index(kv), (kv_loaded // p.KV_BUFFERS) & 1 ^ 1)
        mbarrier.expect(bufs.kv_ready.index(kv), kv_bytes)
        key_tile_at = [span.tokens, span.k_start + key_tile * p.BLOCK_N, kv_head, 0]
        tma_load(p.k_desc, key_tile_at, bufs.kv_ready.index(kv), bufs.k.index(kv))
        tma_load(p.v_desc, key_tile_at, bufs.kv_ready.index(kv), bufs.v.index(kv))
        kv_loaded += 1
        first_head = kv_head * p.group
        if p.HEADS_INNER:
            it = _head_walk(p, key_tile, chunk, chunks, batch, first_head, span, k_first, k_last)
            for j in range(tile_count(it)):
                tile, partial = tile_at(p, it, j)
                for g in range(p.group):
                    _load_query_tile(p, bufs, loaded, batch, first_head + g, g, key_tile, tile, partial, span, row_layout)
                    loaded += 1
        else:
            for g in range(p.group):
                it = _head_walk(p, key_tile, chunk, chunks, batch, first_head + g, span, k_first, k_last)
                for j in range(tile_count(it)):
                    tile, partial = tile_at(p, it, j)
                    _load_query_tile(p, bufs, loaded, batch, first_head + g, g, key_tile, tile, partial, span, row_layout)
                    loaded += 1
    return published, kv_loaded, loaded


@gluon.jit
def _load_columns(p, bufs):
    """One warp: takes work items off the queue; for each, K and V, then its query tiles
    (``_load_query_tile``): head by head, or with HEADS_INNER each tile's heads in turn (their
    walk is the same). Items without tiles are skipped when chunks add up by atomics."""
    published = 0
    kv_loaded = 0
    loaded = 0  # Q/dO tiles so far: the ring position
    chunks = p.chunks
    if p.counted != 0:
        chunks = _counted_chunks(p)
    items = p.items // p.chunks * chunks
    index = gl.atomic_add(p.Queue, 1)
    while index < items:
        published, kv_loaded, loaded = _load_column(p, bufs, index, chunks, published, kv_loaded, loaded)
        index = gl.atomic_add(p.Queue, 1)
    _publish(bufs, published, -1, 0)


@gluon.jit
def _key_scores(p, batch, head, keys, key_ok):
    """Scores the keys add for query head ``head``: their bias in log2 units, -inf where a
    per-key mask drops them or where not ``key_ok`` (past the entry's last key, or a key list's
    dropped slots). A per-key mask is the same for every query, so applying it everywhere is
    exact (FULL tiles keep every key anyway)."""
    scores = gl.full(keys.shape, 0.0, gl.float32, keys.type.layout)
    if p.BIAS == BIAS_KEYS:
        bias_row = input_base(p.Bias, p.stride_bb, p.stride_bh, p.bias_head_div, batch, head)
        scores = gl.load(bias_row + keys * p.stride_bk, mask=key_ok, other=0.0).to(gl.float32) * tiles.LOG2E
    if p.MASK == MASK_KEYS:
        mask_row = input_base(p.Mask, p.stride_mb, p.stride_mh, p.mask_head_div, batch, head)
        key_ok = key_ok & (gl.load(mask_row + keys * p.stride_mk, mask=key_ok, other=0) != 0)
    return gl.where(key_ok, scores, float("-inf"))


@gluon.jit
def _item_intervals(p, batch, head, keys):
    """Key intervals' rows of the item's ``keys`` for query head ``head`` (``common.interval_rows``):
    two keys a thread, kept in registers for the whole item."""
    mask_row = input_base(p.Mask, p.stride_mb, p.stride_mh, p.mask_head_div, batch, head)
    return interval_rows(p, mask_row, keys, keys < p.seqlen_k)


@gluon.jit
def _bias_gradient_row(p, chunk, batch, head):
    return p.DBias + chunk * p.stride_dbc + batch.to(gl.int64) * p.stride_dbb + (head // p.dbias_head_div).to(gl.int64) * p.stride_dbh


@gluon.jit
def _flush_key_gradient(p, chunk, batch, head, keys, values, written):
    """Write (or add, when programs share the row) a head's per-key bias gradient at ``keys``, those ``written``."""
    ptrs = _bias_gradient_row(p, chunk, batch, head) + keys.to(gl.int64) * p.stride_dbk
    if p.DBIAS_ATOMIC:
        gl.atomic_add(ptrs, values, mask=written)
    else:
        gl.store(ptrs, values, mask=written)


@gluon.jit
def _flush_pair_gradient(p, bufs, batch, head, keys, rows, first_key, first_row, values, HALF: gl.constexpr):
    """Write (or add, when programs share it) a tile ``[keys, rows]`` of a per-pair bias gradient:
    with STAGED_DBIAS through the warpgroup's staging tile and a TMA store (once its last store
    has read the tile), else element by element."""
    if p.STAGED_DBIAS:
        staging = bufs.dbias.index(HALF)  # [1, rows, keys]
        tma.store_wait(0)
        cta_barrier()  # the thread that issued the last store has seen it read the tile
        staging.reshape([p.BLOCK_M, p.BLOCK_N // 2]).permute((1, 0)).store(values.to(p.DBias.dtype.element_ty))
        fence_async_shared()
        # Rows past Sq are clipped at the (batch, head)'s own end: the next one's rows follow them.
        first = staged_pair_row(p.DBias, p.stride_dbb, p.stride_dbh, p.stride_dbq, p.dbias_head_div, batch, head, 0)
        tma_store(p.dbias_desc, [first // p.seqlen_q, first_row, first_key], staging)
    else:
        ptrs = _bias_gradient_row(p, 0, batch, head) + pair_offsets(rows, keys, p.stride_dbq, True)
        inside = pair_inside(p, rows, keys, True)
        if p.DBIAS_ATOMIC:
            gl.atomic_add(ptrs, values, mask=inside, sem="relaxed")
        else:
            gl.store(ptrs, values.to(p.DBias.dtype.element_ty), mask=inside)


@gluon.jit
def _store_gradient(p, target, scratch, chunk, offsets, values, ok):
    """dK or dV of a warpgroup's keys: into ``target`` with one query chunk; with several, each
    chunk's into a slice of ``scratch`` of its own (SLICES: every item writes, empty ones zeros) or
    added into ``scratch`` by atomics."""
    if p.chunks == 1:
        gl.store(target + offsets, values.to(target.dtype.element_ty), mask=ok)
    elif p.SLICES:
        slice_offset = chunk.to(gl.int64) * p.batch * p.seqlen_k * p.num_kv_heads * p.COLUMNS
        gl.store(scratch + slice_offset + offsets, values, mask=ok)
    else:
        _add_pairs(scratch + offsets, values, ok)


@gluon.jit
def _add_pairs(ptrs, values, mask):
    """``*ptrs += values`` where ``mask``, by relaxed fp32 atomics two elements at a time
    (``red.global.add.v2.f32``, sm_90): one L2 operation where ``gl.atomic_add`` makes two. The
    pairs are each thread's consecutive elements, which a wgmma accumulator's layout makes two
    neighbouring columns: 8-byte aligned in the contiguous scratch, as every head dim is even
    (``common.HEAD_DIMS``), and masked alike. The L2's atomics set the pace of the chunks'
    additions (docs/design-notes.md, "dK/dV: the chunks' additions, two columns at a time")."""
    gl.inline_asm_elementwise(
        """{
        .reg .b32 both;
        .reg .pred add;
        and.b32 both, $6, $7;
        setp.ne.b32 add, both, 0;
        @add red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        }""",
        "=r,=r,l,l,r,r,r,r", [ptrs.to(gl.int64, bitcast=True), values, mask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=2,
    )


@gluon.jit
def _gradient_item(p, bufs, index, count, kv_taken, consumed, HALF: gl.constexpr):
    """Work item ``index`` (``count`` query tiles) for this warpgroup (``_gradient_keys``), its K/V
    from buffer position ``kv_taken`` and its query tiles from ring position ``consumed``: returns
    both positions after it."""
    KEYS: gl.constexpr = p.BLOCK_N if p.ROLES else p.BLOCK_N // 2
    FIRST: gl.constexpr = 0 if p.ROLES else HALF * KEYS  # this warpgroup's first key in the item
    OWNS_DV: gl.constexpr = not p.ROLES or HALF == 0
    OWNS_DK: gl.constexpr = not p.ROLES or HALF == 1
    D: gl.constexpr = p.HEAD_DIM
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = p.q_desc.dtype

    key_tile, chunk, batch, kv_head = _column_position(p, index, p.chunks)
    span = entry_span(p, batch)
    first_key = key_tile * p.BLOCK_N + FIRST  # the first slot (a key, unless a key list is walked)
    keys, kept, k_first, k_last = _column_keys(p, first_key, batch, kv_head, span, KEYS, keys_of_s)  # [KEYS]
    dk = gl.zeros([KEYS, D], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, D], gl.float32, acc_layout)
    dbias = gl.zeros([KEYS], gl.float32, keys_of_s)
    dbias_tile = gl.zeros([KEYS, p.BLOCK_M], gl.float32, s_layout)  # a tile's dS over the group's heads
    head = kv_head * p.group
    if count > 0:
        kv = kv_taken % p.KV_BUFFERS
        mbarrier.wait(bufs.kv_ready.index(kv), (kv_taken // p.KV_BUFFERS) & 1)
        k = bufs.k.index(kv).reshape([p.BLOCK_N, D]).slice(FIRST, KEYS)  # [KEYS, D]
        v = bufs.v.index(kv).reshape([p.BLOCK_N, D]).slice(FIRST, KEYS)
        key_scores = _key_scores(p, batch, head, keys, _slots_below(first_key, kept, KEYS, keys_of_s))
        if p.MASK == MASK_INTERVALS:  # the warpgroup's keys' rows, read once per head
            start, end = _item_intervals(p, batch, head, keys)
        for _ in range(count):
            stage = consumed % p.Q_STAGES
            mbarrier.wait(bufs.q_ready.index(stage), (consumed // p.Q_STAGES) & 1)
            g = get(bufs.heads.index(stage))
            tile_head = kv_head * p.group + g
            if tile_head != head:  # the loader walks the group's heads in order (or, HEADS_INNER, in turn)
                if (p.DBIAS == _PER_KEY) and (not p.DBIAS_HEAD_SHARED) and OWNS_DK:
                    _flush_key_gradient(p, chunk, batch, head, keys, dbias, _slots_below(first_key, span.seqlen_k, KEYS, keys_of_s))
                    dbias = gl.zeros([KEYS], gl.float32, keys_of_s)
                head = tile_head
                key_scores = _key_scores(p, batch, head, keys, _slots_below(first_key, kept, KEYS, keys_of_s))
                if p.MASK == MASK_INTERVALS:
                    start, end = _item_intervals(p, batch, head, keys)
            q = bufs.q.index(stage).reshape([p.BLOCK_M, D])
            do = bufs.do.index(stage).reshape([p.BLOCK_M, D])
            zeros = gl.zeros([KEYS, p.BLOCK_M], gl.float32, s_layout)
            st = warpgroup_mma(k, q.permute((1, 0)), zeros, use_acc=False, is_async=True)  # [KEYS, BLOCK_M]
            if OWNS_DK:  # dP is for dS, which dK takes
                dpt = warpgroup_mma(v, do.permute((1, 0)), zeros, use_acc=False, is_async=True)  # [KEYS, BLOCK_M]
            first_row = get(bufs.tiles.index(stage)) * p.BLOCK_M
            rows = first_row + gl.arange(0, p.BLOCK_M, rows_of_s)  # [BLOCK_M]
            st = warpgroup_mma_wait(1 if OWNS_DK else 0, deps=[st])
            s = log2_scores(p, st) + key_scores[:, None]
            if pair_bias_staged(p.BIAS, p.STAGED_BIAS):
                staged = bufs.bias.index(stage).slice(HALF * KEYS, KEYS, dim=1).permute((1, 0))  # [KEYS, BLOCK_M]
                s = s + staged.load(s_layout).to(gl.float32) * tiles.LOG2E
            elif p.BIAS == BIAS_PAIRS:
                s = s + pair_bias(p, batch, head, rows, keys, True)
            if p.MASK == MASK_BITS:
                if get(bufs.partial.index(stage)) != 0:
                    s = kept_by_bits(p, s, bufs.words.index(stage), batch, head, first_row, first_key, True, HALF)
            if p.MASK == MASK_INTERVALS:
                if get(bufs.partial.index(stage)) != 0:
                    runs = (start[:, None] <= rows[None, :]) & (rows[None, :] < end[:, None])  # [KEYS, BLOCK_M]
                    s = gl.where(runs, s, float("-inf"))
            # Only tiles that the band cuts need checks (keys past the end score -inf, rows past
            # the end have LSE +inf).
            if (k_first - first_row - p.BLOCK_M + 1 < span.band_lo) | (k_last - first_row > span.band_hi):
                offset = keys[:, None] - rows[None, :]
                s = gl.where((offset >= span.band_lo) & (offset <= span.band_hi), s, float("-inf"))
            pt = gl.exp2(s - bufs.lse.index(stage).load(rows_of_s)[None, :])
            if OWNS_DK:
                dpt = warpgroup_mma_wait(0, deps=[dpt])
                ds = pt * (dpt - bufs.delta.index(stage).load(rows_of_s)[None, :])
                if p.DBIAS == _PER_KEY:
                    dbias += gl.sum(ds, 1)
                if p.DBIAS == _FULL:
                    if p.HEADS_INNER:
                        dbias_tile += ds
                        if g == p.group - 1:
                            _flush_pair_gradient(p, bufs, batch, head, keys, rows, first_key, first_row, dbias_tile, HALF)
                            dbias_tile = gl.zeros([KEYS, p.BLOCK_M], gl.float32, s_layout)
                    else:
                        _flush_pair_gradient(p, bufs, batch, head, keys, rows, first_key, first_row, ds, HALF)
                if p.SOFTCAP:
                    ds = ds * softcap_slope(p, st)  # after the bias gradient, which is dS itself
            # Both products are issued once S^T and dP^T are spent: their registers hold P^T and dS^T.
            if OWNS_DV and OWNS_DK:
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), operand_layout), do, dv, is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds.to(dtype), operand_layout), q, dk, is_async=True)
                dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
            elif OWNS_DV:
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), operand_layout), do, dv, is_async=True)
                dv = warpgroup_mma_wait(0, deps=[dv])
            else:
                dk = warpgroup_mma(gl.convert_layout(ds.to(dtype), operand_layout), q, dk, is_async=True)
                dk = warpgroup_mma_wait(0, deps=[dk])
            mbarrier.arrive(bufs.q_empty.index(stage), count=1)
            consumed += 1
        mbarrier.arrive(bufs.kv_empty.index(kv), count=1)
        kv_taken += 1
        if (p.DBIAS == _PER_KEY) and OWNS_DK:
            _flush_key_gradient(p, chunk, batch, head, keys, dbias, _slots_below(first_key, span.seqlen_k, KEYS, keys_of_s))

    if OWNS_DK:
        dk = dk * p.scale  # dS is the gradient of scale * q.k
    # One chunk writes dK and dV at the keys' rows (zeros for a key list's dropped keys); several
    # add into the chunk sums' rows of the slots (``sums_shape``), the kept ones alone, as
    # ``write_gradients`` reads no others.
    out_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
    direct = p.chunks == 1
    slots = first_key + gl.arange(0, KEYS, out_rows)  # [KEYS]
    rows = gl.where(direct, gl.convert_layout(keys, out_rows), slots)
    cols = gl.arange(0, D, gl.SliceLayout(0, acc_layout))
    offsets = (
        span.tokens.to(gl.int64) * p.stride_gb + kv_head * p.stride_gh
        + ((span.k_start + rows).to(gl.int64) * p.stride_gs)[:, None] + cols[None, :]
    )
    ok = (slots < gl.where(direct, span.seqlen_k, kept))[:, None] & (cols < p.COLUMNS)[None, :]
    if OWNS_DK:
        _store_gradient(p, p.DK, p.ScratchK, chunk, offsets, dk, ok)
    if OWNS_DV:
        _store_gradient(p, p.DV, p.ScratchV, chunk, offsets, dv, ok)
    return kv_taken, consumed


@gluon.jit
def _gradient_keys(p, bufs, HALF: gl.constexpr):
    """One warpgroup: keys ``[HALF * 64, HALF * 64 + 64)`` of every work item it takes, their dK
    and dV; with ROLES every key of the item, their dV (HALF 0) or their dK and the bias gradient
    (HALF 1). Tiles are ``[keys, queries]``."""
    taken = 0
    kv_taken = 0
    consumed = 0  # Q/dO tiles so far: the ring position, as in the loader
    index, count = _take(bufs, taken)
    while index >= 0:
        taken += 1
        kv_taken, consumed = _gradient_item(p, bufs, index, count, kv_taken, consumed, HALF)
        index, count = _take(bufs, taken)
    if p.STAGED_DBIAS:
        tma.store_wait(0)  # the staging tile lives in shared memory, which ends with the program


@gluon.jit
def _gradient_lower(p, bufs):
    _gradient_keys(p, bufs, 0)


@gluon.jit
def _gradient_upper(p, bufs):
    _gradient_keys(p, bufs, 1)


@jit_with_runtime_scalars
def _dkdv_hopper_kernel(
    Q, K, V, Mask, Bias, Walk, SeqQ, SeqK,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_mb, stride_mh, stride_mq, stride_mk, stride_bb, stride_bh, stride_bq, stride_bk,
    stride_wb, stride_wh, stride_wr, walk_width, mask_rows, mask_cols, bias_rows, bias_cols,
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group,
    mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k, band_lo, band_hi, scale, scale_log2,
    softcap_log2, scale_over_cap,
    MASK: gl.constexpr, BIAS: gl.constexpr, WALK: gl.constexpr, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr,
    STAGED_BIAS: gl.constexpr,
    SOFTCAP: gl.constexpr,
    DO, Lse, Delta, DK, DV, ScratchK, ScratchV, DBias, Queue,
    stride_dob, stride_dos, stride_doh, stride_gb, stride_gs, stride_gh,
    stride_dbc, stride_dbb, stride_dbh, stride_dbq, stride_dbk, dbias_head_div, dbias_rows, chunks, items, counted, entries,
    DBIAS: gl.constexpr, DBIAS_ATOMIC: gl.constexpr, DBIAS_HEAD_SHARED: gl.constexpr, SLICES: gl.constexpr,
    Q_STAGES: gl.constexpr, KV_BUFFERS: gl.constexpr, ROLES: gl.constexpr, SEQ: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    # Descriptors of the whole [B, S, heads, D] tensors, made once per (persistent) program.
    q_desc = tile_descriptor(Q, batch, seqlen_q, num_heads, COLUMNS, stride_qb, stride_qs, stride_qh, BLOCK_M, BLOCK_M, HEAD_DIM)
    do_desc = tile_descriptor(DO, batch, seqlen_q, num_heads, COLUMNS, stride_dob, stride_dos, stride_doh, BLOCK_M, BLOCK_M, HEAD_DIM)
    k_desc = tile_descriptor(K, batch, seqlen_k, num_kv_heads, COLUMNS, stride_kb, stride_ks, stride_kh, BLOCK_N, BLOCK_N, HEAD_DIM)
    v_desc = tile_descriptor(V, batch, seqlen_k, num_kv_heads, COLUMNS, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_N, HEAD_DIM)
    words_desc, bias_desc = staged_descriptors(
        Mask, Bias, q_desc, mask_rows, mask_cols, bias_rows, bias_cols, stride_mq, stride_bq, MASK, BIAS, STAGED_BIAS, BLOCK_M, BLOCK_N,
    )
    words, bias = staged_buffers(words_desc, bias_desc, Bias, MASK, BIAS, STAGED_BIAS, Q_STAGES, BLOCK_N)
    # A per-pair bias gradient written once per element leaves as the bias came in: by TMA.
    STAGED_DBIAS: gl.constexpr = (
        pair_bias_staged(BIAS, STAGED_BIAS) and DBIAS == _FULL and not DBIAS_ATOMIC and DBias.dtype.element_ty == Bias.dtype.element_ty
    )
    dbias_desc = q_desc
    dbias = gl.allocate_shared_memory(gl.int32, [1, 1], PLAIN)
    if STAGED_DBIAS:
        dbias_desc = tma.make_tensor_descriptor(
            DBias, [dbias_rows // seqlen_q, seqlen_q, seqlen_k], [seqlen_q * stride_dbq, stride_dbq, 1], [1, BLOCK_M, BLOCK_N // 2],
            gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, BLOCK_N // 2], DBias.dtype.element_ty),
        )
        dbias = gl.allocate_shared_memory(dbias_desc.dtype, [2] + dbias_desc.block_type.shape, dbias_desc.layout)
    barrier: gl.constexpr = mbarrier.MBarrierLayout()
    bufs = _Buffers(
        gl.allocate_shared_memory(gl.int32, [2, 1], PLAIN),
        gl.allocate_shared_memory(gl.int32, [2, 1], PLAIN),
        gl.allocate_shared_memory(k_desc.dtype, [KV_BUFFERS] + k_desc.block_type.shape, k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [KV_BUFFERS] + v_desc.block_type.shape, v_desc.layout),
        gl.allocate_shared_memory(q_desc.dtype, [Q_STAGES] + q_desc.block_type.shape, q_desc.layout),
        gl.allocate_shared_memory(do_desc.dtype, [Q_STAGES] + do_desc.block_type.shape, do_desc.layout),
        words,
        bias,
        dbias,
        gl.allocate_shared_memory(gl.int32, [Q_STAGES, 1], PLAIN),
        gl.allocate_shared_memory(gl.int32, [Q_STAGES, 1], PLAIN),
        gl.allocate_shared_memory(gl.int32, [Q_STAGES, 1], PLAIN),
        gl.allocate_shared_memory(gl.float32, [Q_STAGES, BLOCK_M], PLAIN),
        gl.allocate_shared_memory(gl.float32, [Q_STAGES, BLOCK_M], PLAIN),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [2, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], barrier),
    )
    for i in gl.static_range(2):
        mbarrier.init(bufs.item_ready.index(i), count=1)
        mbarrier.init(bufs.item_empty.index(i), count=2)  # both gradient warpgroups release it
    for i in gl.static_range(KV_BUFFERS):
        mbarrier.init(bufs.kv_ready.index(i), count=1)
        mbarrier.init(bufs.kv_empty.index(i), count=2)
    for i in gl.static_range(Q_STAGES):
        mbarrier.init(bufs.q_ready.index(i), count=1)
        mbarrier.init(bufs.q_empty.index(i), count=2)
    # A per-pair gradient the group's heads share is added up in registers, a tile's heads in turn.
    HEADS_INNER: gl.constexpr = DBIAS == _FULL and DBIAS_HEAD_SHARED and not DBIAS_ATOMIC
    p = _Problem(
        q_desc, k_desc, v_desc, do_desc, words_desc, bias_desc, dbias_desc, Lse, Delta, Mask, Bias, Walk, DK, DV, ScratchK, ScratchV, DBias, Queue,
        SeqQ, SeqK,
        stride_mb, stride_mh, stride_mq, stride_mk, stride_bb, stride_bh, stride_bq, stride_bk,
        stride_wb, stride_wh, stride_wr, walk_width,
        stride_gb, stride_gs, stride_gh, stride_dbc, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
        batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group, chunks, items, counted, entries,
        mask_head_div, bias_head_div, walk_head_div, dbias_head_div, list_block_q, list_block_k,
        band_lo, band_hi, scale, scale_log2, softcap_log2, scale_over_cap,
        MASK, BIAS, WALK, DBIAS, DBIAS_ATOMIC, DBIAS_HEAD_SHARED, HEADS_INNER, HEAD_DIM, COLUMNS, STAGED_BIAS, STAGED_DBIAS, SOFTCAP, SLICES, Q_STAGES,
        KV_BUFFERS, ROLES, SEQ, BLOCK_M, BLOCK_N,
    )
    let_next_kernel_start()  # dQ (``dq.hopper_dq``): its programs take the multiprocessors this kernel's free
    gl.warp_specialize(
        [(_gradient_lower, (p, bufs)), (_gradient_upper, (p, bufs)), (_load_columns, (p, bufs))],
        [4, 1], [MATH_REGISTERS, LOADER_REGISTERS],
    )


hopper_dkdv_launcher = Launcher(
    _dkdv_hopper_kernel,
    tensors=(*COMMON_TENSORS, "SeqQ", "SeqK", "DO", "Lse", "Delta", "DK", "DV", "ScratchK", "ScratchV", "DBias", "Queue"),
    specialized=(),
)


# Columns counted at once by ``count_columns``. Its registers set the whole preprocess kernel's
# (``tools/compile_report.py``, sm90: 168 and 4 bytes of spills at 1024 columns, 64 at 256, 36 without the count).
_WORK_COLUMNS = tl.constexpr(256)


@triton.jit
def _column_work(
    Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, b, kv_head, key_tile, seqlen_q, seqlen_k, group,
    walks, list_block_q, list_block_k, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The query tiles of the columns (``b``, ``kv_head``, ``key_tile``), scalars or alike
    tensors, over the group's heads, walking a block summary (``tiles.query_walk``): ``walks``
    per column, one for a group whose heads share it (``layout.walks_per_group``)."""
    first_key = key_tile * BLOCK_N
    base = Walk + b.to(tl.int64) * stride_wb
    work = key_tile * 0
    for g in range(0, walks):
        walk = base + ((kv_head * group + g) // walk_head_div).to(tl.int64) * stride_wh
        _, _, _, partial_lo, partial_hi, lo, _, _, hi = tiles.query_walk(
            walk, walk_width, stride_wr, key_tile, first_key, first_key + BLOCK_N - 1, seqlen_q, seqlen_k, band_lo, band_hi,
            list_block_q, list_block_k, 0, 1, tiles.WALK_BLOCKS, BLOCK_M, BLOCK_N,
        )
        work += (partial_hi - partial_lo) + (hi - lo)
    return work * (group // walks)


@triton.jit
def count_columns(
    Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_q, seqlen_k, num_kv_heads, group,
    walks, list_block_q, list_block_k, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The work of the columns (key tile, batch entry, key/value head) of a dK/dV call that walks
    a block summary over fixed sequences, for ``_counted_chunks``: ``(longest, total)``, the most
    query tiles (over the group's heads) a column has and their sum. One program counts every
    column (``_column_work``), ``_WORK_COLUMNS`` at a time. It runs in the backward's preprocess
    (``backward._preprocess_kernel``), beside the delta pass, which reads far more per column."""
    key_tiles = tl.cdiv(seqlen_k, BLOCK_N)
    columns = batch * num_kv_heads * key_tiles
    longest = tl.full([], 0, tl.int32)
    total = tl.full([], 0, tl.int32)
    for first in range(0, columns, _WORK_COLUMNS):
        index = first + tl.arange(0, _WORK_COLUMNS)  # [COLUMNS]
        inside = index < columns
        index = tl.minimum(index, columns - 1)
        batch_head = index // key_tiles
        work = _column_work(
            Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch_head // num_kv_heads,
            batch_head % num_kv_heads, index % key_tiles, seqlen_q, seqlen_k, group, walks, list_block_q, list_block_k,
            band_lo, band_hi, BLOCK_M, BLOCK_N,
        )
        work = tl.where(inside, work, 0)
        longest = tl.maximum(longest, tl.max(work, 0))
        total += tl.sum(work, 0)
    return longest, total


@triton.jit
def _list_row(KeyList, stride_wb, stride_wh, walk_head_div, b, kv_head, group):
    """Where the key list's order of (``b``, ``kv_head``) starts: the first of its group's query
    heads' (``key_list.py``: ``[..., 0, :Sk]`` the order, ``[..., 1, :]`` the rank, ``walk_width``
    apart)."""
    return KeyList + b.to(tl.int64) * stride_wb + (kv_head * group // walk_head_div).to(tl.int64) * stride_wh


@triton.jit
def column_live(
    Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_k, num_kv_heads, group, walks,
    list_block_q, list_block_k, band_lo, band_hi, seqlen_q, b, kv_head, slots,
    LIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Whether the dK/dV kernel adds to the chunk sums' rows of ``slots`` (a scalar, or a tensor
    within one key tile) of (``b``, ``kv_head``): with LIVE (``live_walk``) WALK_KEYS, the slots
    below the key list ``Walk``'s kept count; WALK_BLOCKS, every slot of a column with query
    tiles in the block summary ``Walk`` (``_column_work``); WALK_DENSE, all. The other rows are
    never added to, so they need no zeroing, and read as zeros (``write_gradients``)."""
    if LIVE == tiles.WALK_KEYS:
        rank = _list_row(Walk, stride_wb, stride_wh, walk_head_div, b, kv_head, group) + walk_width
        return slots < tl.load(rank + seqlen_k)  # the rank of position Sk: the kept count
    elif LIVE == tiles.WALK_BLOCKS:
        work = _column_work(
            Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, b, kv_head, slots // BLOCK_N, seqlen_q, seqlen_k,
            group, walks, list_block_q, list_block_k, band_lo, band_hi, BLOCK_M, BLOCK_N,
        )
        return work > 0
    else:
        return slots >= 0


@triton.jit
def sums_words_live(
    Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_k, num_kv_heads, group, walks,
    list_block_q, list_block_k, band_lo, band_hi, seqlen_q, head_dim, first,
    WORDS: tl.constexpr, LIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Whether any of ``WORDS`` words from ``first`` on, counted from the start of dK's and dV's
    chunk sums ``[2, B, Hkv, Sk, D]`` (``sums_shape``), lies in a row the dK/dV kernel adds to
    (``column_live``). Words outside the sums, or over two columns, count as live."""
    run = seqlen_k.to(tl.int64) * head_dim  # the words of one (dK or dV, batch entry, key/value head)
    start = tl.maximum(first, 0)
    last = first + WORDS - 1
    slot = start % run // head_dim
    within = (
        (first >= 0) & (last < 2 * batch * num_kv_heads * run) & (start // run == last // run)
        & (slot // BLOCK_N == last % run // head_dim // BLOCK_N)
    )
    entry = start // run % (batch * num_kv_heads)
    live = column_live(
        Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_k, num_kv_heads, group, walks,
        list_block_q, list_block_k, band_lo, band_hi, seqlen_q, entry // num_kv_heads, entry % num_kv_heads, slot.to(tl.int32),
        LIVE, BLOCK_M, BLOCK_N,
    )
    return (not within) | live


def _tile(head_dim: int) -> triton.Config:
    """The kernel's configuration at ``head_dim``."""
    return WIDE_TILE if wide_tiles(head_dim) else TILE


def live_walk(call: Call, sequences: Sequences | None) -> int:
    """The walk by which the preprocess and ``write_gradients`` tell the chunk sums' rows the
    kernel adds to from the others (``column_live``): a key list's or a block summary's, over fixed
    sequences; else WALK_DENSE, every row."""
    if sequences is not None:
        return tiles.WALK_DENSE.value
    if call.key_list is not None:
        return tiles.WALK_KEYS.value
    return tiles.WALK_DENSE.value if call.q_lists is None else tiles.WALK_BLOCKS.value


def walked(call: Call, walk: int) -> torch.Tensor | None:
    """The tensor of ``call`` that the walk ``walk`` (a ``tiles.WALK_*``) reads, as ``count_columns``
    and ``column_live`` do: ``call.q_lists``, the transposed block summary ``[Bm, Hm, NKB, 2, 2,
    NQB + 1]``, or ``call.key_list``; None for WALK_DENSE."""
    if walk == tiles.WALK_BLOCKS.value:
        return call.q_lists
    return call.key_list if walk == tiles.WALK_KEYS.value else None


def walk_arguments(call: Call, walk: int) -> tuple[list, tuple[int, int]]:
    """The int arguments of ``count_columns`` and ``column_live`` up to ``band_hi`` for the walk
    ``walk`` of ``call`` (``walked``; for WALK_DENSE the sizes alone), and the kernel's tile
    ``(BLOCK_M, BLOCK_N)``."""
    q, k = call.q, call.k
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    tile = _tile(head_dim)
    tile_sizes = (tile.kwargs["BLOCK_M"], tile.kwargs["BLOCK_N"])
    walk_tensor = walked(call, walk)
    sizes = [batch, seqlen_k, num_kv_heads, num_heads // num_kv_heads]
    if walk_tensor is None:
        return [0, 0, 0, 0, 1, *sizes, 1, 0, 0, 0, 0], tile_sizes
    args = [
        *broadcast_strides(walk_tensor)[:3], walk_tensor.shape[-1], head_divisor(walk_tensor, num_heads), *sizes,
        walks_per_group(walk_tensor, num_heads, num_kv_heads), call.list_block_q, call.list_block_k,
        *launch_band(call, seqlen_q, seqlen_k, tiles.SEQ_FIXED),
    ]
    return args, tile_sizes


def sums_shape(call: Call) -> tuple[int, int, int, int]:
    """How the chunk sums of dK (and of dV) lie in memory: ``[B, Hkv, Sk, D]``, rows of the
    items' slots (``write_gradients``), each column's rows together, so that the preprocess zeroes
    and ``write_gradients`` reads only those the kernel adds to (``column_live``)."""
    batch, seqlen_k, num_kv_heads, head_dim = call.k.shape
    return batch, num_kv_heads, seqlen_k, head_dim


def sums_view(sums: torch.Tensor) -> torch.Tensor:
    """Chunk sums laid out as ``sums_shape`` says (behind any leading dims), seen as ``[..., B, Sk, Hkv, D]``."""
    return sums.transpose(-3, -2)


_WRITE_SLOTS = 32  # slots of one (batch entry, key/value head) per program of ``_write_gradients_kernel``


@triton.jit
def _write_gradient(Parts, Out, parts_rows, out_rows, cols, read, write, stride_chunk, CHUNKS: tl.constexpr):
    """Rows ``out_rows`` of ``Out`` (where ``write``): the sum of their ``CHUNKS`` fp32 parts at
    ``parts_rows`` of ``Parts``, ``stride_chunk`` apart, added in chunk order (zeros where not ``read``)."""
    acc = tl.load(Parts + parts_rows[:, None] + cols[None, :], mask=read, other=0.0)  # [SLOTS, BLOCK_D]
    for c in tl.static_range(1, CHUNKS):
        acc += tl.load(Parts + c * stride_chunk + parts_rows[:, None] + cols[None, :], mask=read, other=0.0)
    tl.store(Out + out_rows[:, None] + cols[None, :], acc.to(Out.dtype.element_ty), mask=write)


@triton.jit(do_not_specialize=[
    "stride_wb", "stride_wh", "stride_wr", "walk_width", "walk_head_div", "batch", "seqlen_k", "num_kv_heads", "group",
    "walks", "list_block_q", "list_block_k", "band_lo", "band_hi", "seqlen_q",
])
def _write_gradients_kernel(
    Sums, DK, DV, Walk,
    stride_sp, stride_sc, stride_sb, stride_ss, stride_sh, stride_gb, stride_gs, stride_gh, head_dim,
    stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_k, num_kv_heads, group, walks,
    list_block_q, list_block_k, band_lo, band_hi, seqlen_q,
    CHUNKS: tl.constexpr, LIVE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK and dV ``[B, Sk, Hkv, D]``, ``SLOTS`` rows of one (batch entry, key/value head) per
    program, from their chunks' fp32 parts ``Sums`` ``[2, CHUNKS, B, Sk, Hkv, D]`` (any strides),
    whose rows are the dK/dV kernel's slots: with LIVE WALK_KEYS, those of the key list ``Walk``
    (``key_list.py``), so that slot ``s``'s row goes to the key ``order[s]``. Only the rows the
    kernel added to are read (``column_live``); the others are zeros."""
    tl.static_assert(BLOCK_N % SLOTS == 0)  # a program's slots lie in one key tile (``column_live``)
    slots = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)  # [SLOTS]
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    inside = slots < seqlen_k
    live = inside & column_live(
        Walk, stride_wb, stride_wh, stride_wr, walk_width, walk_head_div, batch, seqlen_k, num_kv_heads, group, walks,
        list_block_q, list_block_k, band_lo, band_hi, seqlen_q, b, kv_head, slots, LIVE, BLOCK_M, BLOCK_N,
    )
    keys = slots
    if LIVE == tiles.WALK_KEYS:
        keys = tl.load(_list_row(Walk, stride_wb, stride_wh, walk_head_div, b, kv_head, group) + slots, mask=inside, other=0)
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    columns = (cols < head_dim)[None, :]
    parts = b.to(tl.int64) * stride_sb + kv_head * stride_sh + slots.to(tl.int64) * stride_ss  # [SLOTS]
    out = b.to(tl.int64) * stride_gb + kv_head * stride_gh + keys.to(tl.int64) * stride_gs  # [SLOTS]
    read, write = live[:, None] & columns, inside[:, None] & columns  # [SLOTS, BLOCK_D]
    _write_gradient(Sums, DK, parts, out, cols, read, write, stride_sc, CHUNKS)
    _write_gradient(Sums + stride_sp, DV, parts, out, cols, read, write, stride_sc, CHUNKS)


_write_gradients_launcher = Launcher(
    _write_gradients_kernel, tensors=("Sums", "DK", "DV", "Walk"),
    specialized=("stride_sp", "stride_sc", "stride_sb", "stride_ss", "stride_sh", "stride_gb", "stride_gs", "stride_gh", "head_dim"),
)


def write_gradients(sums: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, call: Call, live: int, signature: tuple) -> None:
    """Write ``dk`` and ``dv`` ``[B, Sk, Hkv, D]`` from their chunks' fp32 parts ``sums``
    ``[2, B, Sk, Hkv, D]``, added up by atomics, or ``[2, chunks, B, Sk, Hkv, D]``, slices summed
    in chunk order (the same bits on every run); any strides, one launch for both. Reads only the
    rows the dK/dV kernel of ``call`` added to, by the walk ``live`` (``live_walk``; zeros for the
    others); walking a key list, row ``s`` of ``sums`` holds the sums of the key ``order[s]``.
    ``signature``: the call's layout (``backward.attention_backward``'s); the launch is prepared once per signature."""
    slices = sums.dim() == dk.dim() + 2
    chunks = sums.shape[1] if slices else 1
    batch, seqlen_k, num_kv_heads, head_dim = dk.shape
    walk_tensor = walked(call, live)
    walk = placeholder(dk.device, torch.int32) if walk_tensor is None else walk_tensor

    def build():
        walk_args, tile = walk_arguments(call, live)
        args = [
            sums, dk, dv, walk, sums.stride(0), sums.stride(1) if slices else 0, *sums.stride()[-4:-1], *dk.stride()[:3], head_dim,
            *walk_args, call.q.shape[1], chunks, live, _WRITE_SLOTS, configs.head_dim_block(head_dim), *tile,
        ]
        return args, (dk.dtype, chunks, live)

    # The walk's arguments follow from the call's layout, which ``signature`` holds.
    layout = (signature, sums.shape, sums.stride(), dk.dtype, dk.stride(), live)
    _write_gradients_launcher.launch(
        layout, [sums, dk, dv, walk], build, configs.single_program_config,
        lambda meta: (cdiv(seqlen_k, _WRITE_SLOTS), num_kv_heads, batch),
    )


def hopper_dkdv(
    call: Call, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    dbias_acc: torch.Tensor | None, dbias_flags: tuple, chunks: int, counted: bool, queue: torch.Tensor,
    sums: torch.Tensor | None, kept: tuple[torch.Tensor, torch.Tensor], signature: tuple, sequences: Sequences | None = None,
) -> Callable[[], None]:
    """Write ``dk`` and ``dv`` ``[B, Sk, Hkv, D]`` of ``call`` (and the bias gradient into
    ``dbias_acc``, zeroed: ``[chunks, Bd, Hd, 1, Sk]`` float32 per key, ``[1, Bd, Hd, Sq, Sk]``
    per pair, in the bias's dtype unless added by atomics), as ``backward._launch_dkdv`` would.
    Packed sequences: ``[1, total, ...]`` tokens, ``[1, H, total]`` LSE and delta, and per-key
    bias gradients per sequence (``Bd`` = N, ``Sk`` = the longest).

    ``dout`` ``[B, Sq, H, D]``; ``lse``, ``delta`` ``[B, H, Sq]`` float32, contiguous;
    ``dbias_flags`` is ``(kind, atomic, head_shared)`` of ``backward.bias_gradient``;
    ``chunks`` splits each key tile's queries (``counted``: into at most ``chunks``, as many as
    the columns' work wants, ``count_columns``); their parts add up by atomics into ``sums``
    ``[2, *sums_shape(call)]`` float32 (dK's, then dV's; zeroed where the kernel adds,
    ``column_live``; None with one chunk or deterministic), or, for a deterministic call, go to
    fp32 slices (``chunks`` times dK and dV in memory), summed in chunk order. ``queue`` ``[3]``
    int32: the queue's counter, zeroed, then ``count_columns``'s counts; ``kept`` the keys
    ``common.kept_keys`` gave (a key list's, gathered once for dK/dV and dQ). ``signature`` holds
    the layouts of the call, of ``dout`` and of the gradients (``backward.attention_backward``'s):
    the launch is prepared once per signature.

    Returns what finishes dK and dV (the chunks' fp32 parts written into them), to run after the
    launch that goes right behind this one (``dq.hopper_dq``); what the kernel reads is kept
    until the caller's ``launch.kernels_side_by_side`` block ends.
    """
    q, k, v = call.q, call.k, call.v
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    device = q.device
    # Work items span each entry's key tiles; packed sequences get those of the longest, and the
    # tiles past a shorter one's keys have no query tiles (``_head_walk``).
    entries, _, keys, seq_tables, seq = entry_tables(call, sequences)
    wide = wide_tiles(head_dim)
    tile = _tile(head_dim)
    items = chunks * cdiv(keys, tile.kwargs["BLOCK_N"]) * entries * num_kv_heads
    slices = call.deterministic and chunks > 1
    scratch = None
    scratch_k = scratch_v = placeholder(device, torch.float32)
    if slices:  # dK's, then dV's [chunks, B, Sk, Hkv, D], every element written once
        scratch = sums_view(torch.empty((2, chunks, *sums_shape(call)), dtype=torch.float32, device=device))
    elif chunks > 1:
        scratch = sums_view(sums)
    if scratch is not None:
        scratch_k, scratch_v = scratch
    dbias_target = placeholder(device, torch.float32) if dbias_acc is None else dbias_acc
    k, v, walk, walk_flag = walked_keys(call, call.q_lists, kept)
    hold(k, v, walk)
    tensors = hopper_tensors(call, k, v, walk)
    own_tensors = [dout, lse, delta, dk, dv, scratch_k, scratch_v, dbias_target, queue]

    def build():
        runtime, flags = hopper_arguments(call, k, v, walk, walk_flag, seq)
        dbias_slice = None if dbias_acc is None else dbias_acc[0]
        own = [
            *dout.stride()[:3], *(dk.stride()[:3] if scratch is None else scratch_k.stride()[-4:-1]),
            0 if dbias_acc is None or dbias_acc.shape[0] == 1 else dbias_acc.stride(0), *broadcast_strides(dbias_slice),
            head_divisor(dbias_slice, num_heads), 0 if dbias_slice is None else dbias_slice.numel() // seqlen_k,
            chunks, items, int(counted), entries, *dbias_flags, slices, Q_STAGES[head_dim_tile(head_dim)], 1 if wide else 2, wide, seq,
        ]
        return [*tensors, *seq_tables, *runtime, *flags, *own_tensors, *own], (q.dtype, dk.dtype, *flags, *dbias_flags, slices)

    hopper_dkdv_launcher.launch(
        (signature, chunks, counted, dbias_flags), [*tensors, *seq_tables, *own_tensors], build, lambda: [tile],
        lambda meta: (min(items, configs.multiprocessor_count(device)),),
    )

    def finish():
        if scratch is not None:
            write_gradients(scratch, dk, dv, call, live_walk(call, sequences), signature)

    return finish
