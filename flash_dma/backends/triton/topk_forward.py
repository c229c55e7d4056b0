"""Top-k index attention forward: online softmax over the keys each query lists, gathered a tile at a time.

Grid: ``(Sq, B x Hkv)``. A program owns one query position of one key/value head; the ``G = H /
Hkv`` query heads of its group share the listed keys, so they form the tile's rows (padded to
``BLOCK_M >= 16``, the smallest ``tl.dot``). It walks the ``W`` slots of ``indices[b, i, hkv]``
``BLOCK_N`` at a time: an entry counts when it is in ``[0, Sk)`` and inside the causal/window
band (else it reads key 0, masked, and scores ``-inf``); each counting slot is one pair, so a
repeated key counts once per slot. The helpers here are shared with ``topk_backward.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.dispatch import TOPK, route, topk_form
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import TOPK_TENSORS, TopkCall, band, call_signature, placeholder
from flash_dma.backends.triton.tiles import LN2, LOG2E, load_tile, scores_log2

TOPK_SPECIALIZED = (
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
    "stride_ib", "stride_is", "stride_ih", "stride_iw", "stride_bb", "stride_bs", "stride_bh", "stride_bw", "head_dim",
)
TOPK_NOT_SPECIALIZED = ("seqlen_q", "seqlen_k", "num_kv_heads", "group", "width", "bias_head_div", "band_lo", "band_hi")


@triton.jit
def topk_tile(index_row, stride_iw, w0, width, query, seqlen_q, seqlen_k, band_lo, band_hi, BLOCK_N: tl.constexpr):
    """``(slots, keys, valid)`` ``[BLOCK_N]`` of slots ``w0..`` of a query's index row: the entries
    that count (in range and in the band of query ``query``), and their keys (0 where not)."""
    slots = w0 + tl.arange(0, BLOCK_N)
    keys = tl.load(index_row + slots.to(tl.int64) * stride_iw, mask=slots < width, other=-1)
    offset = keys - (query + seqlen_k - seqlen_q)  # key position minus the query's diagonal key
    valid = (keys >= 0) & (keys < seqlen_k) & (offset >= band_lo) & (offset <= band_hi)
    return slots, tl.where(valid, keys, 0), valid


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


def topk_launch(launchers: dict, pass_: str, call: TopkCall, extra_tensors: list, extra_runtime: list, extra_flags: list, tiles, grid_rows: int):
    """Launch ``pass_`` of ``call`` with the kernel of ``launchers`` (by kernel family) that ``dispatch.route``
    names, over the grid ``(grid_rows, B x Hkv)``: the shared pointers, then
    ``extra_tensors``, the shared runtime arguments, ``extra_runtime``, the shared flags,
    ``extra_flags``, ``BLOCK_D`` and the tile (``tiles()``'s configurations)."""
    q, k = call.q, call.k
    launcher = launchers[route(pass_, topk_form(call))]
    block_d = configs.head_dim_block(q.shape[3])
    tensors = [q, k, call.v, call.indices, placeholder(q.device, torch.float32) if call.bias is None else call.bias, *extra_tensors]

    def build():
        runtime, flags = topk_arguments(call)
        return [*tensors, *runtime, *extra_runtime, *flags, *extra_flags, block_d], (q.dtype, *flags, *extra_flags, block_d)

    layout = (call_signature(call, TOPK_TENSORS), tuple((t.shape, t.stride(), t.dtype) for t in extra_tensors), *extra_flags)
    launcher.launch(layout, tensors, build, tiles, lambda meta: (grid_rows, q.shape[0] * k.shape[2]))


FORWARD_LAUNCHERS = {
    TOPK: Launcher(_topk_fwd_kernel, tensors=("Q", "K", "V", "Indices", "Bias", "Out", "Lse"), specialized=TOPK_SPECIALIZED),
}


def topk_forward(call: TopkCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` ``[B, Sq, H, D]`` in q's dtype and ``lse`` ``[B, H, Sq]`` float32 (both contiguous) of ``call``."""
    q = call.q
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    group = q.shape[2] // call.k.shape[2]
    topk_launch(
        FORWARD_LAUNCHERS, "forward", call, [out, lse], [], [],
        lambda: configs.topk_candidates("forward", configs.head_dim_block(q.shape[3]), group), q.shape[1],
    )
    return out, lse
