"""Hopper dQ: the dQ kernel of ``../backward.py`` as a warp-specialised, persistent Gluon kernel.

It walks the forward's work items with the forward's loader (``common.load_partition``, which
also stages dO, the rows' LSEs and deltas with each item's Q), and two warpgroups accumulate dQ
of 64 rows each: per key tile ``S = Q K^T`` and ``dP = dO V^T`` from shared memory, then
``dQ += dS K`` with dS from registers. Masks and biases are read as in the forward
(``common.visible_scores``); a per-row mask needs nothing here (its rows' LSE is -inf, so their
probabilities are 0), and a per-row bias is taken out of the LSEs by the loader.

It is launched right behind dK/dV by programmatic dependent launch, and its programs start as
dK/dV's end, so they take the items off a queue rather than in turn (``hopper_dq``).
"""

# No `from __future__ import annotations`: the records below need their field types as objects.
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.hopper.common import (
    CACHE_CONTIGUOUS,
    COMMON_TENSORS,
    LOADER_REGISTERS,
    MATH_REGISTERS,
    MAX_REGISTERS,
    PLAIN,
    TILES,
    Problem,
    head_dim_tile,
    hopper_arguments,
    hopper_tensors,
    init_barriers,
    jit_with_runtime_scalars,
    keys_scored,
    load_partition,
    record,
    softcap_slope,
    staged_buffers,
    staged_descriptors,
    stages_pair_bias,
    store_rows,
    take_rows,
    taken_item,
    tile_descriptor,
    visible_scores,
    wait_for_previous_kernel,
    wait_for_scores,
    walked_keys,
    wide_tiles,
    work_items,
)
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import SEQ_PACKED, Call, Sequences, input_form

