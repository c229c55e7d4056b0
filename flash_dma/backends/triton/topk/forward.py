"""Top-k index attention forward: online softmax over the keys each query lists, gathered a tile at a time.

Grid: ``(Sq, B x Hkv)``. A program owns one query position of one key/value head; the ``G = H /
Hkv`` query heads of its group share the listed keys, so they form the tile's rows (padded to
``BLOCK_M >= 16``, the smallest ``tl.dot``). It walks the ``W`` slots of ``indices[b, i, hkv]``
``BLOCK_N`` at a time: an entry counts when it is in ``[0, Sk)`` and inside the causal/window
band (else it reads key 0, masked, and scores ``-inf``); each counting slot is one pair, so a
repeated key counts once per slot. ``topk_tile`` and ``topk_rows`` are shared with ``topk/backward.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import TopkCall
from flash_dma.backends.triton.tiles import LN2, load_tile
from flash_dma.backends.triton.topk.tiles import (
    TOPK_NOT_SPECIALIZED,
    TOPK_SPECIALIZED,
    counts_in_band,
    topk_launch,
    topk_scores,
)


@triton.jit
def topk_tile(index_row, stride_iw, w0, width, query, seqlen_q, seqlen_k, band_lo, band_hi, BLOCK_N: tl.constexpr):
    """``(slots, keys, valid)`` ``[BLOCK_N]`` of slots ``w0..`` of a query's index row: the entries
    that count (in range and in the band of query ``query``), and their keys (0 where not)."""
    slots = w0 + tl.arange(0, BLOCK_N)
    keys = tl.load(index_row + slots.to(tl.int64) * stride_iw, mask=slots < width, other=-1)
    valid = counts_in_band(keys, query, seqlen_q, seqlen_k, band_lo, band_hi)
    return slots, tl.where(valid, keys, 0), valid


@triton.jit
def topk_rows(
    Q, Indices, Bias, b, i, kv_head, group, seqlen_q, head_dim, bias_head_div,
    stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_bb, stride_bs, stride_bh,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """What a (batch ``b``, query ``i``, key/value head) program reads once: its heads ``[BLOCK_M]``
    (rows past the group masked), their q ``[BLOCK_M, BLOCK_D]``, the index row and bias rows."""
    r = tl.arange(0, BLOCK_M)
    row_ok = r < group
    head = kv_head * group + tl.minimum(r, group - 1)
    q_rows = Q + b * stride_qb + i * stride_qs + head.to(tl.int64) * stride_qh  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d < head_dim)[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    index_row = Indices + b * stride_ib + i * stride_is + kv_head.to(tl.int64) * stride_ih
    bias_rows = Bias + b * stride_bb + i * stride_bs + (head // bias_head_div).to(tl.int64) * stride_bh  # [BLOCK_M]
    return head, row_ok, q, index_row, bias_rows


@triton.jit(do_not_specialize=TOPK_NOT_SPECIALIZED)
def _topk_fwd_kernel(
    Q, K, V, Indices, Bias, Out, Lse,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ib, stride_is, stride_ih, stride_iw, stride_bb, stride_bs, stride_bh, stride_bw,
    seqlen_q, seqlen_k, num_kv_heads, group, head_dim, width, bias_head_div, band_lo, band_hi,
    scale_log2, softcap_log2, scale_over_cap,
    HAS_BIAS: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    b = (tl.program_id(1) // num_kv_heads).to(tl.int64)
    kv_head = tl.program_id(1) % num_kv_heads
    head, row_ok, q, index_row, bias_rows = topk_rows(
        Q, Indices, Bias, b, i, kv_head, group, seqlen_q, head_dim, bias_head_div,
        stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_bb, stride_bs, stride_bh, BLOCK_M, BLOCK_D,
    )
    k_rows = K + b * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_rows = V + b * stride_vb + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for w0 in range(0, width, BLOCK_N):
        slots, keys, valid = topk_tile(index_row, stride_iw, w0, width, i, seqlen_q, seqlen_k, band_lo, band_hi, BLOCK_N)  # [BLOCK_N]
        k = load_tile(k_rows, keys, valid, stride_ks, head_dim, True, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        s, _ = topk_scores(  # [BLOCK_M, BLOCK_N]
            q, k, bias_rows, stride_bw, slots, keys, valid, row_ok, scale_log2, softcap_log2, scale_over_cap,
            HAS_BIAS, BIAS_PER_KEY, SOFTCAP, DOT_PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row that has seen no counting key yet keeps m = -inf; shift it by 0 instead, so p = 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_rows, keys, valid, stride_vs, head_dim, True, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
        m_i = m_new
    # Rows with no counting key: out = 0, lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    # Out and Lse are contiguous [B, Sq, H, D] and [B, H, Sq].
    num_heads = group * num_kv_heads
    tl.store(
        Out + ((b * seqlen_q + i) * num_heads + head)[:, None] * head_dim + offs_d[None, :],
        out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d < head_dim)[None, :],
    )
    tl.store(Lse + (b * num_heads + head) * seqlen_q + i, lse, mask=row_ok)


FORWARD_LAUNCHER = Launcher(
    _topk_fwd_kernel, tensors=("Q", "K", "V", "Indices", "Bias", "Out", "Lse"), specialized=TOPK_SPECIALIZED,
)


def topk_forward(call: TopkCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` ``[B, Sq, H, D]`` in q's dtype and ``lse`` ``[B, H, Sq]`` float32 (both contiguous) of ``call``."""
    q = call.q
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    group = q.shape[2] // call.k.shape[2]
    topk_launch(
        FORWARD_LAUNCHER, call, [out, lse], [], [],
        lambda: configs.topk_candidates("forward", configs.head_dim_block(q.shape[3]), group), q.shape[1],
    )
    return out, lse
