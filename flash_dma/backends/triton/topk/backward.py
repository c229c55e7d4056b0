"""Top-k index attention backward: dQ and a per-pair bias gradient query-outer; dK, dV and a per-key
bias gradient either added by fp32 atomics in the same walk (``dispatch`` kernel ``topk-atomic``),
or, with ``deterministic=True``, key-outer with every sum in a fixed order (bit-identical runs).

1. ``_topk_dq_kernel``, grid ``(Sq, B x Hkv)``: the forward's walk (``topk/forward.py``) with dO;
   it writes ``delta = rowsum(dO * O)`` of its rows, dQ, and for a per-pair bias dS of its slots.
   With ATOMIC_DKDV it also adds each gathered tile's ``P^T dO`` and ``dS^T Q`` (the group's heads
   are the rows of its tiles) to fp32 dK and dV at the tile's keys, and a per-key bias's dS: the
   keys and values are gathered once for both directions, so the backward reads what the forward
   reads, plus the atomics. With UNION_QUERIES (``dispatch`` kernel ``topk-union``) it skips the
   queries whose block the union kernel walks (``topk/union.py``, launched first).
2. Deterministic: the inverse map, in torch: per (batch, key/value head) the slots ``i * W + w``
   whose entries count, stably sorted by key, and where each key's run starts (``inverse_map``).
3. Deterministic: ``_topk_dkdv_kernel``, grid ``(Sk, B x Hkv)``: a program owns one key of one
   key/value head and walks its run of slots in order, ``BLOCK_E`` slots x the group's heads per
   chunk, recomputing P and dS per (slot, head) row; it writes dK, dV (zeros for a key no query
   picked) and, for a per-key bias, the sum of dS. It gathers Q and dO of every entry, the group's
   heads each: several times the bytes of the atomic walk (design notes, "Top-k index attention:
   the union of a query block's keys").

Bias gradients come out per (batch, key/value head[, head of the group]) in fp32 and are summed
over the bias's broadcast dimensions afterwards, in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_dma.backends.reference import valid_indices
from flash_dma.backends.triton import configs
from flash_dma.backends.triton.backward import softmax_grad
from flash_dma.backends.triton.dispatch import TOPK_ATOMIC, TOPK_UNION, route, topk_form
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import TopkCall
from flash_dma.backends.triton.tiles import LOG2E, load_tile, scores_log2
from flash_dma.backends.triton.topk.forward import topk_rows, topk_tile
from flash_dma.backends.triton.topk.tiles import (
    GRADIENT_STRIDES,
    TOPK_NOT_SPECIALIZED,
    TOPK_SPECIALIZED,
    add_key_gradients,
    gradient_rows,
    lse2_rows,
    topk_launch,
    topk_scores,
    union_size,
)
from flash_dma.backends.triton.topk.union import UNION_NOT_SPECIALIZED, UnionSplit, union_backward, union_split


@triton.jit(do_not_specialize=(*TOPK_NOT_SPECIALIZED, *UNION_NOT_SPECIALIZED))
def _topk_dq_kernel(
    Q, K, V, Indices, Bias, Out, DO, Lse, Delta, DQ, DBias, DKAcc, DVAcc, DBiasKeys, Lengths,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ib, stride_is, stride_ih, stride_iw, stride_bb, stride_bs, stride_bh, stride_bw,
    seqlen_q, seqlen_k, num_kv_heads, group, head_dim, width, bias_head_div, band_lo, band_hi,
    scale_log2, softcap_log2, scale_over_cap,
    stride_dob, stride_dos, stride_doh, scale, num_blocks, union_limit,
    HAS_BIAS: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DBIAS_PAIRS: tl.constexpr, DBIAS_PER_HEAD: tl.constexpr, ATOMIC_DKDV: tl.constexpr, DBIAS_KEYS: tl.constexpr,
    UNION_QUERIES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    b = (tl.program_id(1) // num_kv_heads).to(tl.int64)
    kv_head = tl.program_id(1) % num_kv_heads
    if UNION_QUERIES > 0:  # the union kernel serves this query's block (``topk/union.py``)
        if union_size(Lengths, tl.program_id(1).to(tl.int64) * num_blocks + i // UNION_QUERIES) <= union_limit:
            return
    num_heads = group * num_kv_heads
    head, row_ok, q, index_row, bias_rows = topk_rows(
        Q, Indices, Bias, b, i, kv_head, group, seqlen_q, head_dim, bias_head_div,
        stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_bb, stride_bs, stride_bh, BLOCK_M, BLOCK_D,
    )
    do, delta, lse2, row_offsets, tile_ok = gradient_rows(
        Out, DO, Lse, Delta, b, i, head, row_ok, seqlen_q, num_heads, head_dim, stride_dob, stride_dos, stride_doh, BLOCK_D,
    )
    k_rows = K + b * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_rows = V + b * stride_vb + kv_head.to(tl.int64) * stride_vh
    # The per-pair bias gradient, contiguous [B, Sq, Hkv, G or 1, W].
    r = tl.arange(0, BLOCK_M)
    dbias_row = DBias + ((b * seqlen_q + i) * num_kv_heads + kv_head) * (group if DBIAS_PER_HEAD else 1) * width
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for w0 in range(0, width, BLOCK_N):
        slots, keys, valid = topk_tile(index_row, stride_iw, w0, width, i, seqlen_q, seqlen_k, band_lo, band_hi, BLOCK_N)  # [BLOCK_N]
        k = load_tile(k_rows, keys, valid, stride_ks, head_dim, True, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        v = load_tile(v_rows, keys, valid, stride_vs, head_dim, True, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        s, scores = topk_scores(  # [BLOCK_M, BLOCK_N]
            q, k, bias_rows, stride_bw, slots, keys, valid, row_ok, scale_log2, softcap_log2, scale_over_cap,
            HAS_BIAS, BIAS_PER_KEY, SOFTCAP, DOT_PRECISION,
        )
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        p, ds, dqk = softmax_grad(s, lse2, delta, dp, 0, scale, softcap_log2, SOFTCAP, scores)  # [BLOCK_M, BLOCK_N]
        dq += tl.dot(dqk.to(k.dtype), k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
        if ATOMIC_DKDV:
            add_key_gradients(
                DKAcc, DVAcc, DBiasKeys, p, ds, dqk, q, do, keys, valid, r, row_ok, b, kv_head, seqlen_k, num_kv_heads, group,
                head_dim, DBIAS_KEYS, DBIAS_PER_HEAD, DOT_PRECISION, BLOCK_D,
            )
        if DBIAS_PAIRS:
            slot_ok = slots < width
            if DBIAS_PER_HEAD:
                tl.store(dbias_row + (r * width)[:, None] + slots[None, :], ds, mask=row_ok[:, None] & slot_ok[None, :])
            else:
                tl.store(dbias_row + slots, tl.sum(ds, 0), mask=slot_ok)
    tl.store(DQ + row_offsets, dq.to(DQ.dtype.element_ty), mask=tile_ok)


@triton.jit(do_not_specialize=TOPK_NOT_SPECIALIZED)
def _topk_dkdv_kernel(
    Q, K, V, Indices, Bias, DO, Lse, Delta, Order, Starts, DK, DV, DBias,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ib, stride_is, stride_ih, stride_iw, stride_bb, stride_bs, stride_bh, stride_bw,
    seqlen_q, seqlen_k, num_kv_heads, group, head_dim, width, bias_head_div, band_lo, band_hi,
    scale_log2, softcap_log2, scale_over_cap,
    stride_dob, stride_dos, stride_doh, scale,
    HAS_BIAS: tl.constexpr, BIAS_PER_KEY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DBIAS_KEYS: tl.constexpr, DBIAS_PER_HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)  # b * Hkv + kv_head
    b = bh // num_kv_heads
    kv_head = bh % num_kv_heads
    num_heads = group * num_kv_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    k = tl.load(K + b * stride_kb + j * stride_ks + kv_head * stride_kh + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    v = tl.load(V + b * stride_vb + j * stride_vs + kv_head * stride_vh + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    start = tl.load(Starts + bh * (seqlen_k + 1) + j)
    end = tl.load(Starts + bh * (seqlen_k + 1) + j + 1)
    order_row = Order + bh * seqlen_q * width
    # Rows are (slot, head of the group) pairs, heads fastest.
    r = tl.arange(0, BLOCK_E * BLOCK_G)
    g = r % BLOCK_G
    head = kv_head * group + tl.minimum(g, group - 1)  # [BLOCK_E * BLOCK_G]
    dk = tl.zeros([BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_D], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_E * BLOCK_G], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + r // BLOCK_G
        ok = (e < end) & (g < group)
        position = tl.load(order_row + e, mask=e < end, other=0)  # i * W + w
        i = position // width
        w = position % width
        tile_ok = ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * stride_qb + (i * stride_qs + head * stride_qh)[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)  # [BLOCK_E * BLOCK_G, BLOCK_D]
        do = tl.load(DO + b * stride_dob + (i * stride_dos + head * stride_doh)[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)
        q = q.to(tl.float32)
        do = do.to(tl.float32)
        scores = scores_log2(tl.sum(q * k[None, :], 1), scale_log2, softcap_log2, scale_over_cap, SOFTCAP)  # [BLOCK_E * BLOCK_G]
        s = scores
        if HAS_BIAS:
            column = j if BIAS_PER_KEY else w
            bias = tl.load(Bias + b * stride_bb + i * stride_bs + (head // bias_head_div) * stride_bh + column * stride_bw, mask=ok, other=0.0)
            s += bias.to(tl.float32) * LOG2E
        lse_offsets = (b * num_heads + head) * seqlen_q + i
        lse2 = lse2_rows(Lse, lse_offsets, ok)
        delta = tl.load(Delta + lse_offsets, mask=ok, other=0.0)
        dp = tl.sum(do * v[None, :], 1)
        p, ds, dqk = softmax_grad(s[:, None], lse2, delta, dp[:, None], 0, scale, softcap_log2, SOFTCAP, scores[:, None])  # [BLOCK_E * BLOCK_G, 1]
        dv += tl.sum(p * do, 0)
        dk += tl.sum(dqk * q, 0)
        dbias += tl.sum(ds, 1)
    # DK and DV are contiguous [B, Sk, Hkv, D]; the per-key bias gradient [B, Hkv, G or 1, Sk].
    out_offsets = ((b * seqlen_k + j) * num_kv_heads + kv_head) * head_dim + offs_d
    tl.store(DK + out_offsets, dk.to(DK.dtype.element_ty), mask=d_ok)
    tl.store(DV + out_offsets, dv.to(DV.dtype.element_ty), mask=d_ok)
    if DBIAS_KEYS:
        if DBIAS_PER_HEAD:
            per_head = tl.sum(tl.reshape(dbias, [BLOCK_E, BLOCK_G]), 0)  # [BLOCK_G]
            offs_g = tl.arange(0, BLOCK_G)
            tl.store(DBias + (bh * group + offs_g) * seqlen_k + j, per_head, mask=offs_g < group)
        else:
            tl.store(DBias + bh * seqlen_k + j, tl.sum(dbias, 0))


DQ_LAUNCHER = Launcher(
    _topk_dq_kernel,
    tensors=("Q", "K", "V", "Indices", "Bias", "Out", "DO", "Lse", "Delta", "DQ", "DBias", "DKAcc", "DVAcc", "DBiasKeys", "Lengths"),
    specialized=(*TOPK_SPECIALIZED, *GRADIENT_STRIDES),
)
DKDV_LAUNCHER = Launcher(
    _topk_dkdv_kernel,
    tensors=("Q", "K", "V", "Indices", "Bias", "DO", "Lse", "Delta", "Order", "Starts", "DK", "DV", "DBias"),
    specialized=(*TOPK_SPECIALIZED, *GRADIENT_STRIDES),
)


def inverse_map(call: TopkCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, starts)``: per (batch, key/value head), the slots ``i * W + w`` of the entries that
    count, sorted by key (stably: ties keep slot order) ``[B, Hkv, Sq * W]`` int64, and where key j's
    run begins, ``[B, Hkv, Sk + 1]`` (its run is ``order[starts[j]:starts[j + 1]]``)."""
    indices, seqlen_k = call.indices, call.k.shape[1]
    batch, seqlen_q, num_kv_heads, width = indices.shape
    valid = valid_indices(indices, 0, seqlen_q, seqlen_k, (call.window_left, call.window_right))
    # Entries that do not count sort last, past every key's run.
    keys = torch.where(valid, indices, seqlen_k).transpose(1, 2).reshape(batch, num_kv_heads, seqlen_q * width)
    # Contiguous: the kernel reads [B, Hkv, Sq * W] rows (a reshape can stay a strided view, and sort keeps strides).
    sorted_keys, order = torch.sort(keys.contiguous(), dim=-1, stable=True)
    boundaries = torch.arange(seqlen_k + 1, dtype=keys.dtype, device=keys.device).expand(batch, num_kv_heads, -1).contiguous()
    return order.contiguous(), torch.searchsorted(sorted_keys.contiguous(), boundaries)