# Key tiles of 128 keys: the dQ kernel 11-16 % faster than with 64 at D = 128 (docs/design-notes.md,
# "Hopper backward: dQ's key tiles"), and without spills in its tile loop.
TILE = triton.Config(dict(BLOCK_M=TILES["dq"][0], BLOCK_N=128), num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
# Tiles of TILES["dq"]'s 64 keys, the routing table's unit: where a summary's key blocks are 64 keys;
# with softcap or a per-pair bias that the math warpgroups read, whose slope or bias tile beside S
# and dP spills 208-828 bytes at 128 keys (a bias the loader stages, D <= 64, takes 128 keys); and
# for packed sequences, whose tile loop reloads spilled words at 128 keys (3 % slower).
# Key intervals reload a few too and are faster at 128 keys all the same (docs/design-notes.md,
# "Tiles whose keys keep all of their rows or none").
SMALL_TILE = triton.Config(dict(zip(("BLOCK_M", "BLOCK_N"), TILES["dq"])), num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
# Head dims 192 and 256 (tiles of 256 columns): K/V tiles of 32 keys; a warpgroup's dQ is 128 of
# its 240 registers.
WIDE_TILE = triton.Config(dict(BLOCK_M=TILE.kwargs["BLOCK_M"], BLOCK_N=32), num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
# (tile head dim, keys a tile) -> (K/V stages, Q/dO slots), within shared memory: a second Q/dO slot
# loads the next item's rows during this one, except where two K/V stages leave no room for it
# (D = 128 with 128 keys: 2 x 64 KB of K/V and 64 KB of Q and dO; tiles of 256 columns).
RINGS = {
    (32, 128): (3, 2), (64, 128): (3, 2), (128, 128): (2, 1),
    (32, 64): (3, 2), (64, 64): (3, 2), (128, 64): (2, 2),
    (256, 32): (2, 1),
}
# 128 keys with a per-pair bias staged beside K and V (``common.stages_pair_bias``, D <= 64): its
# [128, 128] 16-bit tile takes 32 KB a stage, so two stages.
STAGED_BIAS_RINGS = (2, 2)


@record
class _Buffers:
    """Shared memory as in the forward (``forward._Buffers``; a staged per-pair bias fits beside
    three K/V tiles of 64 keys), plus dO and each item's LSEs and deltas. The kernel's problem is the forward's ``Problem``, its output in ``Out``."""

    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    words: gl.shared_memory_descriptor
    bias: gl.shared_memory_descriptor
    indices: gl.shared_memory_descriptor
    counts: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
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


@gluon.jit
def _dq_item(p, bufs, index, items_done, consumed, HALF: gl.constexpr):
    """Rows ``[HALF * 64, HALF * 64 + 64)`` of work item ``index``, the program's ``items_done``-th,
    its key tiles from ring position ``consumed``: returns the ring position after it."""
    ROWS: gl.constexpr = p.BLOCK_M // 2
    D: gl.constexpr = p.HEAD_DIM
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = p.q_desc.dtype
    # Staged key scores are read while the two products run (ptxas issues the loads between them),
    # not after S is waited for: up to 3% off the backward with a bias (docs/design-notes.md,
    # "Hopper backward: profile and variants"). Without key scores there is nothing to read early.
    READ_KEYS_EARLY: gl.constexpr = keys_scored(p.BIAS, p.MASK, p.WALK, p.STAGED_BIAS)

    batch, head, first_row, rows, q_slot, count, span = take_rows(p, bufs, index, items_done, HALF, rows_of_s)
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
        qk, staged = wait_for_scores(p, bufs, qk, 1, stage, keys_of_s, READ_KEYS_EARLY)
        s = visible_scores(p, bufs, qk, staged, stage, batch, head, span, first_row, rows, keys_of_s, ROWS, HALF)  # [ROWS, BLOCK_N]
        probs = gl.exp2(s - lse2[:, None])
        dp = warpgroup_mma_wait(0, deps=[dp])
        mbarrier.arrive(bufs.v_empty.index(stage), count=1)
        ds = probs * (dp - delta[:, None])
        if p.SOFTCAP:
            ds = ds * softcap_slope(p, qk)
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), operand_layout), k, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq])
        mbarrier.arrive(bufs.k_empty.index(stage), count=1)
        consumed += 1
    store_rows(p, bufs, q_slot, HALF, span, first_row, head, dq * p.scale)  # dS is the gradient of scale * q.k
    return consumed


@gluon.jit
def _dq_rows(p, bufs, HALF: gl.constexpr):
    """One warpgroup: rows ``[HALF * 64, HALF * 64 + 64)`` of every work item of this program
    (the forward's items and walk). Per key tile: ``S = Q K^T`` and ``dP = dO V^T`` from shared
    memory, ``dQ += dS K`` with dS from registers (``_dq_item``)."""
    consumed = 0  # K/V tiles so far: the ring position, as in the loader
    items_done = 0
    index = taken_item(bufs, items_done)
    while index < p.items:
        consumed = _dq_item(p, bufs, index, items_done, consumed, HALF)
        items_done += 1
        index = taken_item(bufs, items_done)


@gluon.jit
def _dq_lower(p, bufs):
    _dq_rows(p, bufs, 0)


@gluon.jit
def _dq_upper(p, bufs):
    _dq_rows(p, bufs, 1)


