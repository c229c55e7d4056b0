"""Context-parallel attention: :func:`flash_dma.flash_dma_func` over a sequence sharded across a group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flash_dma.backends import reference, resolve_backend
from flash_dma.backends import triton as triton_backend
from flash_dma.distributed.agreement import agree, require_same
from flash_dma.distributed.layout import LAYOUTS, gather_lengths, layout_chunks, shard_length
from flash_dma.distributed.plan import Band, kept_blocks
from flash_dma.distributed.ring import KEY_AXIS_GLOBAL, KEY_AXIS_NONE, KEY_AXIS_SHARD, Ring
from flash_dma.inputs import UNBOUNDED, check_bias, check_mask, normalize_inputs, normalize_settings

# Backends with the partial_forward(), partial_backward() and merge_partial() that the ring drives.
RING_BACKENDS = {"triton": triton_backend, "reference": reference}


@dataclass(frozen=True)
class ContextParallelPlan:
    """What the ranks of a group agreed on for context-parallel attention over one sharded
    sequence: the layout's chunks, the steps of the ring, which key blocks a per-key mask keeps,
    and the form of the inputs and the settings. Made by :func:`plan_context_parallel` (one
    exchange between the ranks); calls that pass it exchange nothing but the tensors.
    """

    ring: Ring
    inputs: dict  # this rank's description (_describe) of the inputs and settings it was made for

    def check(self, described: dict, group) -> None:
        """A ``ValueError`` naming what of a call (``described`` by :func:`_describe`) differs from
        what the plan was made for. On this rank only: no exchange."""
        if group is not self.ring.group:
            raise ValueError(f"plan: group: expected the group the plan was made for, {self.ring.group!r}, got {group!r}")
        for key, words in _PLANNED.items():
            if described[key] != self.inputs[key]:
                raise ValueError(
                    f"plan: {words}: expected {self.inputs[key]} (what the plan was made for), got {described[key]}; "
                    "make a plan for these inputs with plan_context_parallel"
                )


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
    plan: ContextParallelPlan | None = None,
):
    """:func:`flash_dma.flash_dma_func` on a sequence sharded along its length across ``group``.

    Every rank calls it with its shard, as ``layout`` cuts the sequence (``docs/distributed.md``;
    :func:`shard_sequence` makes shards). The result on each rank is the rows of its own queries
    of attention over the whole sequence, with causal and window limits on global positions, and
    the backward gives each rank the gradients of its own shard. Every rank must run the backward.

    Args:
        query: ``[B, S_r, H, D]``, this rank's queries; S_r tokens as the layout gives rank r.
        key, value: ``[B, S_r, Hkv, D]``, the keys and values of the same tokens.
        attn_mask, attn_bias: as for :func:`flash_dma.flash_dma_func`, in one of these forms:

            - per key ``[1|B, 1|Hkv|H, 1, S_r]``: this rank's keys; travels with them. A per-key
              mask decides which key blocks are sent at all (docs/distributed.md);
            - per query ``[1|B, 1|Hkv|H, S_r, 1]``, or neither ``[., ., 1, 1]``: stays here;
            - both ``[1|B, 1|Hkv|H, S_r, S]``: this rank's query rows, every key in global order.

            The bias's gradient has its shape: for its own keys, rows or both.
        group: the process group (default: the whole world). Any size, 1 included.
        layout: ``"zigzag"`` (balanced under causal masking) or ``"contiguous"``.
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, reference elsewhere).
        plan: a :class:`ContextParallelPlan` from :func:`plan_context_parallel` with the same
            arguments, or None to make one for this call (an exchange between the ranks, with a
            host round trip). With a plan the call exchanges only tensors and never waits for
            the GPU: make one per mask and layout, and pass it to every layer that shares them.
        Other arguments: as for :func:`flash_dma.flash_dma_func` (no ``block_mask``: per-key masks
        are walked block by block all the same).

    Without a plan, shapes, dtypes and settings must agree across ranks: a disagreement, or an
    input error on any rank, raises the same ``ValueError``/``TypeError`` on every rank before any
    transfer. With one, each rank checks its inputs against the plan, which the ranks agreed on:
    a call that differs from it raises on its own rank (the others then wait in the ring until
    the group's timeout, as with any collective that one rank leaves).

    Returns:
        ``out`` ``[B, S_r, H, D]``; with ``return_lse`` also ``lse`` ``[B, H, S_r]`` float32.
    """
    settings = dict(
        layout=layout, softmax_scale=softmax_scale, is_causal=is_causal, window_size=window_size, softcap=softcap,
        deterministic=deterministic, backend=backend,
    )
    if plan is None:
        plan = plan_context_parallel(query, key, value, attn_mask, attn_bias, group=group, **settings)
    elif not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan: expected a ContextParallelPlan (from plan_context_parallel) or None, got {type(plan).__name__}")
    else:
        plan.check(_describe(query, key, value, attn_mask, attn_bias, **settings), group)
    out, lse = _RingAttention.apply(query, key, value, attn_bias, attn_mask, plan.ring)
    return (out, lse) if return_lse else out


def plan_context_parallel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    softcap: float = 0,
    deterministic: bool = False,
    backend: str | None = None,
) -> ContextParallelPlan:
    """The plan of :func:`context_parallel_attention` calls with these arguments (a collective:
    every rank of ``group`` calls it, with its shard).

    The ranks exchange their shard lengths and a description of their inputs (two
    ``all_gather_object``, host round trips) and check them as the call does; each rank reads
    which 128-key blocks of its per-key mask keep a key. The plan then serves any call with
    inputs of the same shapes, dtypes and settings, and a mask that keeps no key block the
    planned mask leaves empty (the same mask, as every layer of a model shares it; as a
    ``block_mask`` must summarise ``attn_mask``, this is not checked). The example tensors are
    not kept.

    Args: as for :func:`context_parallel_attention`.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # The shard lengths first: with them each rank knows its chunks, and summarises its per-key
    # mask per chunk block on its own device (plans then read a few bools on the host).
    lengths = gather_lengths(query.shape[1] if isinstance(query, torch.Tensor) and query.dim() == 4 else None, group)
    total = sum(n for n in lengths if n is not None)
    laid_out = layout in LAYOUTS and lengths == [shard_length(total, world, r, layout) for r in range(world)]

    def check() -> dict:
        own = _describe(
            query, key, value, attn_mask, attn_bias, layout=layout, softmax_scale=softmax_scale, is_causal=is_causal,
            window_size=window_size, softcap=softcap, deterministic=deterministic, backend=backend,
        )
        kept = None
        if _key_axis(attn_mask) == KEY_AXIS_SHARD and laid_out:
            keys = (attn_mask if attn_mask.dtype == torch.bool else attn_mask != 0).any(dim=(0, 1, 2))
            kept = [kept_blocks(keys, c) for c in layout_chunks(total, world, layout)[rank]]
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, attn_bias)
        )
        return {**own, "kept": kept, "gradients": (needs_grad, needs_grad and attn_bias is not None and attn_bias.requires_grad)}

    described = agree(group, check)
    require_same(described, _AGREED)
    if not laid_out:
        expected = [shard_length(total, world, r, layout) for r in range(world)]
        raise ValueError(
            f"query: the shards hold {lengths} tokens on ranks 0..{world - 1}, but the {layout!r} layout cuts "
            f"{total} tokens into {expected} (shard_sequence makes such shards)"
        )
    for r, d in enumerate(described):
        for key_length in d["key_lengths"]:
            if key_length != total:
                raise ValueError(
                    f"rank {r}: attn_mask/attn_bias: a form with both axes [., ., S_r, S] must cover all "
                    f"S = {total} keys of the sequence, got {key_length}"
                )
    mine = described[rank]
    scale, window, softcap_, deterministic_, name, _ = mine["settings"]
    chunks = layout_chunks(total, world, layout)
    ring = Ring(
        group=group,
        rank=rank,
        world=world,
        backend=RING_BACKENDS[name],
        chunks=chunks,
        kept=[d["kept"] or [None] * len(rank_chunks) for d, rank_chunks in zip(described, chunks)],
        band=Band.of(window),
        mask_axis=_key_axis(attn_mask),
        bias_axis=_key_axis(attn_bias),
        softmax_scale=scale,
        softcap=softcap_,
        deterministic=deterministic_,
    )
    ring.prepare(query.device)
    return ContextParallelPlan(ring=ring, inputs={planned: mine[planned] for planned in _PLANNED})


