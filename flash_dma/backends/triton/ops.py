"""Autograd wiring of the Triton kernels: ``torch.library`` custom ops and an ``autograd.Function``.

Under ``torch.compile`` the kernels run as opaque custom ops with fake implementations, so
``fullgraph=True`` traces models that call flash-dma without graph breaks, and shapes come from
the fakes (a new sequence length does not recompile once dynamo has marked it dynamic). Eager
calls take an ``autograd.Function`` and call the launchers directly: the custom-op dispatcher
costs more host time per call than a small attention kernel runs. Both share the same context
and backward.
"""

from __future__ import annotations

import typing

import torch

from flash_dma.backends.triton.backward import attention_backward
from flash_dma.backends.triton.bit_pack import pack_bits
from flash_dma.backends.triton.block_summary import block_lists, block_state
from flash_dma.backends.triton.block_topk import block_topk_state
from flash_dma.backends.triton.forward import attention_forward
from flash_dma.backends.triton.key_list import build_key_list
from flash_dma.backends.triton.layout import (
    BIAS_FIELD,
    CALL_TENSORS,
    SEQ_CACHE,
    TOPK_BIAS_FIELD,
    TOPK_TENSORS,
    CachePages,
    Call,
    Sequences,
    TopkCall,
)
from flash_dma.backends.triton.topk.backward import topk_backward
from flash_dma.backends.triton.topk.forward import topk_forward
from flash_dma.backends.triton.topk.passes import split_backward, split_forward
from flash_dma.bit_mask import words_per_row
from flash_dma.block_mask import state_shape
from flash_dma.inputs import output_dtype


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
    return mask.new_empty(state_shape(mask.shape, block_q, block_k), dtype=torch.int8)


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


