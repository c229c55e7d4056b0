"""The Triton kernels as ``torch.library`` custom ops, with fake implementations and autograd.

Registering them as opaque ops lets ``torch.compile(fullgraph=True)`` trace models that call
flash-dma without graph breaks, with shapes inferred by the fake implementations (so a new
sequence length does not recompile once dynamo has marked it dynamic).
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.forward import attention_forward


@torch.library.custom_op("flash_dma::forward", mutates_args=())
def forward_op(
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
    dbias = torch.empty_like(bias) if bias is not None and bias_requires_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, kv_lists, q_lists, *settings = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, bias, kv_lists, q_lists)
    ctx.settings = settings
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, mask, bias, kv_lists, q_lists = ctx.saved_tensors
    bias_requires_grad = bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dbias = backward_op(
        dout, q, k, v, out, lse, mask, bias, kv_lists, q_lists, *ctx.settings, bias_requires_grad
    )
    return dq, dk, dv, None, dbias if bias_requires_grad else None, None, None, *([None] * len(ctx.settings))


torch.library.register_autograd("flash_dma::forward", _backward, setup_context=_setup_context)
