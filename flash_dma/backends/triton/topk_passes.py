"""Top-k calls whose two passes walk differently (``dispatch.topk_plan``): the forward over the
packed per-query mask and the backward over the indices, or the reverse.

The pass that walks the mask builds its ``BitMask`` (``topk_bits.py``) and drops it when done: the
other pass needs only the call's inputs and the forward's ``out`` and ``lse``, which both walks
give alike. So a split converts once, as a call packed in both passes does, and holds the mask
only while it walks it. A split runs without a bias plane (``flash_dma.topk.plane_heads`` is 0:
unique indices and no bias per listed pair), so that the packed pass's problem is the mask and the
caller's per-key bias, whose gradient comes back in the caller's shape.

Eagerly a ``torch.autograd.Function``; under ``torch.compile`` the custom op
``flash_dma::topk_split_forward``, whose backward is ``flash_dma::topk_split_backward``, as
``ops.py`` builds the index kernels' ops (and with its helpers).
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.forward import attention_forward
from flash_dma.backends.triton.layout import TOPK_BIAS_FIELD, TOPK_TENSORS, Call, TopkCall
from flash_dma.backends.triton.ops import _TOPK_SCHEMA, _backward_fake, _forward_fake, _gradients, _setup_context
from flash_dma.backends.triton.topk_backward import topk_backward
from flash_dma.backends.triton.topk_bits import topk_bit_mask
from flash_dma.backends.triton.topk_forward import topk_forward


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


def _split_forward(*fields_and_flag) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the call whose fields lead ``fields_and_flag``: over its packed mask when the
    trailing ``packed_forward`` is True, else over its indices."""
    *fields, packed_forward = fields_and_flag
    call = TopkCall(*fields)
    return attention_forward(_packed_call(call)) if packed_forward else topk_forward(call)


def _split_backward(dout, *fields_flag_out_lse_and_grad):
    """``(dq, dk, dv, dbias or None)``: over the indices after a packed forward, else over the packed mask."""
    *fields, packed_forward, out, lse, bias_requires_grad = fields_flag_out_lse_and_grad
    call = TopkCall(*fields)
    if packed_forward:
        return topk_backward(dout, call, out, lse, bias_requires_grad)
    dq, dk, dv, dbias = attention_backward(dout, _packed_call(call), out, lse, bias_requires_grad)
    return dq, dk, dv, None if dbias is None else dbias.reshape(call.bias.shape)  # [., ., 1, Sk] -> the caller's [., ., Sk]


def _split_backward_tensors(dout, *args):
    dq, dk, dv, dbias = _split_backward(dout, *args)
    return dq, dk, dv, dq.new_empty(0) if dbias is None else dbias


split_forward_op = torch.library.custom_op(
    "flash_dma::topk_split_forward", _split_forward, mutates_args=(),
    schema=f"({_TOPK_SCHEMA}, bool packed_forward) -> (Tensor, Tensor)",
)
split_forward_op.register_fake(_forward_fake)
split_backward_op = torch.library.custom_op(
    "flash_dma::topk_split_backward", _split_backward_tensors, mutates_args=(),
    schema=f"(Tensor dout, {_TOPK_SCHEMA}, bool packed_forward, Tensor out, Tensor lse, bool bias_requires_grad) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
split_backward_op.register_fake(_backward_fake)


def _split_setup_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output, TOPK_TENSORS)  # the flag joins the settings


def _split_field_gradients(ctx, dout, _dlse):
    dq, dk, dv, dbias = _gradients(ctx, dout, split_backward_op, TOPK_BIAS_FIELD, TOPK_BIAS_FIELD)
    grads = [dq, dk, dv, *[None] * (len(TopkCall._fields) - 2)]  # one per input: the call's fields, then the flag
    grads[TOPK_BIAS_FIELD] = dbias
    return tuple(grads)


torch.library.register_autograd("flash_dma::topk_split_forward", _split_field_gradients, setup_context=_split_setup_context)


class _EagerSplit(torch.autograd.Function):
    # As ops._EagerTopk: the differentiable tensors are inputs, the call and the flag travel whole.
    @staticmethod
    def forward(ctx, q, k, v, bias, call, packed_forward):
        output = _split_forward(*call, packed_forward)
        _setup_context(ctx, (*call, packed_forward), output, TOPK_TENSORS)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*_gradients(ctx, dout, _split_backward, 3, TOPK_BIAS_FIELD), None, None)


def topk_split_op(call: TopkCall, packed_forward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a top-k ``call`` whose forward walks its packed mask (``packed_forward``)
    and its backward its indices, or the reverse; differentiable, through the custom op when compiling."""
    if torch.compiler.is_compiling():
        return split_forward_op(*call, packed_forward)
    return _EagerSplit.apply(call.q, call.k, call.v, call.bias, call, packed_forward)