@torch.library.custom_op("flash_dma::pack_bits", mutates_args=())
def pack_bits_op(mask: torch.Tensor, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_bits(mask, block_q, block_k)


@pack_bits_op.register_fake
def _pack_bits_fake(mask, block_q, block_k):
    nb, nh, sq, sk = mask.shape
    words = mask.new_empty(nb, nh, sq, words_per_row(sk), dtype=torch.int32)
    return words, mask.new_empty(state_shape(mask.shape, block_q, block_k), dtype=torch.int8)


def packed_bits(mask: torch.Tensor, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_bits``, through the custom op when compiling."""
    return (pack_bits_op if torch.compiler.is_compiling() else pack_bits)(mask, block_q, block_k)


@torch.library.custom_op("flash_dma::block_topk_state", mutates_args=())
def block_topk_state_op(
    bias: torch.Tensor, allowed: torch.Tensor | None, past_end: torch.Tensor | None, block_k: int, keep: int,
    sink_blocks: int, mean: bool,
) -> torch.Tensor:
    return block_topk_state(bias, allowed, past_end, block_k, keep, sink_blocks, mean)


@block_topk_state_op.register_fake
def _block_topk_state_fake(bias, allowed, past_end, block_k, keep, sink_blocks, mean):
    nb, nh, _, sk = bias.shape
    return bias.new_empty(nb, nh, 1, (sk + block_k - 1) // block_k, dtype=torch.int8)


def topk_state(
    bias: torch.Tensor, allowed: torch.Tensor | None, past_end: torch.Tensor | None, block_k: int, keep: int,
    sink_blocks: int, mean: bool,
) -> torch.Tensor:
    """``block_topk_state``, through the custom op when compiling."""
    return (block_topk_state_op if torch.compiler.is_compiling() else block_topk_state)(
        bias, allowed, past_end, block_k, keep, sink_blocks, mean
    )


_SCHEMA_TYPES = {torch.Tensor: "Tensor", torch.Tensor | None: "Tensor?", int: "SymInt", float: "float", bool: "bool", str: "str"}


def _schema(record) -> str:
    """The custom ops take a record's fields flat, typed from it (torch.library wants positional tensors)."""
    return ", ".join(f"{_SCHEMA_TYPES[kind]} {name}" for name, kind in typing.get_type_hints(record).items())


_CALL_SCHEMA = _schema(Call)


def launch_forward(*fields) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the call whose fields are ``fields``, without autograd."""
    return attention_forward(Call(*fields))


forward_op = torch.library.custom_op(
    "flash_dma::forward", launch_forward, mutates_args=(), schema=f"({_CALL_SCHEMA}) -> (Tensor, Tensor)"
)


@forward_op.register_fake
def _forward_fake(q, *_):
    batch, seqlen_q, num_heads, head_dim = q.shape
    out = q.new_empty(batch, seqlen_q, num_heads, head_dim, dtype=output_dtype(q.dtype))
    return out, q.new_empty(batch, num_heads, seqlen_q, dtype=torch.float32)


def _backward(dout, *fields_out_lse_and_flag) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dbias)``; dbias is None when not asked for."""
    *fields, out, lse, bias_requires_grad = fields_out_lse_and_flag
    return attention_backward(dout, Call(*fields), out, lse, bias_requires_grad)


def _tensor_gradients(backward):
    """``backward`` (``(dq, dk, dv, dbias or None)``) with an empty dbias when not asked for:
    custom ops return tensors."""

    def gradients(*args):
        dq, dk, dv, dbias = backward(*args)
        return dq, dk, dv, dq.new_empty(0) if dbias is None else dbias

    return gradients


backward_op = torch.library.custom_op(
    "flash_dma::backward", _tensor_gradients(_backward), mutates_args=(),
    schema=f"(Tensor dout, {_CALL_SCHEMA}, Tensor out, Tensor lse, bool bias_requires_grad) -> (Tensor, Tensor, Tensor, Tensor)",
)


@backward_op.register_fake
def _backward_fake(dout, q, k, v, _mask_or_indices, bias, *args):  # also the top-k op's (indices fourth)
    bias_requires_grad = args[-1]
    # Contiguous, like the real gradients (not empty_like, which copies an input's strides).
    dbias = bias.new_empty(bias.shape) if bias is not None and bias_requires_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output, tensors: int = CALL_TENSORS):
    out, lse = output
    ctx.save_for_backward(*inputs[:tensors], out, lse)
    ctx.settings = inputs[tensors:]
    ctx.mark_non_differentiable(lse)


def _eager_setup_context(ctx, inputs, output, tensors: int = CALL_TENSORS):
    """``_setup_context`` of the eager ``autograd.Function``s: the LSE, which takes no gradient, is
    handed to their backward as None, not as zeros autograd would allocate and fill on every call
    (torch.compile's trace of the custom ops has no such setting)."""
    ctx.set_materialize_grads(False)
    _setup_context(ctx, inputs, output, tensors)


def _gradients(ctx, dout, backward, bias_input: int = BIAS_FIELD, bias_field: int = BIAS_FIELD):
    """``(dq, dk, dv, dbias or None)``; ``bias_input`` is the bias's place among the op's inputs,
    ``bias_field`` among the record's fields. An undefined ``dout`` (the eager functions'
    gradients are not filled in) means zero gradients: all None."""
    if dout is None:
        return None, None, None, None
    *tensors, out, lse = ctx.saved_tensors
    bias_requires_grad = tensors[bias_field] is not None and ctx.needs_input_grad[bias_input]
    dq, dk, dv, dbias = backward(dout, *tensors, *ctx.settings, out, lse, bias_requires_grad)
    return dq, dk, dv, dbias if bias_requires_grad else None


def _field_gradients(ctx, dout, _dlse):
    # One gradient per field of the call: q, k and v, the bias's, and none for the others.
    dq, dk, dv, dbias = _gradients(ctx, dout, backward_op)
    grads = [dq, dk, dv, *[None] * (len(Call._fields) - 3)]
    grads[BIAS_FIELD] = dbias
    return tuple(grads)


torch.library.register_autograd("flash_dma::forward", _field_gradients, setup_context=_setup_context)


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
    call = Call(
        q, k, v, mask, bias, None, None, key_list, None, None, None, 0, 0, softmax_scale, window_left, window_right, softcap,
        False, 0, 0, "elements",
    )
    return attention_forward(
        call, num_splits=num_splits or None, sequences=Sequences(SEQ_CACHE, None, seqlens_k, q.shape[0], q.shape[1], capacity),
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


def _launch_topk_forward(*fields) -> tuple[torch.Tensor, torch.Tensor]:
    return topk_forward(TopkCall(*fields))


_TOPK_SCHEMA = _schema(TopkCall)
topk_forward_op = torch.library.custom_op(
    "flash_dma::topk_forward", _launch_topk_forward, mutates_args=(), schema=f"({_TOPK_SCHEMA}) -> (Tensor, Tensor)"
)

topk_forward_op.register_fake(_forward_fake)  # the same outputs: out like q, lse [B, H, Sq]


def _topk_backward(dout, *fields_out_lse_and_flag):
    *fields, out, lse, bias_requires_grad = fields_out_lse_and_flag
    return topk_backward(dout, TopkCall(*fields), out, lse, bias_requires_grad)


topk_backward_op = torch.library.custom_op(
    "flash_dma::topk_backward", _tensor_gradients(_topk_backward), mutates_args=(),
    schema=f"(Tensor dout, {_TOPK_SCHEMA}, Tensor out, Tensor lse, bool bias_requires_grad) -> (Tensor, Tensor, Tensor, Tensor)",
)
topk_backward_op.register_fake(_backward_fake)

# A split call (``topk/passes.py``): the top-k call's fields, then whether the forward walks the packed mask.
split_forward_op = torch.library.custom_op(
    "flash_dma::topk_split_forward", split_forward, mutates_args=(),
    schema=f"({_TOPK_SCHEMA}, bool packed_forward) -> (Tensor, Tensor)",
)
split_forward_op.register_fake(_forward_fake)
split_backward_op = torch.library.custom_op(
    "flash_dma::topk_split_backward", _tensor_gradients(split_backward), mutates_args=(),
    schema=f"(Tensor dout, {_TOPK_SCHEMA}, bool packed_forward, Tensor out, Tensor lse, bool bias_requires_grad) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
split_backward_op.register_fake(_backward_fake)


def _topk_setup_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output, TOPK_TENSORS)  # a split's flag joins the settings


def _topk_field_gradients(backward_op, inputs: int):
    """The gradients of a top-k op's ``inputs`` (the call's fields, then any flag): q, k and v, the
    bias's, and none for the others."""

    def gradients(ctx, dout, _dlse):
        dq, dk, dv, dbias = _gradients(ctx, dout, backward_op, TOPK_BIAS_FIELD, TOPK_BIAS_FIELD)
        grads = [dq, dk, dv, *[None] * (inputs - 3)]
        grads[TOPK_BIAS_FIELD] = dbias
        return tuple(grads)

    return gradients


torch.library.register_autograd(
    "flash_dma::topk_forward", _topk_field_gradients(topk_backward_op, len(TopkCall._fields)), setup_context=_topk_setup_context,
)
torch.library.register_autograd(
    "flash_dma::topk_split_forward", _topk_field_gradients(split_backward_op, len(TopkCall._fields) + 1),
    setup_context=_topk_setup_context,
)


class _EagerTopk(torch.autograd.Function):
    # As _EagerAttention: the differentiable tensors are inputs, the call travels whole.
    @staticmethod
    def forward(ctx, q, k, v, bias, call):
        output = topk_forward(call)
        _eager_setup_context(ctx, call, output, TOPK_TENSORS)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*_gradients(ctx, dout, _topk_backward, 3, TOPK_BIAS_FIELD), None)


def topk_attention_op(call: TopkCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a top-k ``call``, differentiable: through the custom op when compiling."""
    if torch.compiler.is_compiling():
        return topk_forward_op(*call)
    return _EagerTopk.apply(call.q, call.k, call.v, call.bias, call)


class _EagerSplit(torch.autograd.Function):
    # As _EagerTopk, with the split's flag travelling beside the call.
    @staticmethod
    def forward(ctx, q, k, v, bias, call, packed_forward):
        output = split_forward(*call, packed_forward)
        _eager_setup_context(ctx, (*call, packed_forward), output, TOPK_TENSORS)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*_gradients(ctx, dout, split_backward, 3, TOPK_BIAS_FIELD), None, None)


def topk_split_op(call: TopkCall, packed_forward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a top-k ``call`` whose forward walks its packed mask (``packed_forward``)
    and its backward its indices, or the reverse (``topk/passes.py``); differentiable, through the
    custom op when compiling."""
    if torch.compiler.is_compiling():
        return split_forward_op(*call, packed_forward)
    return _EagerSplit.apply(call.q, call.k, call.v, call.bias, call, packed_forward)


class _EagerAttention(torch.autograd.Function):
    # Only the differentiable tensors are inputs, and the call travels whole: apply's host time
    # grows with its argument count. The call's other tensors are saved all the same, so that an
    # in-place change to any of them before the backward is caught, as with the custom op.
    @staticmethod
    def forward(ctx, q, k, v, bias, call):
        output = attention_forward(call)
        _eager_setup_context(ctx, call, output)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*_gradients(ctx, dout, _backward, bias_input=3), None)  # the inputs: q, k, v, bias, call


def attention_op(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``call``, differentiable: through the custom op when compiling."""
    if torch.compiler.is_compiling():
        return forward_op(*call)
    return _EagerAttention.apply(call.q, call.k, call.v, call.bias, call)