def _key_axis(t: torch.Tensor | None) -> str | None:
    """How ``t`` is sharded (see :mod:`flash_dma.distributed.ring`), before the total is known."""
    if t is None:
        return None
    if t.shape[3] == 1:
        return KEY_AXIS_NONE
    return KEY_AXIS_SHARD if t.shape[2] == 1 else KEY_AXIS_GLOBAL


def _form(t: torch.Tensor | None) -> tuple | None:
    """What must match across ranks: the shape less its sequence axes, and the dtype."""
    return None if t is None else (*t.shape[:2], t.shape[2] > 1, t.shape[3] > 1, str(t.dtype))


# What must be the same on every rank, and the words that name it in errors.
_AGREED = {
    "shape": "query/key: (B, H, Hkv, D)",
    "dtype": "query: dtype",
    "device": "query: device type",
    "mask": "attn_mask: shape less its sequence axes, and dtype",
    "bias": "attn_bias: shape less its sequence axes, and dtype",
    "gradients": "requires_grad of (any input, attn_bias)",
    "settings": "(softmax_scale, window, softcap, deterministic, backend, layout)",
}
# What a call with a plan must share with the inputs the plan was made for. Not requires_grad: a
# plan serves forwards with and without gradients (the backward asks autograd for the bias's).
_PLANNED = {
    **{key: words for key, words in _AGREED.items() if key != "gradients"},
    "length": "query: the shard length (dimension 1)",
    "key_lengths": "attn_mask/attn_bias: the key length S of a form with both axes [., ., S_r, S]",
}


