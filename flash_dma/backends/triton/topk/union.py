"""Top-k index attention backward over the union of a query block's keys, with dK and dV added by atomics.

The per-query backward (``topk/backward.py``) gathers each query's keys for its group of ``G``
heads alone: tiles of ``G`` rows padded to 16, every key gathered (and its dK/dV rows added to) once
per query that lists it. Here a program owns ``QUERIES`` consecutive queries of one key/value head
(``QUERIES x G`` rows, 64 at GQA group sizes) and walks the *union* of their listed keys once:

- :func:`union_lists` builds, per (batch, key/value head, query block), the union: each key that
  counts for some query of the block once, with a word whose bit ``t`` says that query ``t`` of the
  block lists it. A key one query lists twice weighs twice (``docs/api.md``): its second entry is
  one more element of the union, with that query's bit alone.
- ``_union_bwd_kernel``, grid ``(blocks, B x Hkv)``: dQ, and each tile's ``P^T dO``, ``dS^T Q`` (and
  a per-key bias's dS) added to fp32 dK and dV by atomics, a pair counting where its row's bit is
  set.

A block's union costs its size in gathers and atomics and ``QUERIES x G`` rows of products per key,
against ``QUERIES x W`` of each for the per-query walk: it pays when neighbouring queries list the
same keys, as an indexer's selections do. So the backward splits a call block by block: a block
whose union holds at most :data:`UNION_SHARE` of its ``QUERIES x W`` entries takes this kernel, the
others the per-query walk (:class:`UnionSplit`; design notes, "Top-k index attention: the union of
a query block's keys"). The forward stays per query: a union forward saved less than its build cost
in the cases measured. ``dispatch`` sends to the per-query kernels a bias per listed pair, which
has no place in the union (its entries are per slot), and groups of 16 heads or more, whose
blocks of 4 queries or fewer share too few keys to pay.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.backward import softmax_grad
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import TopkCall, band, placeholder
from flash_dma.backends.triton.tiles import load_tile
from flash_dma.backends.triton.topk.tiles import (
    GRADIENT_STRIDES,
    TOPK_NOT_SPECIALIZED,
    TOPK_SPECIALIZED,
    add_key_gradients,
    counts_in_band,
    gradient_rows,
    topk_launch,
    topk_scores,
    union_size,
)
from flash_dma.integers import cdiv

# Rows of a program's tiles (queries x the group's heads): wgmma's least M. A block's membership
# words are int32, so a block holds at most 16 queries (bit 31 stays clear).
UNION_ROWS = 64
MAX_QUERIES = 16
# A block whose union holds at most this share of its QUERIES x W entries takes the union kernel.
# Per gathered key the union backward costs about 1.8x what the per-query walk costs (64 rows of
# products against 16; H100, llm shape, 32K and 128K): design notes, "Top-k index attention: the
# union of a query block's keys".
UNION_SHARE = 0.5
# The per-query and union kernels' parameters for the split (:class:`UnionSplit`).
UNION_NOT_SPECIALIZED = ("num_blocks", "union_limit")
_UNION_KERNEL_NOT_SPECIALIZED = (*TOPK_NOT_SPECIALIZED, "capacity", *UNION_NOT_SPECIALIZED, "block_start", "group_blocks")
_BUILD_NOT_SPECIALIZED = (
    "seqlen_q", "seqlen_k", "num_kv_heads", "width", "band_lo", "band_hi", "num_blocks", "block_start", "group_blocks", "rows",
    "capacity", "key_range", "limit",
)
# Entries a builder program takes at a time; programs per SM; keys per pass over a block's entries.
# Each program owns a scratch row of key_range membership words: 32K keys keep the scratch of every
# program (66 MiB on an H100) mostly in L2. H100, llm shape, W = 2048, one backward's build: 6.6 ms
# at 32K, 48 (random selections) to 58 (overlapping) at 128K; 2, 8 and 16 programs per SM and passes
# of 64K keys measured within -8 % and +23 % of the settings here, and passes of 16K keys 1.7x
# slower at 128K (at 1 program per SM).
_BUILD_CHUNK = 1024
_BUILD_PROGRAMS_PER_SM = 4
_BUILD_KEY_RANGE = 32768
# List entries (8 bytes each) built at a time in the backward: 512 MiB, whatever the length.
_GROUP_ENTRIES = 1 << 26


def union_queries(group: int) -> int:
    """Queries per block for a GQA group of ``group`` query heads: ``UNION_ROWS`` rows of tiles."""
    return max(1, min(MAX_QUERIES, UNION_ROWS // configs.next_power_of_2(group)))


@triton.jit(do_not_specialize=_BUILD_NOT_SPECIALIZED)
def _union_lists_kernel(
    Indices, Keys, Words, Lengths, Scratch,
    stride_ib, stride_is, stride_ih, stride_iw,
    seqlen_q, seqlen_k, num_kv_heads, width, band_lo, band_hi, num_blocks, block_start, group_blocks, rows, capacity, key_range,
    limit,
    QUERIES: tl.constexpr, CHUNK: tl.constexpr,
):
    """Persistent: a program builds the lists of rows ``pid, pid + programs, ...`` of the group of
    ``group_blocks`` blocks from ``block_start`` (see :func:`union_lists`) with its own scratch row
    ``[key_range]`` of membership words, all zero between passes (and left so). A pass takes the block's entries whose keys lie in one range of ``key_range``
    keys: each ORs its query's bit into its key's word; the entry that finds the word 0 brings a new
    key (appended from the front), one that finds its own bit set is a repeat (appended from the
    back, with its bit). Then each new key's word is taken, and its scratch word cleared, by one
    exchange. A block stops reading entries once its union holds more than ``limit``: the per-query
    walk takes it, and its lengths say so."""
    pid = tl.program_id(0)
    scratch = Scratch + pid.to(tl.int64) * key_range
    e = tl.arange(0, CHUNK)
    programs = tl.num_programs(0)
    for step in range(0, tl.cdiv(rows - pid, programs)):
        row = pid + step * programs  # of the group: (b * Hkv + kv_head) * group_blocks + block - block_start
        bh = row // group_blocks
        b = (bh // num_kv_heads).to(tl.int64)
        kv_head = (bh % num_kv_heads).to(tl.int64)
        block = block_start + row % group_blocks
        lengths = Lengths + 2 * (bh.to(tl.int64) * num_blocks + block)
        lists = row.to(tl.int64) * capacity
        index_rows = Indices + b * stride_ib + kv_head * stride_ih
        distinct = 0
        repeats = 0
        # A block that has passed its limit reads no more entries: while loops, not masked ones.
        low = 0
        while (low < seqlen_k) & (distinct + repeats <= limit):
            first = distinct
            e0 = 0
            while (e0 < QUERIES * width) & (distinct + repeats <= limit):
                entry = e0 + e  # [CHUNK]: query of the block (major), slot (minor)
                member = entry // width
                query = block * QUERIES + member
                listed = (entry < QUERIES * width) & (query < seqlen_q)
                keys = tl.load(index_rows + query.to(tl.int64) * stride_is + (entry % width) * stride_iw, mask=listed, other=-1)
                counts = listed & counts_in_band(keys, query, seqlen_q, seqlen_k, band_lo, band_hi)
                counts = counts & (keys >= low) & (keys < low + key_range)
                bit = (tl.zeros_like(member) + 1) << member
                old = tl.atomic_or(scratch + (keys - low), bit, mask=counts, sem="relaxed")
                new = counts & (old == 0)
                repeat = counts & ((old & bit) != 0)
                tl.store(Keys + lists + distinct + tl.cumsum(new.to(tl.int32), 0) - 1, keys, mask=new)
                back = lists + capacity - repeats - tl.cumsum(repeat.to(tl.int32), 0)
                tl.store(Keys + back, keys, mask=repeat)
                tl.store(Words + back, bit, mask=repeat)
                distinct += tl.sum(new.to(tl.int32), 0)
                repeats += tl.sum(repeat.to(tl.int32), 0)
                e0 += CHUNK
            tl.debug_barrier()  # every OR done, every new key stored
            for n0 in range(first, distinct, CHUNK):  # this pass's keys, also when the block stopped in it
                n = n0 + e
                ok = n < distinct
                keys = tl.load(Keys + lists + n, mask=ok, other=low)
                tl.store(Words + lists + n, tl.atomic_xchg(scratch + (keys - low), 0, mask=ok, sem="relaxed"), mask=ok)
            tl.debug_barrier()  # the scratch row is clear before the next pass's ORs
            low += key_range
        tl.store(lengths, distinct)
        tl.store(lengths + 1, repeats)


BUILD_LAUNCHER = Launcher(
    _union_lists_kernel, tensors=("Indices", "Keys", "Words", "Lengths", "Scratch"),
    specialized=("stride_ib", "stride_is", "stride_ih", "stride_iw"),
)


def union_lists(call: TopkCall, queries: int, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, words, lengths)`` of each query block's union (module doc), in rows ``(b * Hkv +
    kv_head) * blocks + block``: ``keys`` and ``words`` ``[rows, entries]`` int32 (``entries``:
    ``queries * W``, or fewer with a ``limit``, :func:`_row_size`), ``lengths`` ``[rows, 2]`` int32:
    the union's distinct keys lie at the front of a row, ``lengths[row, 0]`` of them, and its repeats
    at the back, ``lengths[row, 1]`` (:func:`union_tile` walks both). A block whose union outgrows
    ``limit`` entries (None: no limit) is left part-built, its lengths summing to more than
    ``limit``. No host synchronisation; the order of keys within a row is the order the entries
    reached them."""
    batch, seqlen_q, num_kv_heads, width = call.indices.shape
    blocks = cdiv(seqlen_q, queries)
    lengths = torch.empty(batch * num_kv_heads * blocks, 2, dtype=torch.int32, device=call.indices.device)
    limit = queries * width if limit is None else limit
    keys, words = _build_group(call, queries, limit, lengths, _scratch(call, blocks), 0, blocks)
    return keys, words, lengths


