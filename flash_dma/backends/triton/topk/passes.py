"""Top-k calls whose two passes walk differently (``dispatch.topk_plan``): the forward over the
packed per-query mask and the backward over the indices, or the reverse.

The pass that walks the mask builds its ``BitMask`` (``topk/bits.py``) and drops it when done: the
other pass needs only the call's inputs and the forward's ``out`` and ``lse``, which both walks
give alike. So a split converts once, as a call packed in both passes does, and holds the mask
only while it walks it. A split runs without a bias plane (``flash_dma.topk.plane_heads`` is 0:
unique indices and no bias per listed pair), so that the packed pass's problem is the mask and the
caller's per-key bias, whose gradient comes back in the caller's shape.

These are the passes' host code; ``ops.py`` wires them into autograd (an ``autograd.Function``
eagerly, the custom ops ``flash_dma::topk_split_forward`` and ``flash_dma::topk_split_backward``
under ``torch.compile``), as it does the index kernels'.
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.forward import attention_forward
from flash_dma.backends.triton.layout import Call, TopkCall
from flash_dma.backends.triton.topk.backward import topk_backward
from flash_dma.backends.triton.topk.bits import topk_bit_mask
from flash_dma.backends.triton.topk.forward import topk_forward


def _packed_call(call: TopkCall) -> Call:
    """The dense kernels' :class:`Call` of ``call`` over its packed mask, built here."""
    # Imported here: flash_dma.topk imports flash_dma.masks, which imports this package, so a
    # top-level import would make importing flash_dma.masks first a cycle (as for _call's package).
    from flash_dma.backends.triton import _call
    from flash_dma.topk import TopkProblem, as_mask_problem

    window = (call.window_left, call.window_right)
    problem = TopkProblem(
        query=call.q, key=call.k, value=call.v, indices=call.indices, attn_bias=call.bias,
        softmax_scale=call.softmax_scale, window=window, softcap=call.softcap, deterministic=call.deterministic,
        unique_indices=True,
    )
    return _call(as_mask_problem(problem, topk_bit_mask(call.indices, call.q.shape[1], call.k.shape[1], window)))


def split_forward(*fields_and_flag) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, H, D], lse [B, H, Sq])`` of the call whose fields lead ``fields_and_flag``:
    over its packed mask when the trailing ``packed_forward`` is True, else over its indices."""
    *fields, packed_forward = fields_and_flag
    call = TopkCall(*fields)
    return attention_forward(_packed_call(call)) if packed_forward else topk_forward(call)


def split_backward(dout, *fields_flag_out_lse_and_grad):
    """``(dq, dk, dv, dbias or None)`` in the inputs' shapes, for ``dout`` ``[B, Sq, H, D]``: over
    the indices after a packed forward, else over the packed mask."""
    *fields, packed_forward, out, lse, bias_requires_grad = fields_flag_out_lse_and_grad
    call = TopkCall(*fields)
    if packed_forward:
        return topk_backward(dout, call, out, lse, bias_requires_grad)
    dq, dk, dv, dbias = attention_backward(dout, _packed_call(call), out, lse, bias_requires_grad)
    return dq, dk, dv, None if dbias is None else dbias.reshape(call.bias.shape)  # [., ., 1, Sk] -> the caller's [., ., Sk]
