"""Jit helpers shared by the forward and backward kernels.

Two questions every attention program answers the same way:

- *Which tiles does it visit?* A program owns a span of one axis (query rows in the forward
  and dQ kernels, keys in the dK/dV kernel) and loops over tiles of the other axis. The causal
  and window band limits that loop to a tile range, split into *interior* tiles (every element
  visible: no element-wise checks) and *boundary* tiles. The block summary's sorted lists then
  pick the non-empty tiles inside that range; their prefix ranks locate a range in the list
  with one load, so an empty tile costs no iteration at all.
- *What is a score?* ``softcap_fn(scale * q.k) + bias``, kept in the log2 domain so that the
  softmax uses ``exp2``.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def band_tiles(fix_lo, fix_hi, length, diff_lo, diff_hi, BLOCK: tl.constexpr):
    """Tile ranges of a loop axis of ``length`` elements seen from fixed positions ``[fix_lo, fix_hi]``.

    Element ``x`` of the loop axis is visible from fixed position ``f`` iff
    ``diff_lo <= x - f <= diff_hi``. Returns ``(lo, interior_lo, interior_hi, hi)``: tiles
    ``[lo, hi)`` hold any visible element, and tiles ``[interior_lo, interior_hi)`` hold only
    elements visible from every fixed position and inside ``length``.
    """
    first = tl.maximum(fix_lo + diff_lo, 0)
    last = tl.minimum(fix_hi + diff_hi + 1, length)  # exclusive
    lo = first // BLOCK
    hi = tl.where(last > first, (last + BLOCK - 1) // BLOCK, lo)
    interior_lo = tl.minimum(tl.maximum((tl.maximum(fix_hi + diff_lo, 0) + BLOCK - 1) // BLOCK, lo), hi)
    interior_hi = tl.maximum(tl.minimum(tl.minimum(fix_lo + diff_hi + 1, length) // BLOCK, hi), interior_lo)
    return lo, interior_lo, interior_hi, hi


@triton.jit
def first_position(rank_ptr, tile, tiles_per_block, DENSE: tl.constexpr):
    """Position in a block list of the first listed tile ``>= tile`` (tiles split blocks evenly)."""
    if DENSE:
        return tile
    block = tile // tiles_per_block
    sub = tile % tiles_per_block
    before = tl.load(rank_ptr + block)
    # Block `block` is listed iff the rank steps up after it; then its first `sub` tiles come earlier.
    after = tl.load(rank_ptr + block + 1, mask=sub != 0, other=0)
    return before * tiles_per_block + tl.where(sub != 0, after - before, 0) * sub


@triton.jit
def tile_at(index_ptr, position, tiles_per_block, DENSE: tl.constexpr):
    """The tile at ``position`` of a block list (of every tile when DENSE)."""
    if DENSE:
        return position
    return tl.load(index_ptr + position // tiles_per_block) * tiles_per_block + position % tiles_per_block


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
def walk_plan(lists, list_width, tiles_per_block, lo, interior_lo, interior_hi, hi, HAS_LISTS: tl.constexpr):
    """List positions for the three loops every kernel runs over a tile range.

    ``lists`` points at one summary row (``[2, 2, width]``: partial/full x index/rank), or is
    unused without a summary (every tile is full). Returns the index arrays and positions:
    partial tiles ``[partial_lo, partial_hi)``; full interior tiles ``[interior_lo, interior_hi)``;
    full edge tiles ``[full_lo, interior_lo)`` then ``[interior_hi, full_hi)``.
    """
    partial_index = lists
    full_index = lists + 2 * list_width
    partial_lo = first_position(lists + list_width, lo, tiles_per_block, not HAS_LISTS)
    partial_hi = first_position(lists + list_width, hi, tiles_per_block, not HAS_LISTS)
    full_rank = lists + 3 * list_width
    full_lo = first_position(full_rank, lo, tiles_per_block, not HAS_LISTS)
    p_interior_lo = first_position(full_rank, interior_lo, tiles_per_block, not HAS_LISTS)
    p_interior_hi = first_position(full_rank, interior_hi, tiles_per_block, not HAS_LISTS)
    full_hi = first_position(full_rank, hi, tiles_per_block, not HAS_LISTS)
    return partial_index, partial_lo, partial_hi, full_index, full_lo, p_interior_lo, p_interior_hi, full_hi


@triton.jit
def edge_position(j, full_lo, interior_lo, interior_hi):
    """The j-th edge position: ``[full_lo, interior_lo)`` followed by ``[interior_hi, ...)``."""
    return full_lo + j + tl.where(j >= interior_lo - full_lo, interior_hi - interior_lo, 0)


@triton.jit
def tanh(x):
    # Odd-symmetric form that neither overflows nor loses precision near 0 as much as 1 - 2/(e^2x + 1).
    e = tl.exp2(-2.0 * LOG2E * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def scores_log2(qk, scale_log2, softcap_log2, scale_over_cap, SOFTCAP: tl.constexpr):
    """``softcap_fn(scale * qk) * log2(e)``. With SOFTCAP the tanh is ``result / softcap_log2``."""
    if SOFTCAP:
        return tanh(qk * scale_over_cap) * softcap_log2
    return qk * scale_log2


@triton.jit
def load_rows(base, start, stride, length, head_dim, CHECK_BOUNDS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``[start, start + ROWS)`` of a ``[length, head_dim]`` slice (last dim contiguous), zero-padded.

    Row offsets are 64-bit, so any length is safe; ptxas also spilled less this way than with a
    64-bit tile base plus 32-bit offsets (tools/compile_report.py, sm90).
    """
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_d < head_dim)[None, :]
    if CHECK_BOUNDS:
        ok = ok & (start + offs_r < length)[:, None]
    rows = (start + offs_r).to(tl.int64)
    return tl.load(base + (rows * stride)[:, None] + offs_d[None, :], mask=ok, other=0.0)


@triton.jit
def key_pointers(rows, offs_k, stride_k, PER_KEY: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Pointers into a mask or bias for a tile of ``[rows, keys]`` (``[keys, rows]`` if KEYS_FIRST).

    ``rows`` holds one pointer per query row; with PER_KEY it is a single base pointer shared by
    all rows, and the result is a single row (column) that broadcasts over the tile.
    """
    cols = offs_k * stride_k
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
def bias_and_mask(
    s, q_idx, k_idx, seqlen_k, band_lo, band_hi, bias_ptrs, mask_ptrs,
    HAS_BIAS: tl.constexpr, CHECK_BOUNDS: tl.constexpr, APPLY_MASK: tl.constexpr,
):
    """Add the bias to log2-domain scores and set invisible ones to -inf.

    ``q_idx`` and ``k_idx`` broadcast to the tile's shape (either orientation); ``bias_ptrs`` and
    ``mask_ptrs`` broadcast too (a per-key bias is a single row or column of pointers).
    """
    key_ok = k_idx < seqlen_k
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=key_ok, other=0.0).to(tl.float32) * LOG2E
    if CHECK_BOUNDS:
        offset = k_idx - q_idx
        visible = key_ok & (offset >= band_lo) & (offset <= band_hi)
        if APPLY_MASK:
            visible = visible & (tl.load(mask_ptrs, mask=key_ok, other=0) != 0)
        s = tl.where(visible, s, float("-inf"))
    return s
