"""Which kernel serves which problem form: the one routing table of the Triton backend.

Each pass of a call (``"forward"``, ``"dq"``, ``"dkdv"``) has a :class:`Form`, read off its
:class:`~flash_dma.backends.triton.layout.Call` by :func:`form_of`. :func:`route` answers with
the kernel of the first row of :data:`ROUTES` that covers the form: ``"hopper"`` (the
warp-specialised Gluon kernels of ``hopper/``) or ``"triton"`` (``forward.py``, ``backward.py``),
which covers everything. This module alone reads ``FLASH_DMA_HOPPER`` and asks whether the GPU
is a Hopper; ``docs/api.md``'s "What runs where" table is :func:`routing_table`, and a test
keeps the two equal.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flash_dma.backends.triton import configs
from flash_dma.backends.triton.hopper.common import FORWARD_HEAD_DIMS, HEAD_DIMS, TILES, WIDE_HEAD_DIMS
from flash_dma.backends.triton.layout import (
    SEQ_PACKED,
    WALK_BLOCKS,
    WALK_DENSE,
    Call,
    Sequences,
    TopkCall,
    input_form,
    tma_aligned,
    walk_kind,
)
from flash_dma.inputs import FP8_DTYPE

HOPPER, TRITON, TOPK, TOPK_ATOMIC, TOPK_UNION = "hopper", "triton", "topk", "topk-atomic", "topk-union"
PASSES = ("forward", "dq", "dkdv")
_WALKS = {WALK_DENSE: "dense", WALK_BLOCKS: "blocks"}
# GQA groups this wide fill a top-k tile's 16 rows with one query's heads: the backward's union of a
# query block's keys (``topk_union.py``) does not pay there.
WIDE_GROUP = 16
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", FP8_DTYPE: "fp8"}


class Form(NamedTuple):
    """What the choice of kernel for one pass depends on."""

    device: str  # "hopper" (sm90, FLASH_DMA_HOPPER not 0), "cuda" (other GPUs, or Hopper turned off), "interpreter"
    dtype: str  # "fp16" | "bf16" | "fp32" | "fp8" (e4m3, forward only)
    head_dim: int
    wide_group: bool  # WIDE_GROUP query heads or more per key/value head (GQA)
    mask: str  # "none" | "keys" [., ., 1, Sk|1] | "rows" [., ., Sq, 1] | "pairs" (bool per pair) | "bits" (a BitMask's words)
    bias: str  # "none" | "keys" [., ., 1, Sk|1] | "rows" [., ., Sq, 1] | "pairs" [., ., Sq, Sk]
    walk: str  # "dense" | "blocks" (a block summary's lists) | "keys" (a key list) | "indices" (top-k indices per query)
    sequences: str  # "fixed" | "packed" (varlen) | "cache" (a contiguous KV cache, entry b in row b) | "cache-indexed" (rows or pages)
    split: bool  # split-KV or GQA heads packed into rows (decode-sized calls)
    deterministic: bool
    softcap: bool
    aligned: bool  # TMA-copyable rows, summary blocks the kernel's tiles divide, a per-pair bias's keys consecutive, no empty input


@dataclass(frozen=True)
class Route:
    """One row of the table: ``kernel`` serves ``passes`` for every form whose fields are all
    among the row's values (None: any value)."""

    kernel: str
    passes: tuple[str, ...]
    device: tuple | None = None
    dtype: tuple | None = None
    head_dim: tuple | None = None
    wide_group: tuple | None = None
    mask: tuple | None = None
    bias: tuple | None = None
    walk: tuple | None = None
    sequences: tuple | None = None
    split: tuple | None = None
    deterministic: tuple | None = None
    softcap: tuple | None = None
    aligned: tuple | None = None

    def covers(self, pass_: str, form: Form) -> bool:
        return pass_ in self.passes and all(
            getattr(self, field) is None or value in getattr(self, field) for field, value in zip(Form._fields, form)
        )


_HOPPER_FORMS = dict(
    device=("hopper",), dtype=("fp16", "bf16"), mask=("none", "keys", "rows", "bits"), sequences=("fixed",), split=(False,),
    aligned=(True,),
)
ROUTES = (
    # flash_dma_topk_func: keys listed per query, gathered (``topk_forward.py``, ``topk_backward.py``).
    # The backward splits by query block: a block whose queries' union of keys is small walks it
    # once (``topk_union.py``), the others per query; dK/dV by atomics. Not for groups of 16 heads
    # and more, whose blocks of 4 queries or fewer share too few keys, nor with a bias per listed
    # pair, which has no place in the union: dK/dV added by atomics in the dQ walk, or
    # deterministic, key-outer over a sorted inverse map.
    Route(TOPK_UNION, ("dq", "dkdv"), wide_group=(False,), walk=("indices",), bias=("none", "keys"), deterministic=(False,)),
    Route(TOPK_ATOMIC, ("dkdv",), walk=("indices",), deterministic=(False,)),
    Route(TOPK, PASSES, walk=("indices",)),
    Route(HOPPER, ("forward",), **_HOPPER_FORMS, head_dim=FORWARD_HEAD_DIMS),
    Route(HOPPER, ("dq", "dkdv"), **_HOPPER_FORMS, head_dim=HEAD_DIMS),
    # The backward at head dims 192 and 256 (tiles of 256 columns), without a BitMask: dK/dV's words
    # are staged for items of 128 keys, these take 64.
    Route(HOPPER, ("dq", "dkdv"), **{**_HOPPER_FORMS, "mask": ("none", "keys", "rows")}, head_dim=WIDE_HEAD_DIMS),
    # Packed sequences (varlen): per-key masks and biases only, walked by summaries or densely (a key
    # list is gathered per batch entry, not per sequence).
    Route(HOPPER, PASSES, **{**_HOPPER_FORMS, "sequences": ("packed",), "mask": ("none", "keys")}, head_dim=HEAD_DIMS,
          bias=("none", "keys"), walk=("dense", "blocks")),
    # Chunked prefill over a KV cache: the forward (a cache call has no backward). Its entries' keys
    # lie in their own rows, rows that cache_batch_idx names, or pages of whole key tiles; a key list
    # is gathered from batch rows, so an indexed cache's takes the Triton kernel.
    Route(HOPPER, ("forward",), **{**_HOPPER_FORMS, "sequences": ("cache",), "mask": ("none", "keys")},
          head_dim=FORWARD_HEAD_DIMS, bias=("none", "keys")),
    Route(HOPPER, ("forward",), **{**_HOPPER_FORMS, "sequences": ("cache-indexed",), "mask": ("none", "keys")},
          head_dim=FORWARD_HEAD_DIMS, bias=("none", "keys"), walk=("dense", "blocks")),
    # FP8 (forward only): the Hopper forward reads it as it is; every other form is dequantized to
    # float32 for the Triton kernel (``forward.attention_forward``).
    Route(HOPPER, ("forward",), **{**_HOPPER_FORMS, "dtype": ("fp8",)}, head_dim=FORWARD_HEAD_DIMS),
    Route(TRITON, PASSES),
)


