"""Hopper forward: the forward kernel of ``../forward.py`` as a warp-specialised, persistent Gluon kernel.

On sm90 the plain Triton forward keeps one 8-warp program per multiprocessor whose loads, math
and epilogue take turns: measured, 8.8 us of fixed cost per program and 2.44 us per 128 x 128
tile (docs/design-notes.md, "Hopper forward"), so a query block with a short tile list spends a
third of its time waiting. Here the roles run side by side, as in FlashAttention-3:

- a *loader* warp (``common.load_partition``) walks each work item's tile list (the walk of
  ``tiles.key_walk``, PARTIAL tiles first) and copies Q, K and V with TMA into shared-memory
  rings, running ahead across work items. It reads the walk and the per-key mask and bias:
  with each K tile it stages the span of its keys' positions, their scores (bias in log2 units,
  -inf where the mask drops a key) and whether the tile's pair bits are read.
- two *softmax* warpgroups each own 64 of a work item's 128 query rows. They issue the next
  tile's ``S = Q K^T`` before this tile's softmax, so that ``O += P V`` runs during it, read a
  per-pair bias and a BitMask's bits themselves (``common.visible_scores``), check only the
  tiles that the band or the end of the keys cuts, and write the output and LSE, applying a
  per-row mask or bias there (``_finish_rows``).

The grid is persistent: one program per multiprocessor takes work items (row block, batch,
head) in turn, the last row blocks first (under a causal band they hold the most tiles).
Outputs are those of ``forward.attention_forward``, so the backward is shared; which calls
come here is ``dispatch.py``'s table.

With ``FP8`` the inputs are e4m3 with descale factors: V is read from a keys-contiguous copy
(``transpose.transposed_values``), P is rounded to e4m3 for ``P V`` and the output is bfloat16
(docs/design-notes.md, "FP8 forward").
"""

# No `from __future__ import annotations`: the records below need their field types as objects.
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flash_dma.backends.triton import configs, tiles
from flash_dma.backends.triton.hopper.common import (
    BIAS_ROWS,
    CACHE_CONTIGUOUS,
    CACHE_PAGES,
    CACHE_ROWS,
    COMMON_TENSORS,
    KEY_BIAS_COLUMNS,
    LOADER_REGISTERS,
    MASK_ROWS,
    MATH_REGISTERS,
    MAX_REGISTERS,
    PLAIN,
    TILES,
    Problem,
    adds_key_bias_by_mma,
    head_dim_tile,
    hopper_arguments,
    hopper_tensors,
    init_barriers,
    input_base,
    jit_with_runtime_scalars,
    kept_keys,
    key_bias_staged,
    load_partition,
    record,
    row_values,
    staged_buffers,
    staged_descriptors,
    stages_pair_bias,
    store_rows,
    take_rows,
    taken_item,
    tile_descriptor,
    visible_scores,
    work_items,
    wait_for_scores,
    walked_keys,
    wide_tiles,
)
from flash_dma.backends.triton.hopper.transpose import transposed_values
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import CachePages, Call, Sequences, cache_tables, placeholder, tensor_layout