@jit_with_runtime_scalars
def _dq_hopper_kernel(
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
    DO, Lse, Delta, DQ, Queue, stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, items, row_blocks,
    KV_STAGES: gl.constexpr, Q_SLOTS: gl.constexpr, SEQ: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
):
    q_desc = tile_descriptor(Q, batch, seqlen_q, num_heads, COLUMNS, stride_qb, stride_qs, stride_qh, BLOCK_M, BLOCK_M, HEAD_DIM)
    do_desc = tile_descriptor(DO, batch, seqlen_q, num_heads, COLUMNS, stride_dob, stride_dos, stride_doh, BLOCK_M, BLOCK_M, HEAD_DIM)
    dq_desc = tile_descriptor(DQ, batch, seqlen_q, num_heads, COLUMNS, stride_dqb, stride_dqs, stride_dqh, BLOCK_M // 2, BLOCK_M, HEAD_DIM)
    k_desc = tile_descriptor(K, batch, seqlen_k, num_kv_heads, COLUMNS, stride_kb, stride_ks, stride_kh, BLOCK_N, BLOCK_N, HEAD_DIM)
    v_desc = tile_descriptor(V, batch, seqlen_k, num_kv_heads, COLUMNS, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_N, HEAD_DIM)
    words_desc, bias_desc = staged_descriptors(
        Mask, Bias, q_desc, mask_rows, mask_cols, bias_rows, bias_cols, stride_mq, stride_bq, MASK, BIAS, STAGED_BIAS, BLOCK_M, BLOCK_N,
    )
    words, bias = staged_buffers(words_desc, bias_desc, Bias, MASK, BIAS, STAGED_BIAS, KV_STAGES, BLOCK_N, BLOCK_M)
    barrier: gl.constexpr = mbarrier.MBarrierLayout()
    bufs = _Buffers(
        gl.allocate_shared_memory(q_desc.dtype, [Q_SLOTS] + q_desc.block_type.shape, q_desc.layout),
        gl.allocate_shared_memory(do_desc.dtype, [Q_SLOTS] + do_desc.block_type.shape, do_desc.layout),
        gl.allocate_shared_memory(k_desc.dtype, [KV_STAGES] + k_desc.block_type.shape, k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [KV_STAGES] + v_desc.block_type.shape, v_desc.layout),
        words,
        bias,
        gl.allocate_shared_memory(gl.int32, [Q_SLOTS, 1], PLAIN),
        gl.allocate_shared_memory(gl.int32, [Q_SLOTS, 1], PLAIN),
        gl.allocate_shared_memory(gl.float32, [Q_SLOTS, BLOCK_M], PLAIN),
        gl.allocate_shared_memory(gl.float32, [Q_SLOTS, BLOCK_M], PLAIN),
        gl.allocate_shared_memory(gl.int32, [2 * KV_STAGES, 1], PLAIN),
        gl.allocate_shared_memory(gl.int32, [KV_STAGES, BLOCK_N], PLAIN),
        gl.allocate_shared_memory(gl.int32, [KV_STAGES, 1], PLAIN),
        gl.allocate_shared_memory(gl.float32, [KV_STAGES, BLOCK_N], PLAIN),
        gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
        gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], barrier),
    )
    init_barriers(bufs, KV_STAGES)
    p = Problem(
        q_desc, k_desc, v_desc, do_desc, dq_desc, words_desc, bias_desc, DQ, Delta, Lse, Mask, Bias, Walk, Lse, Queue, SeqQ, SeqK,  # no descale
        SeqK, SeqK, seqlen_k, seqlen_k, seqlen_k,  # no cache: its rows, pages and their sizes are never read
        stride_dqb, stride_dqs, stride_dqh,
        seqlen_q * num_heads, seqlen_q, stride_mb, stride_mh, stride_mq, stride_mk, stride_bb, stride_bh, stride_bq, stride_bk,
        stride_wb, stride_wh, stride_wr, walk_width,
        seqlen_q, seqlen_k, num_heads, group, items, row_blocks,
        mask_head_div, bias_head_div, walk_head_div, list_block_q, list_block_k,
        band_lo, band_hi, scale, scale_log2, softcap_log2, scale_over_cap,
        MASK, BIAS, WALK, HEAD_DIM, COLUMNS, STAGED_BIAS, SOFTCAP, KV_STAGES, BLOCK_M, BLOCK_N, True, False, SEQ, CACHE_CONTIGUOUS, True,
    )
    gl.warp_specialize(
        [(_dq_lower, (p, bufs)), (_dq_upper, (p, bufs)), (load_partition, (p, bufs))],
        [4, 1], [MATH_REGISTERS, LOADER_REGISTERS],
    )
    wait_for_previous_kernel()