@functools.lru_cache(maxsize=1024)  # forms are few: a walk of the table per call costs more than the lookup
def route(pass_: str, form: Form) -> str:
    """The kernel that serves ``pass_`` of a call of ``form``."""
    return next(r.kernel for r in ROUTES if r.covers(pass_, form))


def device_kind(device: torch.device) -> str:
    """``Form.device`` for tensors on ``device``; ``FLASH_DMA_HOPPER=0`` is read on every call."""
    if configs.triton_interpreting():
        return "interpreter"
    if os.environ.get("FLASH_DMA_HOPPER", "1") != "0" and configs.is_hopper(device):
        return "hopper"
    return "cuda"


def _wide_group(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the GQA group of ``q`` ``[B, Sq, H, D]`` over ``k`` ``[B, Sk, Hkv, D]`` has WIDE_GROUP heads or more."""
    return q.shape[2] >= WIDE_GROUP * k.shape[2]


def form_of(
    pass_: str, call: Call, sequences: Sequences | None = None, split: bool = False, dout: torch.Tensor | None = None,
    indexed: bool = False, page_size: int = 0,
) -> Form:
    """The form of ``pass_`` of ``call`` (``dout`` for the backward's alignment; ``indexed``: a KV
    cache whose entries find their keys through ``cache_batch_idx`` or a block table of pages of
    ``page_size`` keys, aligned when each key tile lies within one page)."""
    q = call.q
    walked = call.kv_lists if pass_ != "dkdv" else call.q_lists
    walk = "keys" if call.key_list is not None else _WALKS[walk_kind(walked, None)]
    block_m, block_n = TILES[pass_]
    tensors = (q, call.k, call.v) if dout is None else (q, call.k, call.v, dout)
    bias = call.bias
    pair_bias = input_form(bias) == "pairs"
    aligned = (
        call.list_block_q % block_m == 0 and call.list_block_k % block_n == 0 and q.numel() > 0 and call.k.numel() > 0
        and tma_aligned(*tensors) and not (pair_bias and bias.stride(3) != 1)  # consecutive keys (``hopper/common.pair_offsets``)
        and page_size % block_n == 0
    )
    return Form(
        device=device_kind(q.device),
        dtype=_DTYPES[q.dtype],
        head_dim=q.shape[3],
        wide_group=_wide_group(q, call.k),
        mask=input_form(call.mask, call.mask_bits),
        bias=input_form(call.bias),
        walk=walk,
        sequences="fixed" if sequences is None else ("packed" if sequences.kind == SEQ_PACKED else ("cache-indexed" if indexed else "cache")),
        split=split,
        deterministic=call.deterministic,
        softcap=call.softcap > 0,
        aligned=aligned,
    )


def topk_form(call: TopkCall) -> Form:
    """The form of a top-k call (``flash_dma_topk_func``); its passes share it."""
    bias = call.bias
    return Form(
        device=device_kind(call.q.device),
        dtype=_DTYPES[call.q.dtype],
        head_dim=call.q.shape[3],
        wide_group=_wide_group(call.q, call.k),
        mask="none",
        bias="none" if bias is None else ("keys" if bias.dim() == 3 else "pairs"),
        walk="indices",
        sequences="fixed",
        split=False,
        deterministic=call.deterministic,
        softcap=call.softcap > 0,
        aligned=tma_aligned(call.q, call.k, call.v),
    )


def hopper_takes_bits(call: Call) -> bool:
    """Whether a per-pair bool mask of ``call`` (large: walked by a summary) should be packed into
    bits: the Hopper forward serves the call with them."""
    form = form_of("forward", call)._replace(mask="bits", walk="blocks")
    return route("forward", form) == HOPPER


def routing_table() -> str:
    """``ROUTES`` as the markdown table of ``docs/api.md`` ("What runs where"): one row per route,
    first match wins."""
    def cell(values) -> str:
        if values is None:
            return "any"
        return ", ".join({True: "yes", False: "no"}.get(v, str(v)) if isinstance(v, bool) else str(v) for v in values)

    lines = [
        "| kernel | passes | " + " | ".join(f.replace("_", " ") for f in Form._fields) + " |",
        "|---|---|" + "---|" * len(Form._fields),
    ]
    for r in ROUTES:
        cells = [cell(getattr(r, field)) for field in Form._fields]
        lines.append(f"| {r.kernel} | {', '.join(r.passes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