TILE = triton.Config(dict(zip(("BLOCK_M", "BLOCK_N"), TILES["forward"])), num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
# D = 256: tiles of 64 keys (a warpgroup's 64 x 256 accumulator is 128 of its 240 registers) and one
# Q slot, so that Q (64 KB) and two K/V stages (128 KB) fit in shared memory.
WIDE_TILE = triton.Config(dict(BLOCK_M=TILE.kwargs["BLOCK_M"], BLOCK_N=64), num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
# K/V tiles in flight per tile head dim (``head_dim_tile``); with two Q buffers, D = 128 fills 192 KB of
# shared memory. D = 32 takes D = 64's ring.
KV_STAGES = {32: 3, 64: 3, 128: 2, 256: 2}
STAGED_BIAS_KV_STAGES = 2  # D <= 64 with a per-pair bias staged beside K and V: 32 KB more per stage


@record
class _Buffers:
    """Shared memory: two Q tiles (this item's and the next's) with their items' numbers and tile
    counts, a ring of K/V tiles with their BitMask words (or key intervals' row words) and staged
    bias (``common.staged_buffers``), the spans and (key lists) positions of their keys, whether their
    pairs are tested and their key scores, the barriers (``zeroed``: a cache's V tile whose rows
    past the entry's keys the lower warpgroup has zeroed, ``_issue_value_product``), with FP8 a
    bfloat16 output tile (``common.store_rows``), and with a staged per-key bias the weights that
    the tensor cores multiply it by (``_key_bias_weights``; one word each otherwise)."""

    q: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    words: gl.shared_memory_descriptor
    bias: gl.shared_memory_descriptor
    indices: gl.shared_memory_descriptor
    counts: gl.shared_memory_descriptor
    spans: gl.shared_memory_descriptor
    positions: gl.shared_memory_descriptor
    partial: gl.shared_memory_descriptor
    key_scores: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    zeroed: gl.shared_memory_descriptor
    out_tile: gl.shared_memory_descriptor
    bias_weights: gl.shared_memory_descriptor


@gluon.jit
def _thread_row_sums(x):
    """Row sums of a wgmma tile ``x`` ``[ROWS, N]`` over each thread's own columns only: ``[ROWS, 4]``.

    The tile gives each thread of a row's quad the columns ``8 j + 2 t + e`` (thread ``t``), so
    these sums need no shuffles; the quad's four partial sums are added once per work item.
    """
    ROWS: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    return gl.sum(gl.sum(x.reshape([ROWS, N // 8, 4, 2]), 3), 1)


# FP8: the probabilities are scaled by 2^8 (at most 256, below e4m3's 448) before they are rounded to
# e4m3 for P V, so that those under 2^-10 of their row's largest are not lost to e4m3's underflow; the
# row sums carry the same factor, and the LSE takes it back out (``_finish_rows``).
FP8_PROBS_LOG2_SCALE = gl.constexpr(8.0)


@gluon.jit
def _rescaled(acc, alpha):
    """``acc`` ``[ROWS, N]`` (the output's accumulator, or the row sums) with each row times its
    ``alpha`` ``[ROWS]``."""
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _online_softmax(p, s, m_i, l_i):
    """One tile of the online softmax: ``(probs, m_new, alpha, l_new)``, with ``l`` the rows'
    sums per thread (``_thread_row_sums``); FP8 probabilities scaled by ``FP8_PROBS_LOG2_SCALE``."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead, so p = 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    if p.FP8:
        probs = gl.exp2(s - (m_shift - FP8_PROBS_LOG2_SCALE)[:, None])
    else:
        probs = gl.exp2(s - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return probs, m_new, alpha, _rescaled(l_i, alpha) + _thread_row_sums(probs)


@gluon.jit
def _finish_rows(p, acc, m_i, l_i, batch, head, rows, rows_of_o: gl.constexpr):
    """``(out [ROWS, D], lse [ROWS])`` of the rows' accumulators. Rows with no visible key, and
    rows a per-row mask drops, get out = 0 and lse = -inf; a per-row bias shifts the LSE only
    (the softmax does not see it)."""
    rows_of_s: gl.constexpr = m_i.type.layout
    l_i = gl.convert_layout(gl.sum(l_i, 1), rows_of_s)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, rows_of_o)[:, None]
    log2_sum = gl.log2(l_safe)
    if p.FP8:
        log2_sum = log2_sum - FP8_PROBS_LOG2_SCALE
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + log2_sum) * tiles.LN2)
    if p.MASK == MASK_ROWS:
        mask_row = input_base(p.Mask, p.stride_mb, p.stride_mh, p.mask_head_div, batch, head)
        kept = row_values(p, mask_row, p.stride_mq, rows, 0) != 0
        out = gl.where(gl.convert_layout(kept, rows_of_o)[:, None], out, 0.0)
        lse = gl.where(kept, lse, float("-inf"))
    if p.BIAS == BIAS_ROWS:
        bias_row = input_base(p.Bias, p.stride_bb, p.stride_bh, p.bias_head_div, batch, head)
        lse = lse + row_values(p, bias_row, p.stride_bq, rows, 0.0).to(gl.float32)
    return out, lse


@gluon.jit
def _descales(p, batch, head):
    """``(qk_descale, v_descale)`` of (``batch``, query ``head``): FP8 inputs' factors (their
    ``[B, Hkv, 3]`` record), 1 for others."""
    qk_descale = 1.0
    v_descale = 1.0
    if p.FP8:
        factors = p.Descale + (batch * (p.num_heads // p.group) + head // p.group).to(gl.int64) * 3
        qk_descale = gl.load(factors) * gl.load(factors + 1)
        v_descale = gl.load(factors + 2)
    return qk_descale, v_descale


@gluon.jit
def _descaled(p, x, descale):
    """``x`` times ``descale`` (FP8), or ``x`` itself."""
    if p.FP8:
        x = x * descale
    return x


@gluon.jit
def _zero_rows_past(values, count):
    """Zero the rows of a V tile ``[BLOCK_N, D]`` in shared memory from ``count`` on, ``ROWS`` at
    a time: a cache's slots past an entry's length may hold anything, NaN included, and a zero
    probability times NaN is NaN. The rows are then fenced for the products' reads."""
    BLOCK_N: gl.constexpr = values.shape[0]
    D: gl.constexpr = values.shape[1]
    ROWS: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    for c in gl.static_range(BLOCK_N // ROWS):
        if (c + 1) * ROWS > count:
            chunk = values.slice(c * ROWS, ROWS)  # [ROWS, D]
            rows = c * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
            chunk.store(gl.where((rows < count)[:, None], chunk.load(layout), gl.zeros([ROWS, D], chunk.dtype, layout)))
    fence_async_shared()


@gluon.jit
def _value_operand(p, probs, dtype: gl.constexpr, p_layout: gl.constexpr):
    """``probs`` ``[ROWS, BLOCK_N]`` as ``P V``'s A operand. FP8: each group of 16 columns reordered as
    the V copy's keys are (``transpose.key_at_column``), which puts each thread's own four
    bytes where the 8-bit operand wants them: no exchange between threads."""
    P = probs.to(dtype)
    if p.FP8:
        ROWS: gl.constexpr = probs.shape[0]
        N: gl.constexpr = probs.shape[1]
        # column 16 g + 8 j + 2 t + e goes to 16 g + 4 t + 2 j + e
        P = P.reshape([ROWS, N // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([ROWS, N])
    return gl.convert_layout(P, p_layout)


@gluon.jit
def _operand_of(p, probs, dtype: gl.constexpr, p_layout: gl.constexpr, converted: gl.constexpr):
    """``probs`` as ``P V``'s A operand: itself where it was ``converted`` already."""
    operand = probs
    if not converted:
        operand = _value_operand(p, probs, dtype, p_layout)
    return operand


@gluon.jit
def _issue_value_product(p, bufs, stage, probs, acc, first_key, span, zeroings, HALF: gl.constexpr):
    """Issue ``O += P V`` for the V tile at ring position ``stage`` (``probs`` in the operand's
    layout; ``first_key`` its first key, in an entry whose :class:`Span` is ``span``),
    asynchronously: ``(product, zeroings)``. A KV cache's tile that runs past the entry's keys
    first has those rows zeroed (``_zero_rows_past``; elsewhere such rows are the next sequence's,
    or the copy engine's zeros past the tensor), by the lower warpgroup, which then arrives on
    ``zeroed`` at ``stage``; the upper one waits there before its product reads the tile. Bit
    ``stage`` of ``zeroings`` (each warpgroup's count of those tiles per ring position, modulo 2)
    is the phase it waits for. The lower warpgroup zeroes the position again only once the loader
    has refilled it, after the upper one's product: a phase is never passed unseen.

    FP8's V tile is a view of its transposed copy, keys contiguous. FP8 products accumulate in
    place, at the tensor cores' reduced precision, as FlashAttention-3's do: a fresh accumulator
    per tile, added in fp32, measured 13 % slower at D = 128 (design notes, "FP8 forward")."""
    if p.FP8:
        v = bufs.v.index(stage).reshape([p.HEAD_DIM, p.BLOCK_N]).permute((1, 0))  # [BLOCK_N, D]
    else:
        v = bufs.v.index(stage).reshape([p.BLOCK_N, p.HEAD_DIM])  # [BLOCK_N, D]
        if p.SEQ == tiles.SEQ_CACHE and p.WALK != tiles.WALK_KEYS:  # a key list's gathered tiles hold zeros there
            if first_key + p.BLOCK_N > span.seqlen_k:
                if HALF == 0:
                    _zero_rows_past(v, span.seqlen_k - first_key)
                    mbarrier.arrive(bufs.zeroed.index(stage), count=1)
                else:
                    mbarrier.wait(bufs.zeroed.index(stage), (zeroings >> stage) & 1)
                zeroings ^= 1 << stage
    return warpgroup_mma(probs, v, acc, is_async=True), zeroings


@gluon.jit
def _softmax_item(p, bufs, index, items_done, consumed, zeroings, HALF: gl.constexpr):
    """Rows ``[HALF * 64, HALF * 64 + 64)`` of work item ``index``, the program's ``items_done``-th,
    its key tiles from ring position ``consumed``: returns the ring position and ``zeroings``
    (``_issue_value_product``) after it.

    Within a work item, the product of the next tile ``S = Q K^T`` is issued with ``O += P V`` of
    this one, before the next softmax, as in FlashAttention-3's intra-warpgroup overlap. ptxas
    (triton 3.6) still places the wait for ``P V`` before that softmax (docs/design-notes.md,
    "Hopper forward"), so the tensor cores overlap a warpgroup's softmax only with the other
    warpgroup's products.

    Where P becomes its operand and where the accumulator is rescaled set what stays live beside
    the next ``S`` in flight; both are chosen by measurement, per dtype and head dim (design notes,
    "P's operand and the rescale, placed").
    """
    ROWS: gl.constexpr = p.BLOCK_M // 2
    D: gl.constexpr = p.HEAD_DIM
    dtype: gl.constexpr = p.q_desc.dtype
    # wgmma's reduction step is 32 bytes: 16 elements of 16 bits, 32 of FP8 (each register of P holds k_width).
    MMA_K: gl.constexpr = 32 if p.FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, MMA_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=MMA_K // 8)
    rows_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_of_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # Whether a tile's staged keys are read before its product is waited for (their shared-memory
    # latency then overlaps it), chosen by measurement (llm shape, keep 1/8): 3.6% faster at D = 64
    # (16K); 4-6% slower at D = 128 (16K-128K), where ptxas issues the loads between the two products.
    READ_KEYS_EARLY: gl.constexpr = D == 64
    # 16 bits, D >= 128: P made the operand as its softmax ends, so the fp32 tile is dead before
    # the next S is issued (4% faster at D = 128, fewer spills); 3% slower at D = 64.
    P_AT_SOFTMAX: gl.constexpr = not p.FP8 and D >= 128
    # FP8, D = 128: the accumulator rescaled once the next S is issued, as FlashAttention-3 does
    # (2.5% faster); 16 bits spill more with it, FP8 at D = 64 and 256 measured 5% and 2% slower.
    RESCALE_AFTER_NEXT_S: gl.constexpr = p.FP8 and D == 128

    batch, head, first_row, rows, q_slot, count, span = take_rows(p, bufs, index, items_done, HALF, rows_of_s)
    q = bufs.q.index(q_slot).reshape([p.BLOCK_M, D]).slice(HALF * ROWS, ROWS)  # [ROWS, D]
    qk_descale, v_descale = _descales(p, batch, head)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_of_s)
    l_i = _thread_row_sums(gl.zeros([ROWS, p.BLOCK_N], gl.float32, s_layout))  # zeros, in the sums' layout
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    if count > 0:
        stage = consumed % p.KV_STAGES
        mbarrier.wait(bufs.k_ready.index(stage), (consumed // p.KV_STAGES) & 1)
        qk = _issue_scores(p, bufs, q, stage, s_layout)
        qk, staged = wait_for_scores(p, bufs, qk, 0, stage, keys_of_s, READ_KEYS_EARLY)
        s = visible_scores(p, bufs, _descaled(p, qk, qk_descale), staged, stage, batch, head, span, first_row, rows, keys_of_s, ROWS, HALF)
        mbarrier.arrive(bufs.k_empty.index(stage), count=1)
        probs, m_i, alpha, l_i = _online_softmax(p, s, m_i, l_i)  # alpha = 0: acc holds nothing yet
        if P_AT_SOFTMAX:
            probs = _value_operand(p, probs, dtype, p_layout)
        for _ in range(1, count):
            following = (consumed + 1) % p.KV_STAGES
            mbarrier.wait(bufs.k_ready.index(following), ((consumed + 1) // p.KV_STAGES) & 1)
            qk = _issue_scores(p, bufs, q, following, s_layout)
            if RESCALE_AFTER_NEXT_S:
                acc = _rescaled(acc, alpha)
            mbarrier.wait(bufs.v_ready.index(stage), (consumed // p.KV_STAGES) & 1)
            pv, zeroings = _issue_value_product(
                p, bufs, stage, _operand_of(p, probs, dtype, p_layout, P_AT_SOFTMAX), acc, staged[0], span, zeroings, HALF,
            )
            # The product of the next tile; P V may still run.
            qk, staged = wait_for_scores(p, bufs, qk, 1, following, keys_of_s, READ_KEYS_EARLY)
            s = visible_scores(  # [ROWS, BLOCK_N]
                p, bufs, _descaled(p, qk, qk_descale), staged, following, batch, head, span, first_row, rows, keys_of_s, ROWS, HALF,
            )
            mbarrier.arrive(bufs.k_empty.index(following), count=1)
            probs, m_i, alpha, l_i = _online_softmax(p, s, m_i, l_i)
            if P_AT_SOFTMAX:
                probs = _value_operand(p, probs, dtype, p_layout)
            acc = warpgroup_mma_wait(0, deps=[pv])
            mbarrier.arrive(bufs.v_empty.index(stage), count=1)
            if not RESCALE_AFTER_NEXT_S:
                acc = _rescaled(acc, alpha)
            consumed += 1
            stage = following
        if RESCALE_AFTER_NEXT_S:
            acc = _rescaled(acc, alpha)
        mbarrier.wait(bufs.v_ready.index(stage), (consumed // p.KV_STAGES) & 1)
        pv, zeroings = _issue_value_product(
            p, bufs, stage, _operand_of(p, probs, dtype, p_layout, P_AT_SOFTMAX), acc, staged[0], span, zeroings, HALF,
        )
        acc = warpgroup_mma_wait(0, deps=[pv])
        mbarrier.arrive(bufs.v_empty.index(stage), count=1)
        consumed += 1

    out, lse = _finish_rows(p, _descaled(p, acc, v_descale), m_i, l_i, batch, head, rows, rows_of_o)
    store_rows(p, bufs, q_slot, HALF, span, first_row, head, out)
    lse_row = p.Lse + span.tokens.to(gl.int64) * p.stride_lse_b + head.to(gl.int64) * p.stride_lse_h + span.q_start
    gl.store(lse_row + rows, lse, mask=rows < span.seqlen_q)
    return consumed, zeroings


@gluon.jit
def _issue_scores(p, bufs, q, stage, s_layout: gl.constexpr):
    """Issue ``S = Q K^T`` ``[ROWS, BLOCK_N]`` for the K tile at ring position ``stage``, unscaled;
    with a staged per-key bias, a second product adds it, the loader's operand (``common._store_key_bias``)
    by the weights (``_key_bias_weights``): the tensor cores add the bias, which the math
    warpgroups then neither read nor add (``common.adds_key_bias_by_mma``)."""
    ROWS: gl.constexpr = q.shape[0]
    k = bufs.k.index(stage).reshape([p.BLOCK_N, p.HEAD_DIM])
    qk = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([ROWS, p.BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    if key_bias_staged(p.BIAS, p.STAGED_BIAS):
        qk = warpgroup_mma(bufs.bias_weights, bufs.bias.index(stage).permute((1, 0)), qk, is_async=True)
    return qk


@gluon.jit
def _softmax_rows(p, bufs, HALF: gl.constexpr):
    """One warpgroup: rows ``[HALF * 64, HALF * 64 + 64)`` of every work item of this program
    (``_softmax_item``)."""
    consumed = 0  # K/V tiles so far: the ring position, as in the loader
    zeroings = 0  # phases of ``zeroed``, a bit per ring position (``_issue_value_product``)
    items_done = 0
    index = taken_item(bufs, items_done)
    while index < p.items:
        consumed, zeroings = _softmax_item(p, bufs, index, items_done, consumed, zeroings, HALF)
        items_done += 1
        index = taken_item(bufs, items_done)


@gluon.jit
def _softmax_lower(p, bufs):
    _softmax_rows(p, bufs, 0)


@gluon.jit
def _softmax_upper(p, bufs):
    _softmax_rows(p, bufs, 1)


@gluon.jit
def _key_bias_weights(dtype: gl.constexpr, ROWS: gl.constexpr, scale):
    """The A operand of the product that adds a per-key bias to ``S`` (``_issue_scores``) ``[ROWS,
    KEY_BIAS_COLUMNS]``, in shared memory: ``1 / scale`` split in two values of ``dtype``, ``hi +
    lo`` (16 significant bits in bfloat16), in the two columns that meet the bias's two copies
    (``common._store_key_bias``), zeros elsewhere. ``S`` is the unscaled ``Q K^T``: its scale then
    gives back the bias. Both are nonzero (halves of ``hi`` where ``lo`` is 0) and of one sign, or
    an infinite bias would make NaN (times 0, or as inf - inf)."""
    layout: gl.constexpr = gl.BlockedLayout([1, KEY_BIAS_COLUMNS], [32, 1], [gl.num_warps(), 1], [1, 0])
    columns = gl.arange(0, KEY_BIAS_COLUMNS, gl.SliceLayout(0, layout))[None, :] + gl.zeros([ROWS, KEY_BIAS_COLUMNS], gl.int32, layout)
    inverse = gl.full([ROWS, KEY_BIAS_COLUMNS], 1.0, gl.float32, layout) / scale
    hi = inverse.to(dtype, fp_downcast_rounding="rtz").to(gl.float32)  # toward 0: lo has hi's sign
    lo = (inverse - hi).to(dtype).to(gl.float32)
    first = gl.where(lo == 0, hi * 0.5, hi)
    second = gl.where(lo == 0, hi * 0.5, lo)
    weights = gl.where(columns == 0, first, gl.where(columns == 1, second, 0.0))
    tile = gl.allocate_shared_memory(
        dtype, [ROWS, KEY_BIAS_COLUMNS], gl.NVMMASharedLayout.get_default_for([ROWS, KEY_BIAS_COLUMNS], dtype),
    )
    tile.store(weights.to(dtype))
    fence_async_shared()  # the tensor cores read it
    return tile


@jit_with_runtime_scalars
def _attn_fwd_hopper_kernel(
    Q, K, V, Mask, Bias, Walk, Descale, SeqQ, SeqK,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_mb, stride_mh, stride_mq, stride_mk, stride_bb, stride_bh, stride_bq, stride_bk,
    stride_wb, stride_wh, stride_wr, walk_width, mask_rows, mask_cols, bias_rows, bias_cols,
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group,
    mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k, band_lo, band_hi, scale, scale_log2,
    softcap_log2, scale_over_cap,
    MASK: gl.constexpr, BIAS: gl.constexpr, WALK: gl.constexpr, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr,
    STAGED_BIAS: gl.constexpr,
    SOFTCAP: gl.constexpr,
    Out, Lse, stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h, items, row_blocks,
    CacheRows, BlockTable, stride_table, page_size, cache_last, kv_batch,
    KV_STAGES: gl.constexpr, Q_SLOTS: gl.constexpr, FP8: gl.constexpr, SEQ: gl.constexpr, CACHE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
):
    # Descriptors of the whole [B, S, heads, D] tensors, made once per (persistent) program. K and V
    # have ``kv_batch`` rows of their own: a cache's rows, or one pool of pages.
    q_desc = tile_descriptor(Q, batch, seqlen_q, num_heads, COLUMNS, stride_qb, stride_qs, stride_qh, BLOCK_M, BLOCK_M, HEAD_DIM)
    k_desc = tile_descriptor(K, kv_batch, seqlen_k, num_kv_heads, COLUMNS, stride_kb, stride_ks, stride_kh, BLOCK_N, BLOCK_N, HEAD_DIM)
    if FP8:  # V transposed (``transposed_values``): [B * Hkv, COLUMNS, Sk'], strides of one head and one column
        # All Sk' = stride_vh keys: the copy's last group of 16 holds keys past Sk in its order (zeros).
        v_desc = tma.make_tensor_descriptor(
            V, [batch * num_kv_heads, COLUMNS, stride_vh], [stride_vs, stride_vh, 1], [1, HEAD_DIM, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([1, HEAD_DIM, BLOCK_N], V.dtype.element_ty),
        )
    else:
        v_desc = tile_descriptor(V, kv_batch, seqlen_k, num_kv_heads, COLUMNS, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_N, HEAD_DIM)
    o_desc = tile_descriptor(Out, batch, seqlen_q, num_heads, COLUMNS, stride_ob, stride_os, stride_oh, BLOCK_M // 2, BLOCK_M, HEAD_DIM)
    words_desc, bias_desc = staged_descriptors(
        Mask, Bias, q_desc, mask_rows, mask_cols, bias_rows, bias_cols, stride_mq, stride_bq, MASK, BIAS, STAGED_BIAS, BLOCK_M, BLOCK_N,
    )
    words, bias = staged_buffers(words_desc, bias_desc, Bias, MASK, BIAS, STAGED_BIAS, KV_STAGES, BLOCK_N, BLOCK_M)
    barrier: gl.constexpr = mbarrier.MBarrierLayout()
    out_tile = gl.allocate_shared_memory(gl.int32, [1, 1], PLAIN)
    if FP8:
        out_tile = gl.allocate_shared_memory(o_desc.dtype, [1, BLOCK_M, 1, HEAD_DIM], o_desc.layout)
    bias_weights = gl.allocate_shared_memory(gl.int32, [1, 1], PLAIN)
    if key_bias_staged(BIAS, STAGED_BIAS):
        bias_weights = _key_bias_weights(q_desc.dtype, BLOCK_M // 2, scale)
    bufs = _Buffers(
        gl.allocate_shared_memory(q_desc.dtype, [Q_SLOTS] + q_desc.block_type.shape, q_desc.layout),
        gl.allocate_shared_memory(k_desc.dtype, [KV_STAGES] + k_desc.block_type.shape, k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [KV_STAGES] + v_desc.block_type.shape, v_desc.layout),
        words,
        bias,
        gl.allocate_shared_memory(gl.int32, [Q_SLOTS, 1], PLAIN),
        gl.allocate_shared_memory(gl.int32, [Q_SLOTS, 1], PLAIN),
        gl.allocate_shared_memory(gl.int32, [2 * KV_STAGES, 1], PLAIN),  # spans: first keys, then last keys
        gl.allocate_shared_memory(gl.int32, [KV_STAGES, BLOCK_N], PLAIN),
        gl.allocate_shared_memory(gl.int32, [KV_STAGES, 1], PLAIN),
        gl.allocate_shared_memory(gl.float32, [KV_STAGES, BLOCK_N], PLAIN),
        gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        out_tile,
        bias_weights,
    )
    init_barriers(bufs, KV_STAGES)
    for i in gl.static_range(KV_STAGES):
        mbarrier.init(bufs.zeroed.index(i), count=1)
    p = Problem(
        q_desc, k_desc, v_desc, q_desc, o_desc, words_desc, bias_desc, Out, Lse, Lse, Mask, Bias, Walk, Descale, Lse, SeqQ, SeqK,  # no dO, delta, queue
        CacheRows, BlockTable, stride_table, page_size, cache_last,
        stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
        stride_mb, stride_mh, stride_mq, stride_mk, stride_bb, stride_bh, stride_bq, stride_bk,
        stride_wb, stride_wh, stride_wr, walk_width,
        seqlen_q, seqlen_k, num_heads, group, items, row_blocks,
        mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
        band_lo, band_hi, scale, scale_log2, softcap_log2, scale_over_cap,
        MASK, BIAS, WALK, HEAD_DIM, COLUMNS, STAGED_BIAS, SOFTCAP, KV_STAGES, BLOCK_M, BLOCK_N, False, FP8, SEQ, CACHE, False,
    )
    gl.warp_specialize(
        [(_softmax_lower, (p, bufs)), (_softmax_upper, (p, bufs)), (load_partition, (p, bufs))],
        [4, 1], [MATH_REGISTERS, LOADER_REGISTERS],
    )


hopper_launcher = Launcher(
    _attn_fwd_hopper_kernel, tensors=(*COMMON_TENSORS, "Descale", "SeqQ", "SeqK", "Out", "Lse", "CacheRows", "BlockTable"),
    specialized=(),
)


def hopper_forward(
    call: Call, out: torch.Tensor, lse: torch.Tensor, signature: tuple, sequences: Sequences | None = None,
    cache: CachePages | None = None,
) -> None:
    """Write ``out`` ``[B, Sq, H, D]`` and ``lse`` ``[B, H, Sq]`` float32 of ``call``, as
    ``forward.attention_forward`` would (its kv_lists or key list walked; packed sequences are
    ``[1, total, ...]`` and ``[1, H, total]``; ``sequences``: packed ones, or a KV cache's entries,
    found through ``cache``: in row b of the cache, in a row ``cache.rows`` names, or in pages of
    the pool ``[1, pages * page_size, Hkv, D]`` that ``cache.block_table`` lists, whose page size
    is a multiple of the key tiles). ``signature`` holds the call's layout
    (``layout.call_signature``), which fixes those of ``out`` and ``lse`` too: the launch is
    prepared once per signature and cache layout."""
    q = call.q
    head_dim = q.shape[3]
    row_blocks, items, seq_tables, seq = work_items(call, TILE.kwargs["BLOCK_M"], sequences)
    k, v, walk, walk_flag = walked_keys(call, call.kv_lists, kept_keys(call, sequences))
    fp8 = call.descale is not None
    if fp8:
        v = transposed_values(v)
    tensors = hopper_tensors(call, k, v, walk)
    key_bias_by_mma = adds_key_bias_by_mma(call, walk_flag, cache is not None)
    descale = call.descale if fp8 else placeholder(q.device, torch.float32)

    rows, table, page_size, cache_last = cache_tables(cache, k)
    kind = (
        CACHE_CONTIGUOUS if cache is None else CACHE_PAGES if cache.block_table is not None
        else CACHE_ROWS if cache.rows is not None else CACHE_CONTIGUOUS
    ).value
    wide = wide_tiles(head_dim)
    # FP8 rows are half as wide: a ring of D-column FP8 tiles is that of D / 2 16-bit ones.
    row_width = max(32, head_dim_tile(head_dim) * q.element_size() // 2)

    def build():
        runtime, flags = hopper_arguments(call, k, v, walk, walk_flag, seq, key_bias_by_mma)
        stages = STAGED_BIAS_KV_STAGES if stages_pair_bias(call, walk_flag) else KV_STAGES[row_width]
        own = [
            *out.stride()[:3], *lse.stride()[:2], items, row_blocks,
            rows, table, table.stride(0), page_size, cache_last, k.shape[0],
            stages, 1 if wide else 2, fp8, seq, kind,
        ]
        return [*tensors, descale, *seq_tables, *runtime, *flags, out, lse, *own], (q.dtype, *flags, kind)

    hopper_launcher.launch(
        (signature, tensor_layout(rows), tensor_layout(table), page_size, key_bias_by_mma),
        [*tensors, descale, *seq_tables, out, lse, rows, table], build, lambda: [WIDE_TILE if wide else TILE],
        lambda meta: (min(items, configs.multiprocessor_count(q.device)),),
    )