def _bias_sum(expanded: torch.Tensor, bias: torch.Tensor, batch_dim: int, head_dim: int) -> torch.Tensor:
    """A bias gradient made per batch entry and head (``expanded``), summed over the dimensions
    the bias broadcasts, in the bias's shape and dtype."""
    sums = tuple(d for d, size in ((batch_dim, bias.shape[batch_dim]), (head_dim, bias.shape[head_dim])) if size == 1 and expanded.shape[d] > 1)
    return (expanded.sum(dim=sums, keepdim=True) if sums else expanded).reshape(bias.shape).to(bias.dtype)


def topk_backward(
    dout: torch.Tensor, call: TopkCall, out: torch.Tensor, lse: torch.Tensor, bias_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dbias or None)`` of ``call`` for its forward's ``out`` and ``lse`` (contiguous);
    gradients in the inputs' dtypes and shapes."""
    q, k, bias = call.q, call.k, call.bias
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads, width = k.shape[1], k.shape[2], call.indices.shape[3]
    group = num_heads // num_kv_heads
    block_d = configs.head_dim_block(head_dim)
    bias_requires_grad = bias is not None and bias_requires_grad
    per_key = bias is not None and bias.dim() == 3
    # The bias gradient per query head when the bias has one per query head, else per key/value head.
    per_head = bias is not None and group > 1 and bias.shape[1 if per_key else 2] == num_heads
    heads = group if per_head else 1
    dbias_pairs = bias_requires_grad and not per_key
    dbias_keys = bias_requires_grad and per_key
    device = q.device
    extra = [*dout.stride()[:3], call.softmax_scale]

    kernel = route("dkdv", topk_form(call))
    atomic = kernel in (TOPK_ATOMIC, TOPK_UNION)
    keys_shape = (batch, num_kv_heads, heads, seqlen_k if dbias_keys else 0)
    delta = torch.empty(batch, num_heads, seqlen_q, dtype=torch.float32, device=device)
    dq = torch.empty(q.shape, dtype=q.dtype, device=device)
    pair_grad = torch.empty(batch, seqlen_q, num_kv_heads, heads, width if dbias_pairs else 0, dtype=torch.float32, device=device)
    if atomic:  # dK, dV and a per-key bias gradient added up in the dQ walks
        dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=device)
        dv_acc = torch.zeros(k.shape, dtype=torch.float32, device=device)
        key_grad = torch.zeros(keys_shape, dtype=torch.float32, device=device)
    else:
        dk_acc = dv_acc = key_grad = torch.empty(0, dtype=torch.float32, device=device)
    # A per-pair bias never takes the union (``dispatch``), so pair_grad is the per-query walk's alone.
    split = union_split(call) if kernel == TOPK_UNION else UnionSplit.none(device)
    if split.queries:  # first: the per-query walk reads the blocks' union sizes
        union_backward(dout, call, split, out, lse, delta, dq, dk_acc, dv_acc, key_grad, per_head)
    topk_launch(
        DQ_LAUNCHER, call, [out, dout, lse, delta, dq, pair_grad, dk_acc, dv_acc, key_grad, split.lengths],
        [*extra, *split.runtime()], [dbias_pairs, per_head, atomic, dbias_keys and atomic, split.queries],
        lambda: configs.topk_candidates("dq", block_d, group), seqlen_q,
    )
    if atomic:
        dk, dv = dk_acc.to(k.dtype), dv_acc.to(k.dtype)
    else:
        order, starts = inverse_map(call)
        dk = torch.empty(k.shape, dtype=k.dtype, device=device)
        dv = torch.empty(k.shape, dtype=k.dtype, device=device)
        key_grad = torch.empty(keys_shape, dtype=torch.float32, device=device)
        block_g = configs.next_power_of_2(group)
        rows = configs.topk_dkdv_rows(block_d, block_g)
        tile = triton.Config({"BLOCK_E": rows // block_g, "BLOCK_G": block_g}, num_warps=4, num_stages=1)
        topk_launch(
            DKDV_LAUNCHER, call, [dout, lse, delta, order, starts, dk, dv, key_grad], extra, [dbias_keys, per_head],
            lambda: [tile], seqlen_k,
        )

    dbias = None
    if dbias_pairs:
        dbias = _bias_sum(pair_grad.reshape(batch, seqlen_q, num_kv_heads * heads, width), bias, 0, 2)
    elif dbias_keys:
        dbias = _bias_sum(key_grad.reshape(batch, num_kv_heads * heads, seqlen_k), bias, 0, 1)
    return dq, dk, dv, dbias
