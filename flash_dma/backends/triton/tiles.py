"""Jit helpers shared by the forward and backward kernels.

Every attention program owns a span of one axis (query rows in the forward and dQ kernels, keys
in the dK/dV kernel) and loops over tiles of the other axis. Three questions are answered here,
once for all kernels:

- *Which tiles does it visit?* The causal and window band limits the loop to a range of tiles,
  split into *interior* tiles (every element visible: no checks at all) and *edge* tiles.
  How the range is walked is the constexpr ``WALK``:

  - ``WALK_DENSE``: every tile of the range, in order.
  - ``WALK_BLOCKS``: the non-empty tiles that a block summary lists (PARTIAL and FULL lists,
    sorted, with prefix ranks that locate any range with one load; see ``block_mask.py``).
  - ``WALK_KEYS``: the kept keys of a per-key mask, gathered ``BLOCK`` at a time from a key list
    (``key_list.py``): kept positions in ascending order, then the dropped ones. Tiles hold
    only kept keys, so a mask keeping 1/8 of the keys costs 1/8 of the work, however scattered.

- *Which elements of a tile need checks?* The constexpr ``STAGE``: ``STAGE_PARTIAL`` bounds, band
  and the element-wise mask; ``STAGE_INTERIOR`` none; ``STAGE_EDGE`` bounds and band. Each stage
  is a loop of its own (one loop deciding per tile measured slower: ``docs/design-notes.md``,
  "Triton forward: where the time goes"), and every kernel runs them in this order,
  ``for stage in tl.static_range(FIRST_STAGE, LAST_STAGE + 1)``, over the stretches of its walk
  that ``stage_tiles`` gives: a summary's PARTIAL tiles, or every tile of a mask walked without
  one; then the band's interior and edge tiles.
- *Where does a batch entry lie?* The constexpr ``SEQ``: ``SEQ_FIXED`` every entry spans the
  whole tensors; ``SEQ_PACKED`` entries are sequences packed along the token axis of ``[1,
  total, heads, D]`` tensors (varlen); ``SEQ_CACHE`` each entry holds its own number of keys in
  a KV cache (decode). Masks, biases and walks are always indexed by the entry.
- *What is a score?* ``softcap_fn(scale * q.k) + bias``, kept in the log2 domain so that the
  softmax uses ``exp2``.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

WALK_DENSE = tl.constexpr(0)
WALK_BLOCKS = tl.constexpr(1)
WALK_KEYS = tl.constexpr(2)

SEQ_FIXED = tl.constexpr(0)
SEQ_PACKED = tl.constexpr(1)
SEQ_CACHE = tl.constexpr(2)

# How a mask's values are stored (the constexpr MASK_KIND; ``layout.MASK_KINDS`` names them):
MASK_ELEMENTS = tl.constexpr(0)  # a bool or 0/1 integer per element
MASK_WORDS = tl.constexpr(1)  # a BitMask's 32-bit words (``bit_mask.py``)
# Key intervals (``key_intervals.py``): per key, its first query row then one past its last, side by
# side (int32 ``[., ., 1, 2 Sk]``, keys contiguous); a key is kept for the rows between them.
MASK_INTERVALS = tl.constexpr(2)

STAGE_PARTIAL = tl.constexpr(0)
STAGE_INTERIOR = tl.constexpr(1)
STAGE_EDGE = tl.constexpr(2)


@triton.jit
def sequence_span(SeqQ, SeqK, b, seqlen_q, seqlen_k, SEQ: tl.constexpr):
    """Where batch entry ``b`` lies: ``(b_tokens, q_start, seqlen_q, k_start, seqlen_k)``.

    ``b_tokens`` indexes the batch axis of the query-side token tensors (Q, O, dO, dQ, LSE) and,
    except in a cache, of K and V; rows of entry ``b`` start at ``q_start`` and ``k_start``. With
    SEQ_PACKED, ``SeqQ`` and ``SeqK`` are ``cu_seqlens_q`` and ``cu_seqlens_k``; with SEQ_CACHE,
    ``SeqK[b]`` is entry b's number of keys, at most the cache's ``seqlen_k``.
    """
    b_tokens = b
    q_start = b * 0
    k_start = b * 0
    if SEQ == SEQ_PACKED:
        b_tokens = b * 0
        q_start = tl.load(SeqQ + b)
        k_start = tl.load(SeqK + b)
        seqlen_q = tl.load(SeqQ + b + 1) - q_start
        seqlen_k = tl.load(SeqK + b + 1) - k_start
    if SEQ == SEQ_CACHE:
        seqlen_k = tl.minimum(tl.load(SeqK + b), seqlen_k)  # never past the cache, whatever the input
    return b_tokens, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def page_rows(table_row, keys, key_ok, page_size, last_page, PAGED: tl.constexpr):
    """Rows of a K/V cache that hold ``keys``: themselves, or with PAGED their slots in the pages
    that ``table_row`` (one row of a block table) lists, in a ``[pages * page_size, ...]`` view.
    Pages are clamped to ``[0, last_page]``: a bad table (unchecked inside a CUDA graph) reads
    wrong keys, never outside the cache."""
    rows = keys
    if PAGED:
        page = tl.load(table_row + keys // page_size, mask=key_ok, other=0)
        rows = tl.minimum(tl.maximum(page, 0), last_page) * page_size + keys % page_size
    return rows


@triton.jit
def band_positions(fix_lo, fix_hi, length, diff_lo, diff_hi):
    """Positions of a loop axis of ``length`` elements seen from fixed positions ``[fix_lo, fix_hi]``.

    Element ``x`` is visible from fixed position ``f`` iff ``diff_lo <= x - f <= diff_hi``.
    Returns ``(first, interior_first, interior_last, last)``: elements ``[first, last)`` are
    visible from some fixed position, elements ``[interior_first, interior_last)`` from all of
    them. All four lie in ``[0, length]``.
    """
    first = tl.minimum(tl.maximum(fix_lo + diff_lo, 0), length)
    last = tl.maximum(tl.minimum(fix_hi + diff_hi + 1, length), first)
    interior_first = tl.minimum(tl.maximum(fix_hi + diff_lo, first), last)
    interior_last = tl.maximum(tl.minimum(fix_lo + diff_hi + 1, last), interior_first)
    return first, interior_first, interior_last, last


@triton.jit
def tile_range(first, interior_first, interior_last, last, BLOCK: tl.constexpr):
    """Tiles of ``BLOCK`` elements over ``[first, last)``: ``(lo, interior_lo, interior_hi, hi)``.

    Tiles ``[lo, hi)`` hold any element of the range; ``[interior_lo, interior_hi)`` lie wholly
    inside ``[interior_first, interior_last)``.
    """
    lo = first // BLOCK
    hi = tl.where(last > first, (last + BLOCK - 1) // BLOCK, lo)
    interior_lo = tl.minimum(tl.maximum((interior_first + BLOCK - 1) // BLOCK, lo), hi)
    interior_hi = tl.maximum(tl.minimum(interior_last // BLOCK, hi), interior_lo)
    return lo, interior_lo, interior_hi, hi


@triton.jit
def band_tiles(fix_lo, fix_hi, length, diff_lo, diff_hi, BLOCK: tl.constexpr):
    """``tile_range`` of ``band_positions``: the band's tiles on a plain (dense) axis."""
    first, interior_first, interior_last, last = band_positions(fix_lo, fix_hi, length, diff_lo, diff_hi)
    return tile_range(first, interior_first, interior_last, last, BLOCK)


