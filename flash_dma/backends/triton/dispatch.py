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
import math
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
    band,
    input_form,
    tma_aligned,
    walk_kind,
)
from flash_dma.inputs import FP8_DTYPE

HOPPER, TRITON, TOPK, TOPK_ATOMIC, TOPK_UNION = "hopper", "triton", "topk", "topk-atomic", "topk-union"
PASSES = ("forward", "dq", "dkdv")
_WALKS = {WALK_DENSE: "dense", WALK_BLOCKS: "blocks"}
# GQA groups this wide fill a top-k tile's 16 rows with one query's heads: the backward's union of a
# query block's keys (``topk/union.py``) does not pay there.
WIDE_GROUP = 16
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", FP8_DTYPE: "fp8"}


class Form(NamedTuple):
    """What the choice of kernel for one pass depends on."""

    device: str  # "hopper" (sm90, FLASH_DMA_HOPPER not 0), "cuda" (other GPUs, or Hopper turned off), "interpreter"
    dtype: str  # "fp16" | "bf16" | "fp32" | "fp8" (e4m3, forward only)
    head_dim: int
    wide_group: bool  # WIDE_GROUP query heads or more per key/value head (GQA)
    mask: str  # "none" | "keys" [., ., 1, Sk|1] | "rows" [., ., Sq, 1] | "pairs" (bool per pair) | "bits" (a BitMask's words) | "intervals" (key intervals' rows)
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
    device=("hopper",), dtype=("fp16", "bf16"), mask=("none", "keys", "rows", "bits", "intervals"), sequences=("fixed",), split=(False,),
    aligned=(True,),
)
ROUTES = (
    # flash_dma_topk_func: keys listed per query, gathered (``topk/forward.py``, ``topk/backward.py``).
    # The backward splits by query block: a block whose queries' union of keys is small walks it
    # once (``topk/union.py``), the others per query; dK/dV by atomics. Not for groups of 16 heads
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
    Route(HOPPER, ("dq", "dkdv"), **{**_HOPPER_FORMS, "mask": ("none", "keys", "rows", "intervals")}, head_dim=WIDE_HEAD_DIMS),
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
        mask=input_form(call.mask, call.mask_kind),
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


# flash_dma_topk_func: each pass walks the indices (the index kernels: the topk rows of ROUTES) or
# the packed per-query mask of its entries (``flash_dma.topk.as_mask_problem``, which the rows after
# them serve), whichever the cost model below makes cheaper.
TOPK_INDICES, TOPK_PACKED = "indices", "packed"
# Memory bounds of the packed form. Its BitMask costs Sk / 8 bytes per query and K/V head: at most
# twice the indices' 4 W. A bias plane (``topk.plane_heads``) costs 4 Sk bytes per query and plane
# head: at most 16 bytes per list entry, as much as the index backward's sorted map.
TOPK_BITS_KEYS_PER_ENTRY = 64
TOPK_PLANE_KEYS_PER_ENTRY = 4
TOPK_COST_KEYS = 32768  # the length at which the index backward's costs are given
_TOPK_TILE = 128  # the dense kernels' tiles (and the BitMask's summary blocks): 128 x 128 pairs
_TOPK_ROWS = 16  # the index kernels' tiles hold the group's heads in at least 16 rows (tl.dot's least)
_TOPK_HEAD_DIM = 128  # the head dim at which the costs are given; both walks scale with it


class TopkPlan(NamedTuple):
    """The walk of each pass of a top-k call: :data:`TOPK_INDICES` or :data:`TOPK_PACKED`."""

    forward: str
    backward: str


class TopkCosts(NamedTuple):
    """The top-k cost model's constants, in picoseconds per unit of work on the H100 (bf16, head
    dim 128, groups of up to 16 heads). Refit them from ``flash-dma bench --suite topkfit``
    (``benchmark/suites.topkfit_cases`` says how)."""

    walk_forward: float  # index forward, per list entry (query x K/V head x slot)
    # Index backward per entry at TOPK_COST_KEYS keys: with overlapping selections (neighbouring
    # queries list many of the same keys, which the union walk shares), with random ones (and for
    # groups of WIDE_GROUP heads, which keep the per-query walk), and with deterministic=True.
    walk_backward_overlapping: float
    walk_backward_random: float
    walk_backward_deterministic: float
    walk_backward_growth: float  # the backward's cost per entry grows as (Sk / TOPK_COST_KEYS) ** this
    packed_forward: float  # dense kernels over the BitMask, per (query head x key) pair of the band's tiles
    packed_backward: float
    packed_backward_deterministic: float
    bits_entry: float  # building the BitMask (``topk/bits.py``): per list entry
    bits_pair: float  # and per (query x K/V head x key), its words zeroed and read once
    plane_forward: float  # a bias plane: per (query x plane head x key), built and read
    plane_backward: float  # and its gradient


# Fitted by `python -m flash_dma.benchmark.topk_fit` to one `flash-dma bench --suite topkfit
# --lengths 16K,32K,64K` run on an H100 (bf16, torch 2.11, triton 3.6; llm shape, W = 2048, random
# and overlapping selections, H = 16 and 64): at every measured point the plan it picks is the
# fastest. Not measured by that run: 128K (the growth is fitted over 16K-64K), the deterministic
# walks (kept at their ratio to the plain ones) and the bias plane (the estimate of its bytes).
TOPK_COSTS = TopkCosts(
    walk_forward=94.99, walk_backward_overlapping=165.3, walk_backward_random=301.1,
    walk_backward_deterministic=1525.0, walk_backward_growth=0.5935, packed_forward=1.067, packed_backward=3.279,
    packed_backward_deterministic=3.688, bits_entry=1.369, bits_pair=0.2876, plane_forward=16.0, plane_backward=8.0,
)


@functools.lru_cache(maxsize=1024)  # it walks the query blocks: once per shape, not per call
def band_tiles(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, tile: int = _TOPK_TILE) -> int:
    """``tile x tile`` tiles of the ``[Sq, Sk]`` plane that hold a visible pair (bottom-right
    aligned, -1 unbounded): the tiles the dense kernels visit when every one of them is kept."""
    band_lo, band_hi = band(window_left, window_right, seqlen_q, seqlen_k)
    shift = seqlen_k - seqlen_q
    tiles = 0
    for first in range(0, seqlen_q, tile):
        last = min(first + tile, seqlen_q) - 1
        lowest, highest = max(0, first + shift + band_lo), min(seqlen_k - 1, last + shift + band_hi)
        if lowest <= highest:
            tiles += highest // tile - lowest // tile + 1
    return tiles


class TopkWork(NamedTuple):
    """What each walk of a top-k call costs in units of :class:`TopkCosts`'s constants."""

    entries: float  # list entries (B x Sq x Hkv x W), weighted by the index tiles' rows and the head dim
    backward_growth: float  # (Sk / TOPK_COST_KEYS), the base of the index backward's growth
    pairs: float  # (query head x key) pairs of the band's tiles, B x H x tiles x 128^2, weighted by the head dim
    bit_rows: float  # BitMask rows, B x Hkv x Sq: each costs W entries and Sk keys
    width: int
    seqlen_k: int
    plane: float  # bias-plane elements, B x Hd x Sq x Sk (0: no plane)
    wide_group: bool  # WIDE_GROUP heads or more per K/V head: no union walk in the index backward


def topk_work(
    batch: int, seqlen_q: int, seqlen_k: int, num_heads: int, num_kv_heads: int, head_dim: int, width: int,
    window: tuple[int, int], plane_heads: int,
) -> TopkWork:
    """The :class:`TopkWork` of a top-k call (``plane_heads``: ``topk.plane_heads``)."""
    group = num_heads // num_kv_heads
    scale = head_dim / _TOPK_HEAD_DIM
    tile_rows = max(_TOPK_ROWS, 1 << (group - 1).bit_length())
    return TopkWork(
        entries=batch * seqlen_q * num_kv_heads * width * scale * tile_rows / _TOPK_ROWS,
        backward_growth=seqlen_k / TOPK_COST_KEYS,
        pairs=batch * num_heads * band_tiles(seqlen_q, seqlen_k, *window) * _TOPK_TILE**2 * scale,
        bit_rows=batch * num_kv_heads * seqlen_q,
        width=width,
        seqlen_k=seqlen_k,
        plane=batch * plane_heads * seqlen_q * seqlen_k,
        wide_group=group >= WIDE_GROUP,
    )


def topk_plan_costs(work: TopkWork, costs: TopkCosts, deterministic: bool, needs_grad: bool) -> dict[TopkPlan, float]:
    """The predicted time (ps) of each plan open to a call of ``work`` under ``costs``, the index
    walk first. The packed form is left out past :data:`TOPK_BITS_KEYS_PER_ENTRY` and, with a
    plane, past :data:`TOPK_PLANE_KEYS_PER_ENTRY` keys per list entry; with a plane both passes
    take one walk (the plane's gradient goes through the packed forward's graph)."""
    if deterministic:
        per_entry = costs.walk_backward_deterministic
    elif work.wide_group:
        per_entry = costs.walk_backward_random
    else:
        # Between overlapping and random selections, which shapes do not tell apart: their
        # geometric mean, the choice whose worse ratio to the best of the two is the smaller.
        per_entry = math.sqrt(costs.walk_backward_overlapping * costs.walk_backward_random)
    walk = (work.entries * costs.walk_forward, work.entries * per_entry * work.backward_growth**costs.walk_backward_growth)
    packed = (
        work.pairs * costs.packed_forward + work.plane * costs.plane_forward,
        work.pairs * (costs.packed_backward_deterministic if deterministic else costs.packed_backward)
        + work.plane * costs.plane_backward,
    )
    if not needs_grad:
        walk, packed = (walk[0], 0.0), (packed[0], 0.0)
    bits = work.bit_rows * (work.width * costs.bits_entry + work.seqlen_k * costs.bits_pair)
    keys_per_entry = work.seqlen_k / max(work.width, 1)
    fits = keys_per_entry <= TOPK_BITS_KEYS_PER_ENTRY and (work.plane == 0 or keys_per_entry <= TOPK_PLANE_KEYS_PER_ENTRY)
    options = {TopkPlan(TOPK_INDICES, TOPK_INDICES): walk[0] + walk[1]}
    if fits:
        options[TopkPlan(TOPK_PACKED, TOPK_PACKED)] = bits + packed[0] + packed[1]
    if fits and needs_grad and work.plane == 0:
        options[TopkPlan(TOPK_PACKED, TOPK_INDICES)] = bits + packed[0] + walk[1]
        options[TopkPlan(TOPK_INDICES, TOPK_PACKED)] = walk[0] + bits + packed[1]
    return options


# A plan every top-k call takes where it is open to the call (a split needs no bias plane), whatever
# its cost: for the tests, the sanitizer driver and the benchmark's side-by-side rows. None: the
# cost model chooses.
TOPK_FORCED_PLAN: TopkPlan | None = None


def topk_plan(
    batch: int, seqlen_q: int, seqlen_k: int, num_heads: int, num_kv_heads: int, head_dim: int, width: int,
    window: tuple[int, int], plane_heads: int, deterministic: bool, needs_grad: bool,
) -> TopkPlan:
    """The walk of each pass of a top-k call, from its shapes alone (no host synchronisation).

    The plan of least predicted time under :data:`TOPK_COSTS` (:func:`topk_plan_costs`; the index
    walk on a tie, as it needs no more memory). The index walk costs its entries; the packed mask
    costs the band's tiles (every one kept: an upper bound, as selections that cluster leave some
    empty), the BitMask's build (once, by the pass that walks it first) and a bias plane where
    one is needed (``plane_heads`` > 0). Where it costs least, the forward walks one and the
    backward the other, and the BitMask lives in that pass alone. A forward alone
    (``needs_grad`` False) is chosen by its own cost. :data:`TOPK_FORCED_PLAN` overrides.
    """
    forced = TOPK_FORCED_PLAN
    if forced is not None:
        return forced if forced.forward == forced.backward or plane_heads == 0 else TopkPlan(forced.forward, forced.forward)
    work = topk_work(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, width, window, plane_heads)
    options = topk_plan_costs(work, TOPK_COSTS, deterministic, needs_grad)
    return min(options, key=options.get)


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