def _describe(
    query, key, value, mask, bias, *, layout, softmax_scale, is_causal, window_size, softcap, deterministic, backend
) -> dict:
    """This rank's inputs and settings, validated on their own (no exchange), described by the
    keys of :data:`_PLANNED`."""
    normalize_inputs(query, key, value)
    settings = normalize_settings(query, softmax_scale, is_causal, window_size, softcap, deterministic)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    batch, seqlen, num_heads, head_dim = query.shape
    if key.shape[1] != seqlen:
        raise ValueError(
            f"key: expected the shard length of query, {seqlen} (query and keys are the same tokens), got {key.shape[1]}"
        )
    name = "triton" if backend is None and query.device.type == "cuda" else backend or "reference"
    if name not in RING_BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, RING_BACKENDS))} or None, got {backend!r}")
    resolve_backend(name, query.device)
    for t, checker in ((mask, check_mask), (bias, check_bias)):
        if t is not None:
            both_axes = isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] > 1 and t.shape[3] > 1
            shape = (batch, seqlen, t.shape[3] if both_axes else seqlen, num_heads, key.shape[2], head_dim)
            checker(t, query, shape)
    return {
        "length": seqlen,
        "key_lengths": tuple(t.shape[3] for t in (mask, bias) if t is not None and t.shape[2] > 1 and t.shape[3] > 1),
        "shape": (batch, num_heads, key.shape[2], head_dim),
        "dtype": str(query.dtype),
        "device": query.device.type,
        "mask": _form(mask),
        "bias": _form(bias),
        "settings": (*settings.values(), name, layout),
    }


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, bias, mask, ring: Ring):
        out, lse = ring.forward(query, key, value, mask, bias)
        ctx.save_for_backward(query, key, value, mask, bias, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        query, key, value, mask, bias, out, lse = ctx.saved_tensors
        dq, dk, dv, dbias = ctx.ring.backward(dout, query, key, value, mask, bias, out, lse, ctx.needs_input_grad[3])
        return dq, dk, dv, dbias, None, None
