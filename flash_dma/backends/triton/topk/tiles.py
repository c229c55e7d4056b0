"""Top-k index attention: the tile helpers and the launch that the per-query kernels
(``topk/forward.py``, ``topk/backward.py``) and the union kernels (``topk/union.py``) share.

The kernels share their leading parameters (``topk_arguments``): the tensors of the call, then its
strides, sizes and scales; ``topk_launch`` fills them and appends each kernel's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.layout import TOPK_TENSORS, TopkCall, band, call_signature, placeholder
from flash_dma.backends.triton.tiles import LOG2E, scores_log2

TOPK_SPECIALIZED = (
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
    "stride_ib", "stride_is", "stride_ih", "stride_iw", "stride_bb", "stride_bs", "stride_bh", "stride_bw", "head_dim",
)
GRADIENT_STRIDES = ("stride_dob", "stride_dos", "stride_doh")
TOPK_NOT_SPECIALIZED = ("seqlen_q", "seqlen_k", "num_kv_heads", "group", "width", "bias_head_div", "band_lo", "band_hi")


@triton.jit
def counts_in_band(keys, query, seqlen_q, seqlen_k, band_lo, band_hi):
    """Whether entries listing ``keys`` for ``query`` (either may be per element) count: in
    ``[0, Sk)`` and inside the query's causal/window band."""
    offset = keys - (query + seqlen_k - seqlen_q)  # key position minus the query's diagonal key
    return (keys >= 0) & (keys < seqlen_k) & (offset >= band_lo) & (offset <= band_hi)


@triton.jit
def union_size(Lengths, list_row):
    """Entries of the union of query block ``list_row`` (``union.union_lists``): a block takes
    the union kernels when it is at most the pass's limit, else the per-query kernels."""
    return tl.load(Lengths + 2 * list_row) + tl.load(Lengths + 2 * list_row + 1)


@triton.jit
def topk_scores(
    q, k, bias_rows, stride_bw, slots, keys, valid, row_ok, scale_log2, softcap_log2, scale_over_cap,
    HAS_BIAS: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``(s, scores)`` ``[BLOCK_M, BLOCK_N]`` in the log2 domain: with the bias and ``-inf`` where a
    slot does not count, and before the bias (for the softcap derivative)."""
    scores = scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale_log2, softcap_log2, scale_over_cap, SOFTCAP)
    s = scores
    if HAS_BIAS:
        columns = keys if BIAS_PER_KEY else slots  # a per-key bias is read at the key, a per-pair one at the slot
        bias = tl.load(bias_rows[:, None] + (columns.to(tl.int64) * stride_bw)[None, :], mask=row_ok[:, None] & valid[None, :], other=0.0)
        s += bias.to(tl.float32) * LOG2E
    return tl.where(valid[None, :], s, float("-inf")), scores


@triton.jit
def lse2_rows(Lse, offsets, ok):
    """log2-domain LSE at ``offsets``; rows with no counting key (LSE -inf) and rows not ``ok``
    get +inf, so that their probabilities, and hence their gradients, are exactly 0."""
    lse = tl.load(Lse + offsets, mask=ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


@triton.jit
def gradient_rows(
    Out, DO, Lse, Delta, b, query, head, row_ok, seqlen_q, num_heads, head_dim, stride_dob, stride_dos, stride_doh,
    BLOCK_D: tl.constexpr,
):
    """What a backward walk reads of its rows (query ``query``, head ``head``; either may be per
    row) before the keys: ``(do, delta, lse2, row_offsets, tile_ok)``. It writes ``delta =
    rowsum(dO * O)``, which the key-outer dK/dV kernel reads back."""
    offs_d = tl.arange(0, BLOCK_D)
    tile_ok = row_ok[:, None] & (offs_d < head_dim)[None, :]
    # Out and DQ are contiguous [B, Sq, H, D]; Lse and Delta [B, H, Sq].
    row_offsets = ((b * seqlen_q + query) * num_heads + head)[:, None] * head_dim + offs_d[None, :]  # [BLOCK_M, BLOCK_D]
    do_rows = DO + b * stride_dob + query * stride_dos + head.to(tl.int64) * stride_doh  # [BLOCK_M]
    do = tl.load(do_rows[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)  # [BLOCK_M, BLOCK_D]
    o = tl.load(Out + row_offsets, mask=tile_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # [BLOCK_M]
    lse_offsets = (b * num_heads + head) * seqlen_q + query
    tl.store(Delta + lse_offsets, delta, mask=row_ok)
    return do, delta, lse2_rows(Lse, lse_offsets, row_ok), row_offsets, tile_ok


@triton.jit
def add_key_gradients(
    DKAcc, DVAcc, DBiasKeys, p, ds, dqk, q, do, keys, valid, group_head, row_ok, b, kv_head, seqlen_k, num_kv_heads, group,
    head_dim, DBIAS_KEYS: tl.constexpr, DBIAS_PER_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Add a tile's ``P^T dO`` and ``dS^T Q`` ``[BLOCK_N, BLOCK_D]`` to fp32 dK and dV at its keys
    ``[BLOCK_N]`` (those ``valid``), and with DBIAS_KEYS its dS to a per-key bias gradient (per
    head of the group, ``group_head`` ``[BLOCK_M]``, with DBIAS_PER_HEAD). A key listed twice adds
    twice, as it weighs."""
    offs_d = tl.arange(0, BLOCK_D)
    # DKAcc and DVAcc are contiguous fp32 [B, Sk, Hkv, D].
    key_offsets = ((b * seqlen_k + keys) * num_kv_heads + kv_head)[:, None] * head_dim + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    key_ok = valid[:, None] & (offs_d < head_dim)[None, :]
    dv_part = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_D]
    tl.atomic_add(DVAcc + key_offsets, dv_part, mask=key_ok, sem="relaxed")
    dk_part = tl.dot(tl.trans(dqk.to(q.dtype)), q, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_D]
    tl.atomic_add(DKAcc + key_offsets, dk_part, mask=key_ok, sem="relaxed")
    if DBIAS_KEYS:  # the per-key bias gradient, [B, Hkv, G or 1, Sk]
        dbias_keys = DBiasKeys + (b * num_kv_heads + kv_head) * (group if DBIAS_PER_HEAD else 1) * seqlen_k
        if DBIAS_PER_HEAD:
            offsets = (group_head * seqlen_k)[:, None] + keys[None, :]  # [BLOCK_M, BLOCK_N]
            tl.atomic_add(dbias_keys + offsets, ds, mask=row_ok[:, None] & valid[None, :], sem="relaxed")
        else:
            tl.atomic_add(dbias_keys + keys, tl.sum(ds, 0), mask=valid, sem="relaxed")