# Launched behind dK/dV, whose programs let it start as they end (``hopper_dq``).
hopper_dq_launcher = Launcher(
    _dq_hopper_kernel, tensors=(*COMMON_TENSORS, "SeqQ", "SeqK", "DO", "Lse", "Delta", "DQ", "Queue"), specialized=(),
    options=dict(launch_pdl=True),
)


def hopper_dq(
    call: Call, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, queue: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor], signature: tuple, sequences: Sequences | None = None,
) -> None:
    """Write ``dq`` ``[B, Sq, H, D]`` of ``call`` as the Triton dQ kernel would; ``dout`` ``[B,
    Sq, H, D]``, ``lse`` and ``delta`` ``[B, H, Sq]`` float32, contiguous (packed ``sequences``:
    ``[1, total, ...]`` and ``[1, H, total]``); ``queue`` ``[1]`` int32, zeroed; ``kept`` the
    keys ``common.kept_keys`` gave. ``signature`` holds the layouts of the call, of ``dout`` and
    of ``dq`` (``backward.attention_backward``'s): the launch is prepared once per signature.

    The launch goes right behind dK/dV's (``dkdv.hopper_dkdv``), inside the caller's
    ``launch.kernels_side_by_side`` block, with all it reads made before dK/dV's: its programs
    start on the multiprocessors that dK/dV's programs free as they end, and take items off
    ``queue`` as they come (``common._first_item``). docs/design-notes.md, "Hopper backward: dQ
    beside dK/dV's last programs", has why and what it gains."""
    q = call.q
    head_dim = q.shape[3]
    # Every tile has TILE's rows; which one the call takes is the layout's (built once per signature).
    row_blocks, items, seq_tables, seq = work_items(call, TILE.kwargs["BLOCK_M"], sequences)
    k, v, walk, walk_flag = walked_keys(call, call.kv_lists, kept)
    tensors = hopper_tensors(call, k, v, walk)

    def build():
        runtime, flags = hopper_arguments(call, k, v, walk, walk_flag, seq)
        rings = _rings(call, head_dim, sequences, walk_flag)
        own = [*dout.stride()[:3], *dq.stride()[:3], items, row_blocks, *rings, seq]
        return [*tensors, *seq_tables, *runtime, *flags, dout, lse, delta, dq, queue, *own], (q.dtype, dq.dtype, *flags)

    hopper_dq_launcher.launch(
        signature, [*tensors, *seq_tables, dout, lse, delta, dq, queue], build, lambda: [_tile(call, head_dim, sequences, walk_flag)],
        lambda meta: (min(items, configs.multiprocessor_count(q.device)),),
    )


def _tile(call: Call, head_dim: int, sequences: Sequences | None, walk_flag: int) -> triton.Config:
    """The kernel's configuration for ``call`` over ``sequences`` and its walk (see TILE, SMALL_TILE
    and WIDE_TILE)."""
    if wide_tiles(head_dim):
        return WIDE_TILE
    packed = sequences is not None and sequences.kind == SEQ_PACKED
    read_pair_bias = input_form(call.bias) == "pairs" and not stages_pair_bias(call, walk_flag)
    if packed or call.softcap > 0 or read_pair_bias or call.list_block_k % TILE.kwargs["BLOCK_N"] != 0:
        return SMALL_TILE
    return TILE


def _rings(call: Call, head_dim: int, sequences: Sequences | None, walk_flag: int) -> tuple[int, int]:
    """``(K/V stages, Q/dO slots)`` of the call's tile (``RINGS``, ``STAGED_BIAS_RINGS``)."""
    keys = _tile(call, head_dim, sequences, walk_flag).kwargs["BLOCK_N"]
    if keys == TILE.kwargs["BLOCK_N"] and stages_pair_bias(call, walk_flag):
        return STAGED_BIAS_RINGS
    return RINGS[head_dim_tile(head_dim), keys]