def _scratch(call: TopkCall, group_blocks: int) -> torch.Tensor:
    """The build's membership words ``[programs, key_range]`` int32, zero: one row per program of a
    build of ``group_blocks`` blocks, which leaves it zero again for the next group."""
    batch, _, num_kv_heads, _ = call.indices.shape
    device = call.indices.device
    programs = max(1, min(batch * num_kv_heads * group_blocks, _BUILD_PROGRAMS_PER_SM * configs.multiprocessor_count(device)))
    return torch.zeros(programs, max(1, min(call.k.shape[1], _BUILD_KEY_RANGE)), dtype=torch.int32, device=device)


def _row_size(queries: int, width: int, limit: int) -> int:
    """Entries a block's lists hold: those of a union of at most ``limit`` entries, plus the chunk
    the build adds before it sees the limit passed."""
    return max(1, min(queries * width, max(limit, 0) + _BUILD_CHUNK))


def _build_group(
    call: TopkCall, queries: int, limit: int, lengths: torch.Tensor, scratch: torch.Tensor, block_start: int, group_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the lists of blocks ``[block_start, block_start + group_blocks)`` of every (batch,
    key/value head), rows ``(b * Hkv + kv_head) * group_blocks + block - block_start``, writing their
    rows of ``lengths`` (all the call's blocks), with the zero ``scratch`` (:func:`_scratch`)."""
    indices, seqlen_k = call.indices, call.k.shape[1]
    batch, seqlen_q, num_kv_heads, width = indices.shape
    rows, capacity = batch * num_kv_heads * group_blocks, _row_size(queries, width, limit)
    device = indices.device
    keys = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    words = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    if rows == 0:
        return keys, words
    programs, key_range = min(rows, scratch.shape[0]), scratch.shape[1]
    band_lo, band_hi = band(call.window_left, call.window_right, seqlen_q, seqlen_k)
    tensors = [indices, keys, words, lengths, scratch]
    args = [
        *tensors, *indices.stride(), seqlen_q, seqlen_k, num_kv_heads, width, band_lo, band_hi, cdiv(seqlen_q, queries),
        block_start, group_blocks, rows, capacity, key_range, limit, queries,
    ]
    BUILD_LAUNCHER.launch(
        (indices.shape, indices.stride(), programs, *args[len(tensors):]), tensors, lambda: (args, (queries,)),
        lambda: [triton.Config({"CHUNK": _BUILD_CHUNK}, num_warps=4, num_stages=1)], lambda meta: (programs,),
    )
    return keys, words


@triton.jit
def union_rows(
    Q, Bias, b, block, kv_head, group, seqlen_q, head_dim, bias_head_div, stride_qb, stride_qs, stride_qh, stride_bb, stride_bh,
    QUERIES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """What a (batch ``b``, query block, key/value head) program reads once: per row ``[BLOCK_M]``
    (queries major, the group's heads padded to ``BLOCK_M / QUERIES`` minor) its query within the
    block, query, head of the group, head and whether it is real, its q ``[BLOCK_M, BLOCK_D]`` and
    its per-key bias row."""
    BLOCK_G: tl.constexpr = BLOCK_M // QUERIES
    r = tl.arange(0, BLOCK_M)
    member = r // BLOCK_G
    group_head = r % BLOCK_G
    query = block * QUERIES + member
    row_ok = (group_head < group) & (query < seqlen_q)
    head = kv_head * group + tl.minimum(group_head, group - 1)
    q_rows = Q + b * stride_qb + query * stride_qs + head.to(tl.int64) * stride_qh  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d < head_dim)[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    bias_rows = Bias + b * stride_bb + (head // bias_head_div).to(tl.int64) * stride_bh  # [BLOCK_M]
    return member, query, group_head, head, row_ok, q, bias_rows


@triton.jit
def union_tile(Keys, Words, lists, capacity, n0, distinct, length, member, BLOCK_N: tl.constexpr):
    """``(keys, listed, counts)``: keys ``[BLOCK_N]`` of union entries ``n0..`` (0 past the union),
    whether the entry is in it, and ``[BLOCK_M, BLOCK_N]`` whether each row's query lists the key.
    Entries ``[0, distinct)`` are a row's front, the rest its back (:func:`union_lists`)."""
    n = n0 + tl.arange(0, BLOCK_N)
    listed = n < length
    at = lists + tl.where(n < distinct, n, capacity - 1 - (n - distinct))
    keys = tl.load(Keys + at, mask=listed, other=0)
    words = tl.load(Words + at, mask=listed, other=0)
    counts = ((words[None, :] >> member[:, None]) & 1) != 0  # [BLOCK_M, BLOCK_N]
    return keys, listed, counts


@triton.jit(do_not_specialize=_UNION_KERNEL_NOT_SPECIALIZED)
def _union_bwd_kernel(
    Q, K, V, Indices, Bias, Keys, Words, Lengths, Out, DO, Lse, Delta, DQ, DKAcc, DVAcc, DBiasKeys,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ib, stride_is, stride_ih, stride_iw, stride_bb, stride_bs, stride_bh, stride_bw,
    seqlen_q, seqlen_k, num_kv_heads, group, head_dim, width, bias_head_div, band_lo, band_hi,
    scale_log2, softcap_log2, scale_over_cap,
    capacity, num_blocks, union_limit, block_start, group_blocks, stride_dob, stride_dos, stride_doh, scale,
    HAS_BIAS: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUERIES: tl.constexpr, DBIAS_PER_HEAD: tl.constexpr, DBIAS_KEYS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    block = block_start + tl.program_id(0).to(tl.int64)  # of the group's blocks
    b = (tl.program_id(1) // num_kv_heads).to(tl.int64)
    kv_head = tl.program_id(1) % num_kv_heads
    list_row = tl.program_id(1).to(tl.int64) * num_blocks + block
    if union_size(Lengths, list_row) > union_limit:  # the per-query kernel serves this block
        return
    member, query, group_head, head, row_ok, q, bias_rows = union_rows(
        Q, Bias, b, block, kv_head, group, seqlen_q, head_dim, bias_head_div, stride_qb, stride_qs, stride_qh, stride_bb, stride_bh,
        QUERIES, BLOCK_M, BLOCK_D,
    )
    do, delta, lse2, row_offsets, tile_ok = gradient_rows(
        Out, DO, Lse, Delta, b, query, head, row_ok, seqlen_q, group * num_kv_heads, head_dim, stride_dob, stride_dos, stride_doh,
        BLOCK_D,
    )
    lists = (tl.program_id(1).to(tl.int64) * group_blocks + tl.program_id(0)) * capacity
    distinct = tl.load(Lengths + 2 * list_row)
    length = distinct + tl.load(Lengths + 2 * list_row + 1)
    k_rows = K + b * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_rows = V + b * stride_vb + kv_head.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, length, BLOCK_N):
        keys, listed, counts = union_tile(Keys, Words, lists, capacity, n0, distinct, length, member, BLOCK_N)
        k = load_tile(k_rows, keys, listed, stride_ks, head_dim, True, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        v = load_tile(v_rows, keys, listed, stride_vs, head_dim, True, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        s, scores = topk_scores(  # [BLOCK_M, BLOCK_N]
            q, k, bias_rows, stride_bw, keys, keys, listed, row_ok, scale_log2, softcap_log2, scale_over_cap,
            HAS_BIAS, BIAS_PER_KEY, SOFTCAP, DOT_PRECISION,
        )
        s = tl.where(counts, s, float("-inf"))
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        p, ds, dqk = softmax_grad(s, lse2, delta, dp, 0, scale, softcap_log2, SOFTCAP, scores)  # [BLOCK_M, BLOCK_N]
        dq += tl.dot(dqk.to(k.dtype), k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
        add_key_gradients(
            DKAcc, DVAcc, DBiasKeys, p, ds, dqk, q, do, keys, listed, group_head, row_ok, b, kv_head, seqlen_k, num_kv_heads,
            group, head_dim, DBIAS_KEYS, DBIAS_PER_HEAD, DOT_PRECISION, BLOCK_D,
        )
    tl.store(DQ + row_offsets, dq.to(DQ.dtype.element_ty), mask=tile_ok)


_LIST_TENSORS = ("Keys", "Words", "Lengths")
BACKWARD_LAUNCHER = Launcher(
    _union_bwd_kernel,
    tensors=("Q", "K", "V", "Indices", "Bias", *_LIST_TENSORS, "Out", "DO", "Lse", "Delta", "DQ", "DKAcc", "DVAcc", "DBiasKeys"),
    specialized=(*TOPK_SPECIALIZED, *GRADIENT_STRIDES), reset_to_zero=("DKAcc", "DVAcc", "DBiasKeys"),
)


class UnionSplit(NamedTuple):
    """How the backward splits its query blocks between the union kernel and the per-query walk:
    ``queries`` per block (0: no split, every query takes the per-query walk), ``blocks`` per
    (batch, key/value head), ``limit``: a block whose union has at most ``limit`` entries takes
    the union kernel, and the blocks' ``lengths`` (:func:`union_lists`), which
    :func:`union_backward` writes before the per-query walk reads them."""

    lengths: torch.Tensor
    queries: int
    blocks: int
    limit: int

    @staticmethod
    def none(device: torch.device) -> "UnionSplit":
        return UnionSplit(placeholder(device, torch.int32), 0, 0, 0)

    def runtime(self) -> list:
        """The split's kernel parameters (``num_blocks``, ``union_limit``)."""
        return [self.blocks, self.limit]


def union_split(call: TopkCall) -> UnionSplit:
    """The backward's split of ``call`` (its lengths not yet built)."""
    batch, seqlen_q, num_kv_heads, width = call.indices.shape
    queries = union_queries(call.q.shape[2] // num_kv_heads)
    blocks = cdiv(seqlen_q, queries)
    lengths = torch.empty(batch * num_kv_heads * blocks, 2, dtype=torch.int32, device=call.q.device)
    return UnionSplit(lengths, queries, blocks, int(UNION_SHARE * queries * width))


def union_backward(
    dout: torch.Tensor, call: TopkCall, split: UnionSplit, out, lse, delta, dq, dk_acc, dv_acc, key_grad, per_head: bool,
) -> None:
    """Build ``split``'s lengths, and the backward of the query blocks it gives the union kernel:
    their ``delta`` ``[B, H, Sq]`` and ``dq`` rows, and their parts of fp32 ``dk_acc``, ``dv_acc``
    ``[B, Sk, Hkv, D]`` and a per-key bias's ``key_grad`` ``[B, Hkv, G or 1, Sk]`` (empty when none
    is asked). The blocks go a group at a time, so that the lists of ``_GROUP_ENTRIES`` entries at
    most exist at once."""
    batch, _, num_kv_heads, width = call.indices.shape
    group = call.q.shape[2] // num_kv_heads
    row_size = _row_size(split.queries, width, split.limit)
    group_blocks = min(split.blocks, max(1, _GROUP_ENTRIES // (batch * num_kv_heads * row_size)))
    scratch = _scratch(call, group_blocks)  # every group's: each build leaves it zero
    for block_start in range(0, split.blocks, group_blocks):
        blocks = min(group_blocks, split.blocks - block_start)
        keys, words = _build_group(call, split.queries, split.limit, split.lengths, scratch, block_start, blocks)
        topk_launch(
            BACKWARD_LAUNCHER, call, [keys, words, split.lengths, out, dout, lse, delta, dq, dk_acc, dv_acc, key_grad],
            [row_size, *split.runtime(), block_start, blocks, *dout.stride()[:3], call.softmax_scale],
            [split.queries, per_head, key_grad.numel() > 0],
            lambda: configs.union_candidates(configs.head_dim_block(call.q.shape[3]), group, split.queries), blocks,
        )
