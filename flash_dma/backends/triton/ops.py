"""Autograd wiring of the Triton kernels: a ``torch.library`` custom op and an ``autograd.Function``.

Under ``torch.compile`` the kernels run as opaque custom ops with fake implementations, so
``fullgraph=True`` traces models that call flash-dma without graph breaks, and shapes come from
the fakes (a new sequence length does not recompile once dynamo has marked it dynamic). Eager
calls take an ``autograd.Function`` instead: the custom-op dispatcher costs about 100 us of host
time per call, more than a small attention kernel runs. Both share the same context and backward.
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.forward import attention_forward


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    kv_lists: torch.Tensor | None,
    q_lists: torch.Tensor | None,
    list_block_q: int,
    list_block_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``q_lists`` and ``deterministic`` are carried for the backward."""
    return attention_forward(
        q, k, v, mask, bias, kv_lists, list_block_q, list_block_k, softmax_scale, window_left, window_right, softcap
    )


forward_op = torch.library.custom_op("flash_dma::forward", _forward, mutates_args=())


@forward_op.register_fake
def _forward_fake(q, k, v, mask, bias, kv_lists, q_lists, list_block_q, list_block_k, *_):
    batch, seqlen_q, num_heads, head_dim = q.shape
    return q.new_empty(batch, seqlen_q, num_heads, head_dim), q.new_empty(
        batch, num_heads, seqlen_q, dtype=torch.float32
    )


@torch.library.custom_op("flash_dma::backward", mutates_args=())
def backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    kv_lists: torch.Tensor | None,
    q_lists: torch.Tensor | None,
    list_block_q: int,
    list_block_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    bias_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dbias)``; dbias is empty when not asked for (custom ops return tensors)."""
    dq, dk, dv, dbias = attention_backward(
        dout, q, k, v, out, lse, mask, bias, kv_lists, q_lists, list_block_q, list_block_k,
        softmax_scale, window_left, window_right, softcap, deterministic, bias_requires_grad,
    )
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, mask, bias, *args):
    bias_requires_grad = args[-1]
    # Contiguous, like the real gradients (not empty_like, which copies an input's strides).
    dbias = bias.new_empty(bias.shape) if bias is not None and bias_requires_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, kv_lists, q_lists, *settings = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, bias, kv_lists, q_lists)
    ctx.settings = settings
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, backward):
    q, k, v, out, lse, mask, bias, kv_lists, q_lists = ctx.saved_tensors
    bias_requires_grad = bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dbias = backward(
        dout, q, k, v, out, lse, mask, bias, kv_lists, q_lists, *ctx.settings, bias_requires_grad
    )
    return dq, dk, dv, None, dbias if bias_requires_grad else None, None, None, *([None] * len(ctx.settings))


torch.library.register_autograd(
    "flash_dma::forward", lambda ctx, dout, _dlse: _gradients(ctx, dout, backward_op), setup_context=_setup_context
)


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _gradients(ctx, dout, attention_backward)


def attention_op(*inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``, with the arguments of ``forward_op``."""
    if torch.compiler.is_compiling():
        return forward_op(*inputs)
    return _EagerAttention.apply(*inputs)
