"""Autograd wiring of the Triton kernels: ``torch.library`` custom ops and an ``autograd.Function``.

Under ``torch.compile`` the kernels run as opaque custom ops with fake implementations, so
``fullgraph=True`` traces models that call flash-dma without graph breaks, and shapes come from
the fakes (a new sequence length does not recompile once dynamo has marked it dynamic). Eager
calls take an ``autograd.Function`` and call the launchers directly: the custom-op dispatcher
costs more host time per call than a small attention kernel runs. Both share the same context
and backward.
"""

from __future__ import annotations

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.block_summary import block_lists, block_state
from flash_dma.backends.triton.forward import CachePages, attention_forward
from flash_dma.backends.triton.key_list import build_key_list
from flash_dma.backends.triton.layout import SEQ_CACHE, SEQ_PACKED, Sequences


def packed_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> Sequences | None:
    """The kernels' description of packed (varlen) sequences, or None for a plain batch."""
    if cu_seqlens_q is None:
        return None
    return Sequences(SEQ_PACKED, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)


@torch.library.custom_op("flash_dma::key_list", mutates_args=())
def key_list_op(mask: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    return build_key_list(mask, seqlen_k)


@key_list_op.register_fake
def _key_list_fake(mask, seqlen_k):
    return mask.new_empty(mask.shape[0], mask.shape[1], 2, seqlen_k + 1, dtype=torch.int32)


def key_list(mask: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """``build_key_list``, through the custom op when compiling."""
    return (key_list_op if torch.compiler.is_compiling() else build_key_list)(mask, seqlen_k)


@torch.library.custom_op("flash_dma::block_state", mutates_args=())
def block_state_op(mask: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    return block_state(mask, block_q, block_k)


@block_state_op.register_fake
def _block_state_fake(mask, block_q, block_k):
    nb, nh, sq, sk = mask.shape
    nqb = 1 if sq == 1 else (sq + block_q - 1) // block_q
    nkb = 1 if sk == 1 else (sk + block_k - 1) // block_k
    return mask.new_empty(nb, nh, nqb, nkb, dtype=torch.int8)


@torch.library.custom_op("flash_dma::block_lists", mutates_args=())
def block_lists_op(state: torch.Tensor, transpose: bool) -> torch.Tensor:
    return block_lists(state, transpose)


@block_lists_op.register_fake
def _block_lists_fake(state, transpose):
    nb, nh, rows, columns = state.shape
    if transpose:
        rows, columns = columns, rows
    return state.new_empty(nb, nh, rows, 2, 2, columns + 1, dtype=torch.int32)


def summary_state(mask: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """``block_state``, through the custom op when compiling."""
    return (block_state_op if torch.compiler.is_compiling() else block_state)(mask, block_q, block_k)


def summary_lists(state: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``block_lists``, through the custom op when compiling."""
    return (block_lists_op if torch.compiler.is_compiling() else block_lists)(state, transpose)


def launch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    kv_lists: torch.Tensor | None,
    q_lists: torch.Tensor | None,
    key_list: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    list_block_q: int,
    list_block_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``q_lists`` and ``deterministic`` are carried for the backward.

    With ``cu_seqlens_q``/``cu_seqlens_k`` (varlen), q, k and v are ``[1, total, heads, D]`` and
    masks, biases and walks hold one row per sequence.
    """
    return attention_forward(
        q, k, v, mask, bias, kv_lists, key_list, list_block_q, list_block_k, softmax_scale, window_left, window_right,
        softcap, sequences=packed_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )


forward_op = torch.library.custom_op("flash_dma::forward", launch_forward, mutates_args=())


@forward_op.register_fake
def _forward_fake(q, *_):
    batch, seqlen_q, num_heads, head_dim = q.shape
    return q.new_empty(batch, seqlen_q, num_heads, head_dim), q.new_empty(batch, num_heads, seqlen_q, dtype=torch.float32)


def _backward(
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
    key_list: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    list_block_q: int,
    list_block_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    max_seqlen_q: int,
    max_seqlen_k: int,
    bias_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dbias)``; dbias is empty when not asked for (custom ops return tensors)."""
    dq, dk, dv, dbias = attention_backward(
        dout, q, k, v, out, lse, mask, bias, kv_lists, q_lists, key_list, list_block_q, list_block_k,
        softmax_scale, window_left, window_right, softcap, deterministic, bias_requires_grad,
        sequences=packed_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


backward_op = torch.library.custom_op("flash_dma::backward", _backward, mutates_args=())


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, mask, bias, *args):
    bias_requires_grad = args[-1]
    # Contiguous, like the real gradients (not empty_like, which copies an input's strides).
    dbias = bias.new_empty(bias.shape) if bias is not None and bias_requires_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


_BIAS_INPUT = 4  # position of the bias among the forward's inputs


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, kv_lists, q_lists, key_list, cu_seqlens_q, cu_seqlens_k, *settings = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, bias, kv_lists, q_lists, key_list, cu_seqlens_q, cu_seqlens_k)
    ctx.settings = settings
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, backward):
    saved = ctx.saved_tensors
    bias = saved[6]
    bias_requires_grad = bias is not None and ctx.needs_input_grad[_BIAS_INPUT]
    dq, dk, dv, dbias = backward(dout, *saved, *ctx.settings, bias_requires_grad)
    # One gradient per forward input: q, k, v, mask, bias, the three walks, the sequences, then the settings.
    return dq, dk, dv, None, dbias if bias_requires_grad else None, *([None] * (5 + len(ctx.settings)))


torch.library.register_autograd(
    "flash_dma::forward", lambda ctx, dout, _dlse: _gradients(ctx, dout, backward_op), setup_context=_setup_context
)


def _kvcache_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    key_list: torch.Tensor | None,
    seqlens_k: torch.Tensor,
    cache_rows: torch.Tensor | None,
    block_table: torch.Tensor | None,
    page_size: int,
    capacity: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` over cached keys (``flash_dma_with_kvcache``); ``num_splits`` 0 chooses."""
    return attention_forward(
        q, k, v, mask, bias, None, key_list, 0, 0, softmax_scale, window_left, window_right, softcap,
        num_splits=num_splits or None,
        sequences=Sequences(SEQ_CACHE, None, seqlens_k, q.shape[0], q.shape[1], capacity),
        cache=CachePages(cache_rows, block_table, page_size),
    )


kvcache_forward_op = torch.library.custom_op("flash_dma::kvcache_forward", _kvcache_forward, mutates_args=())


@kvcache_forward_op.register_fake
def _kvcache_forward_fake(q, *_):
    batch, seqlen_q, num_heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(batch, num_heads, seqlen_q, dtype=torch.float32)


def kvcache_forward(*inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``_kvcache_forward``, through the custom op when compiling."""
    return (kvcache_forward_op if torch.compiler.is_compiling() else _kvcache_forward)(*inputs)


_TENSOR_INPUTS = 10  # q, k, v, mask, bias, the three walks and the two sequence tables; the settings follow


class _EagerAttention(torch.autograd.Function):
    # The settings travel as one tuple: apply's host time grows with its argument count.
    @staticmethod
    def forward(ctx, *tensors_and_settings):
        inputs = (*tensors_and_settings[:_TENSOR_INPUTS], *tensors_and_settings[_TENSOR_INPUTS])
        output = launch_forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*_gradients(ctx, dout, _backward)[:_TENSOR_INPUTS], None)


def attention_op(*inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``, with the arguments of ``forward_op``."""
    if torch.compiler.is_compiling():
        return forward_op(*inputs)
    return _EagerAttention.apply(*inputs[:_TENSOR_INPUTS], inputs[_TENSOR_INPUTS:])