@triton.jit
def kept_band_tiles(rank, fix_lo, fix_hi, length, diff_lo, diff_hi, BLOCK: tl.constexpr):
    """The band's tiles in the kept-key order of a key list (``rank[x]``: kept keys before ``x``).

    Kept keys keep their order, so a band of positions maps to a range of the list.
    """
    first, interior_first, interior_last, last = band_positions(fix_lo, fix_hi, length, diff_lo, diff_hi)
    return tile_range(
        tl.load(rank + first), tl.load(rank + interior_first), tl.load(rank + interior_last), tl.load(rank + last),
        BLOCK,
    )


@triton.jit
def first_position(rank_ptr, tile, tiles_per_block):
    """Position in a block list of the first listed tile ``>= tile`` (tiles split blocks evenly)."""
    block = tile // tiles_per_block
    sub = tile % tiles_per_block
    before = tl.load(rank_ptr + block)
    # Block `block` is listed iff the rank steps up after it; then its first `sub` tiles come earlier.
    after = tl.load(rank_ptr + block + 1, mask=sub != 0, other=0)
    return before * tiles_per_block + tl.where(sub != 0, after - before, 0) * sub


@triton.jit
def summary_row(tile, list_block, BLOCK: tl.constexpr):
    """The row of a block summary that holds tile ``tile`` of ``BLOCK`` elements, for summary
    blocks of ``list_block`` elements (0: the axis is one block)."""
    return tl.where(list_block > 0, tile // tl.maximum(list_block // BLOCK, 1), 0)


@triton.jit
def summary_list(lists, list_width, full, rank):
    """One of a block-summary row's four lists, ``[2, 2, width]``: PARTIAL/FULL x tiles/rank
    (``block_mask.py``), picked by ``full`` and ``rank`` (constants, or run-time flags). The one
    place that knows this layout."""
    return lists + list_width * (2 * full + rank)  # tensor first: see tanh


@triton.jit
def listed_tiles(lists, list_width, tiles_per_block, lo, interior_lo, interior_hi, hi):
    """Where a tile range falls in one block-summary row's lists.

    Returns ``(partial_lo, partial_hi, full_lo, full_interior_lo, full_interior_hi, full_hi)``,
    positions in the partial list and in the full list.
    """
    partial_rank = summary_list(lists, list_width, False, True)
    full_rank = summary_list(lists, list_width, True, True)
    return (
        first_position(partial_rank, lo, tiles_per_block),
        first_position(partial_rank, hi, tiles_per_block),
        first_position(full_rank, lo, tiles_per_block),
        first_position(full_rank, interior_lo, tiles_per_block),
        first_position(full_rank, interior_hi, tiles_per_block),
        first_position(full_rank, hi, tiles_per_block),
    )


@triton.jit
def split_range(lo, interior_lo, interior_hi, hi, split, num_splits):
    """The part of a tile range that split ``split`` of ``num_splits`` handles (split-KV)."""
    chunk = (hi - lo + num_splits - 1) // num_splits
    s_lo = tl.minimum(lo + split * chunk, hi)
    s_hi = tl.minimum(s_lo + chunk, hi)
    interior_lo = tl.minimum(tl.maximum(interior_lo, s_lo), s_hi)
    interior_hi = tl.maximum(tl.minimum(interior_hi, s_hi), interior_lo)
    return s_lo, interior_lo, interior_hi, s_hi


@triton.jit
def stage_tiles(
    STAGE: tl.constexpr, WALK: tl.constexpr, lists, list_width, partial_lo, partial_hi, lo, interior_lo, interior_hi, hi,
):
    """Stage ``STAGE``'s stretch of a walk: ``(tiles, lo, hi, gap_lo, gap_hi)``, the positions
    ``[lo, hi)`` less ``[gap_lo, gap_hi)`` of the list ``tiles`` (for ``tile_start``).

    ``lists`` is the walk: a block-summary row (PARTIAL tiles at positions ``[partial_lo,
    partial_hi)`` of its PARTIAL list, the others in its FULL list), a key list, or nothing read
    (dense). ``[lo, hi)`` are the band's tiles, ``[interior_lo, interior_hi)`` its interior.
    The PARTIAL stage of a dense walk is the whole band: a mask without a summary.
    """
    tiles = lists
    if WALK == WALK_BLOCKS:
        tiles = summary_list(lists, list_width, STAGE != STAGE_PARTIAL, False)
    stage_lo = lo
    stage_hi = hi
    gap_lo = hi
    gap_hi = hi
    if STAGE == STAGE_PARTIAL and WALK == WALK_BLOCKS:
        stage_lo = partial_lo
        stage_hi = partial_hi
        gap_lo = partial_hi
        gap_hi = partial_hi
    if STAGE == STAGE_INTERIOR:
        stage_lo = interior_lo
        stage_hi = interior_hi
        gap_lo = interior_hi
        gap_hi = interior_hi
    if STAGE == STAGE_EDGE:
        gap_lo = interior_lo
        gap_hi = interior_hi
    return tiles, stage_lo, stage_hi, gap_lo, gap_hi


@triton.jit
def walk_position(j, lo, gap_lo, gap_hi):
    """The j-th position of ``[lo, ...)`` with the positions ``[gap_lo, gap_hi)`` left out."""
    return lo + j + tl.where(j >= gap_lo - lo, gap_hi - gap_lo, 0)


@triton.jit
def tile_start(tiles, position, tiles_per_block, WALK: tl.constexpr):
    """The tile at ``position`` of a walk: a tile number, or for WALK_KEYS a key list slot block.

    A scalar, so that kernels can read it a step ahead cheaply: the loads of a tile then never
    wait on the load of its list entry, and the pipeliner can prefetch them.
    """
    if WALK == WALK_BLOCKS:
        return tl.load(tiles + position // tiles_per_block) * tiles_per_block + position % tiles_per_block
    return position


@triton.jit
def tile_indices(tiles, tile, limit, BLOCK: tl.constexpr, WALK: tl.constexpr):
    """Indices along the loop axis of ``tile`` (from ``tile_start``), and which are real.

    For WALK_KEYS ``tiles`` is a key list's order and ``limit`` the number of kept keys; for the
    other walks ``limit`` is the axis length.
    """
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    valid = offs < limit
    if WALK == WALK_KEYS:
        return tl.load(tiles + offs, mask=valid, other=0), valid
    return offs, valid


@triton.jit
def load_tile(base, rows, row_ok, stride, head_dim, CHECK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``rows`` of a ``[., head_dim]`` slice (last dim contiguous); rows not ``row_ok`` read 0 when CHECK.

    Row offsets are 64-bit, so any length is safe; ptxas also spilled less this way than with a
    64-bit tile base plus 32-bit offsets (tools/compile_report.py, sm90).
    """
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_d < head_dim)[None, :]
    if CHECK:
        ok = ok & row_ok[:, None]
    return tl.load(base + (rows.to(tl.int64) * stride)[:, None] + offs_d[None, :], mask=ok, other=0.0)


@triton.jit
def row_source(base, length, stride, head_dim, TMA: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where ``load_rows`` reads ``[BLOCK, BLOCK_D]`` tiles of a ``[length, head_dim]`` row slice:
    with TMA a tensor descriptor (Hopper's copy engine, which zero-fills rows past ``length`` and
    columns past ``head_dim``), else the base pointer itself."""
    source = base  # one return: Triton checks that every return has one type, even across constexpr branches
    if TMA:
        source = tl.make_tensor_descriptor(base, shape=[length, head_dim], strides=[stride, 1], block_shape=[BLOCK, BLOCK_D])
    return source


@triton.jit
def load_rows(source, first, rows, row_ok, stride, head_dim, CHECK: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tile of rows ``rows`` from a ``row_source``; with TMA they must be ``first + arange(BLOCK)``.

    With TMA one thread issues the whole tile's copy: no per-element addresses in registers, and
    the pipeliner waits on a barrier instead of on every thread's loads.
    """
    if TMA:
        tile = source.load([first, 0])
    else:
        tile = load_tile(source, rows, row_ok, stride, head_dim, CHECK, BLOCK_D)
    return tile


@triton.jit
def tanh(x):
    # Odd-symmetric form that neither overflows nor loses precision near 0 as much as 1 - 2/(e^2x + 1).
    # Tensor first: under the Triton >= 3.7 interpreter, `constexpr * tensor` makes a constexpr
    # holding a tensor, which tl.exp2 refuses ("cannot convert ... to tensor"). The compiler makes
    # the same PTX either way (sm90, triton 3.6).
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def scores_log2(qk, scale_log2, softcap_log2, scale_over_cap, SOFTCAP: tl.constexpr):
    """``softcap_fn(scale * qk) * log2(e)``. With SOFTCAP the tanh is ``result / softcap_log2``."""
    if SOFTCAP:
        return tanh(qk * scale_over_cap) * softcap_log2
    return qk * scale_log2


@triton.jit
def key_pointers(rows, offs_k, stride_k, PER_KEY: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Pointers into a mask or bias for a tile of ``[rows, keys]`` (``[keys, rows]`` if KEYS_FIRST).

    ``rows`` holds one pointer per query row; with PER_KEY it is a single base pointer shared by
    all rows, and the result is a single row (column) that broadcasts over the tile.
    """
    cols = offs_k.to(tl.int64) * stride_k
    # One return: Triton wants every return of a function to have one type, even across constexpr branches.
    if PER_KEY:
        if KEYS_FIRST:
            pointers = rows + cols[:, None]
        else:
            pointers = rows + cols[None, :]
    else:
        if KEYS_FIRST:
            pointers = rows[None, :] + cols[:, None]
        else:
            pointers = rows[:, None] + cols[None, :]
    return pointers


@triton.jit
def mask_columns(keys, MASK_KIND: tl.constexpr):
    """Where ``keys`` lie along a mask's last axis: themselves; the 32-bit words of a BitMask that
    hold them; or their intervals' first rows (``MASK_INTERVALS``)."""
    columns = keys  # one return: Triton wants one type across constexpr branches
    if MASK_KIND == MASK_WORDS:
        columns = keys // 32
    if MASK_KIND == MASK_INTERVALS:
        columns = keys * 2
    return columns


@triton.jit
def visible_scores(
    s, q_idx, k_idx, key_ok, band_lo, band_hi, bias_ptrs, mask_ptrs,
    HAS_BIAS: tl.constexpr, STAGE: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """Add the bias to log2-domain scores and set the invisible ones to -inf, as ``STAGE`` requires.

    ``q_idx``, ``k_idx`` and ``key_ok`` broadcast to the tile's shape (either orientation);
    ``bias_ptrs`` and ``mask_ptrs`` broadcast too (a per-key bias is a single row or column).
    ``mask_ptrs`` point where ``mask_columns`` says, as ``MASK_KIND`` stores the mask.
    """
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=key_ok, other=0.0).to(tl.float32) * LOG2E
    if STAGE != STAGE_INTERIOR:
        offset = k_idx - q_idx
        visible = key_ok & (offset >= band_lo) & (offset <= band_hi)
        if STAGE == STAGE_PARTIAL:
            kept = tl.load(mask_ptrs, mask=key_ok, other=0)
            if MASK_KIND == MASK_WORDS:
                kept = (kept >> (k_idx % 32)) & 1
            if MASK_KIND == MASK_INTERVALS:  # kept holds the first rows; the ends follow them
                kept = (kept <= q_idx) & (q_idx < tl.load(mask_ptrs + 1, mask=key_ok, other=0))
            visible = visible & (kept != 0)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def key_walk(
    walk, walk_width, row_offset, seqlen_k, q_lo, q_hi, band_lo, band_hi, list_block_k, split, num_splits,
    WALK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The key tiles that query rows ``[q_lo, q_hi]`` visit, for the forward and dQ kernels.

    ``walk`` points at this (batch, head)'s block lists (``row_offset`` then picks the query
    block's row) or key list; ``band_lo``/``band_hi`` bound ``key - query``; the range is cut
    into ``num_splits`` and part ``split`` is returned. Returns ``(lists, tiles_per_block,
    key_limit, partial_lo, partial_hi, lo, interior_lo, interior_hi, hi)``, the arguments of
    ``stage_tiles`` (with ``walk_width``) and of the tile loops.
    """
    lists = walk
    tiles_per_block = 1
    key_limit = seqlen_k
    if WALK == WALK_KEYS:
        rank = walk + walk_width  # a key list: its order, then the rank of every position
        key_limit = tl.load(rank + seqlen_k)
        lo, interior_lo, interior_hi, hi = kept_band_tiles(rank, q_lo, q_hi, seqlen_k, band_lo, band_hi, BLOCK_N)
    else:
        lo, interior_lo, interior_hi, hi = band_tiles(q_lo, q_hi, seqlen_k, band_lo, band_hi, BLOCK_N)
    lo, interior_lo, interior_hi, hi = split_range(lo, interior_lo, interior_hi, hi, split, num_splits)
    partial_lo = lo
    partial_hi = lo
    if WALK == WALK_BLOCKS:
        # At least 1: an empty varlen entry (seqlen 0) has no tiles, yet its walk divides by this.
        tiles_per_block = tl.where(list_block_k > 0, list_block_k // BLOCK_N, tl.maximum(tl.cdiv(seqlen_k, BLOCK_N), 1))
        lists = walk + row_offset
        partial_lo, partial_hi, lo, interior_lo, interior_hi, hi = listed_tiles(
            lists, walk_width, tiles_per_block, lo, interior_lo, interior_hi, hi
        )
    return lists, tiles_per_block, key_limit, partial_lo, partial_hi, lo, interior_lo, interior_hi, hi


@triton.jit
def query_walk(
    walk, walk_width, stride_wr, key_tile, k_first, k_last, seqlen_q, seqlen_k, band_lo, band_hi,
    list_block_q, list_block_k, split, num_splits, WALK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``key_walk`` along the query axis, for the dK/dV kernels: the query tiles that see keys
    ``[k_first, k_last]`` of key tile ``key_tile`` (``key - query`` in the band: ``query - key``
    in its negation), in the transposed summary's row of that tile (``walk`` points at the
    (batch, head)'s rows, ``stride_wr`` apart)."""
    row_offset = summary_row(key_tile, list_block_k, BLOCK_N).to(tl.int64) * stride_wr
    return key_walk(
        walk, walk_width, row_offset, seqlen_q, k_first, tl.minimum(k_last, seqlen_k - 1), -band_hi, -band_lo,
        list_block_q, split, num_splits, WALK, BLOCK_M,
    )


@triton.jit
def row_tile_scores(
    q, q_idx, k_source, first_key, keys, kv_rows, key_ok, stride_ks, head_dim, band_lo, band_hi,
    bias_rows, stride_bk, mask_rows, stride_mk, scale_log2, softcap_log2, scale_over_cap,
    STAGE: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_PER_KEY: tl.constexpr, BIAS_PER_KEY: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """The per-tile prologue of the kernels that own query rows (forward, dQ).

    Loads the K tile of ``keys`` (found at rows ``kv_rows`` of K and of the bias; with TMA they
    are ``first_key`` on) and returns it, the log2 scores of ``q`` against it before the bias (for
    the softcap derivative) and the visible scores with the bias: ``[BLOCK_M, BLOCK_N]``.
    """
    k = load_rows(k_source, first_key, kv_rows, key_ok, stride_ks, head_dim, STAGE != STAGE_INTERIOR, TMA, BLOCK_D)  # [BLOCK_N, BLOCK_D]
    scores = scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale_log2, softcap_log2, scale_over_cap, SOFTCAP)
    s = visible_scores(
        scores, q_idx[:, None], keys[None, :], key_ok[None, :], band_lo, band_hi,
        key_pointers(bias_rows, kv_rows, stride_bk, BIAS_PER_KEY, False),
        key_pointers(mask_rows, mask_columns(keys, MASK_KIND), stride_mk, MASK_PER_KEY, False),
        HAS_BIAS, STAGE, MASK_KIND,
    )
    return k, scores, s