def topk_arguments(call: TopkCall) -> tuple[list, list]:
    """``(runtime, constexprs)``: the parameters the top-k kernels share after their pointers, in order."""
    q, k, v, indices, bias = call[:TOPK_TENSORS]
    num_heads, head_dim = q.shape[2], q.shape[3]
    seqlen_q, seqlen_k, num_kv_heads, width = q.shape[1], k.shape[1], k.shape[2], indices.shape[3]
    per_key = bias is not None and bias.dim() == 3
    if bias is None:
        bias_strides, bias_heads = (0, 0, 0, 0), 1
    else:
        # Broadcast (size-1) dimensions read through stride 0; a per-key bias has no query axis.
        strides = [0 if size == 1 else stride for size, stride in zip(bias.shape, bias.stride())]
        bias_strides = (strides[0], 0, strides[1], strides[2]) if per_key else tuple(strides)
        bias_heads = bias.shape[1] if per_key else bias.shape[2]
    band_lo, band_hi = band(call.window_left, call.window_right, seqlen_q, seqlen_k)
    softcap, scale = call.softcap, call.softmax_scale
    runtime = [
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *indices.stride(), *bias_strides,
        seqlen_q, seqlen_k, num_kv_heads, num_heads // num_kv_heads, head_dim, width,
        1 if bias_heads in (1, num_heads) else num_heads // bias_heads, band_lo, band_hi,
        scale * LOG2E.value, softcap * LOG2E.value, scale / softcap if softcap > 0 else 0.0,
    ]
    constexprs = [bias is not None, per_key, softcap > 0, "ieee" if q.dtype == torch.float32 else "tf32"]
    return runtime, constexprs


def topk_launch(launcher, call: TopkCall, extra_tensors: list, extra_runtime: list, extra_flags: list, tiles, grid_rows: int):
    """Launch ``launcher``'s kernel for ``call`` over the grid ``(grid_rows, B x Hkv)``: the shared
    pointers, then ``extra_tensors``, the shared runtime arguments, ``extra_runtime``, the shared
    flags, ``extra_flags``, ``BLOCK_D`` and the tile (``tiles()``'s configurations, which may
    depend on the head dim and the GQA group's padded size only)."""
    q, k = call.q, call.k
    block_d = configs.head_dim_block(q.shape[3])
    tensors = [q, k, call.v, call.indices, placeholder(q.device, torch.float32) if call.bias is None else call.bias, *extra_tensors]
    # The tiles' rows hold the group's heads padded to a power of 2: the key of the launcher's tile
    # choice names it, or a choice made for one group would serve another and leave heads unwritten.
    padded_group = configs.next_power_of_2(q.shape[2] // k.shape[2])

    def build():
        runtime, flags = topk_arguments(call)
        key = (q.dtype, *flags, *extra_flags, block_d, padded_group)
        return [*tensors, *runtime, *extra_runtime, *flags, *extra_flags, block_d], key

    layout = (
        call_signature(call, TOPK_TENSORS), tuple((t.shape, t.stride(), t.dtype) for t in extra_tensors), *extra_runtime, *extra_flags,
    )
    launcher.launch(layout, tensors, build, tiles, lambda meta: (grid_rows, q.shape[0] * k.shape[2]))
