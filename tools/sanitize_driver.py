"""Run every flash-dma kernel once on small, odd shapes: the program that compute-sanitizer wraps.

Each case launches one group of kernels (forward and backward, decode over a KV cache, packed
sequences, or the summary builders) on lengths that are not multiples of the tiles, then
synchronises and checks its results: finite, and close to the same call on the CPU reference
(the summaries: equal to the CPU builders). Cases are small because the sanitizer runs kernels
10-100x slower. Each prints a begin and an end line, so that a sanitizer report in the combined
log can be attributed to the case that was running (``tools/sanitize.py`` does that).

    python tools/sanitize_driver.py --list
    python tools/sanitize_driver.py                                  # every default case
    python tools/sanitize_driver.py --case decode-paged-splits --case summary-key-list
    python tools/sanitize_driver.py --variants    # also name the Hopper variants each case launches
    TRITON_INTERPRET=1 python tools/sanitize_driver.py --device cpu --case attn-len1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import, as tests/conftest.py does

import triton
import triton.language as tl

import flash_dma.backends.triton as triton_backend
from flash_dma import (
    build_block_mask,
    causal_topk_intervals,
    flash_dma_func,
    flash_dma_topk_func,
    flash_dma_varlen_func,
    flash_dma_with_kvcache,
    pack_mask,
    topk_block_mask,
)
from flash_dma.backends.triton import backward as triton_backward
from flash_dma.backends.triton import dispatch
from flash_dma.backends.triton.topk import union
from flash_dma.backends.triton.block_summary import block_lists, block_state
from flash_dma.backends.triton.key_intervals import build_causal_topk_ends, build_interval_state
from flash_dma.backends.triton.dispatch import TOPK_INDICES, TOPK_PACKED, TopkPlan
from flash_dma.backends.triton.key_list import build_key_list
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.variants import VARIANTS
from flash_dma.inputs import DESCALES, FP8_DTYPE
from flash_dma.key_intervals import causal_topk_ends, interval_states
from tools import handoff_probe

MARK = "[sanitize-driver]"
# Largest error allowed against the float32 reference, relative to max(1, |reference|): loose,
# since the point is to catch garbage (a race, an out-of-bounds read), not to grade precision.
TOLERANCE = {torch.int32: 0.0, torch.bfloat16: 5e-2, torch.float16: 2e-2, torch.float32: 2e-3, FP8_DTYPE: 1e-1}
Results = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a case computes: the kernels on the device, or the reference backend on the CPU.

    The reference reads the same values as the kernels (rounded through ``storage``, the kernels'
    input dtype), in float32.
    """

    device: torch.device
    dtype: torch.dtype
    storage: torch.dtype
    backend: str

    @property
    def kernels(self) -> bool:
        return self.backend == "triton"

    def floats(self, t: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """A float input; ``fp32`` keeps float32 (biases may be float32 whatever the inputs)."""
        if fp32:
            return t.to(self.device, torch.float32)
        return t.to(self.device, self.storage).to(self.dtype)

    def ints(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)


def _generator(name: str) -> torch.Generator:
    # Inputs are drawn on the CPU, so that the kernels and the reference see the same values.
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _keep(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    """A bool mask: "random" keeps each element with probability 1/2; "blocks" makes 16x16 blocks
    empty, full or random; "rows" also drops every key of every fourth row (fully masked rows)."""
    keep = torch.rand(shape, generator=gen) < 0.5
    if kind == "blocks":
        nq, nk = -(-shape[2] // 16), -(-shape[3] // 16)
        fill = torch.randint(0, 3, (*shape[:2], nq, nk), generator=gen)
        fill = fill.repeat_interleave(16, 2).repeat_interleave(16, 3)[..., : shape[2], : shape[3]]
        keep = torch.where(fill == 0, False, torch.where(fill == 1, True, keep))
    elif kind == "rows":
        rows = torch.arange(shape[0] * shape[1] * shape[2]).view(*shape[:3], 1)
        keep = keep & (rows % 4 != 1)
    return keep


def _cumulative(target: Target, lengths: tuple[int, ...]) -> torch.Tensor:
    """``cu_seqlens`` of ``lengths``: int32 ``[0, l0, l0 + l1, ...]``."""
    return target.ints(torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32))


def _walk(listed: bool, query_chunks: int = 0, counted: bool = False) -> ExitStack:
    """Patches that make small problems take the kernels' large-problem paths.

    ``listed``: a mask alone is walked through a key list or a summary built in the call, not
    read element-wise (SMALL_PROBLEM). ``query_chunks``: the dK/dV kernel splits each key tile's
    queries into that many programs, which add their parts up (normally from 1024 queries);
    ``counted``: into at most that many, as the Hopper kernel counts its columns' work.
    """
    stack = ExitStack()
    if listed:
        stack.enter_context(mock.patch.object(triton_backend, "SMALL_PROBLEM", 0))
    if query_chunks:
        stack.enter_context(triton_backward.forced_query_chunks(query_chunks, counted))
    return stack


def _trainable(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The inputs that get gradients, made leaves that require them (absent ones stay None)."""
    return {name: None if t is None else t.requires_grad_() for name, t in tensors.items()}


def _gradients(
    out: torch.Tensor, leaves: dict[str, torch.Tensor | None], target: Target, gen: torch.Generator
) -> Results:
    """The gradients of ``out`` (from a random upstream gradient), named ``d<input>``."""
    out.backward(target.floats(torch.randn(out.shape, generator=gen)))
    return {f"d{name}": t.grad for name, t in leaves.items() if t is not None}


def _attention_leaves(target: Target, gen: torch.Generator, shape_q, shape_kv, bias_shape) -> dict:
    """Trainable ``query``, ``key``, ``value`` and ``attn_bias`` (None without ``bias_shape``), drawn in that order."""
    return _trainable({
        "query": target.floats(torch.randn(shape_q, generator=gen)),
        "key": target.floats(torch.randn(shape_kv, generator=gen)),
        "value": target.floats(torch.randn(shape_kv, generator=gen)),
        "attn_bias": target.floats(torch.randn(bias_shape, generator=gen)) if bias_shape else None,
    })


def _dims(case, spec: str) -> tuple[int, ...]:
    """A mask's or bias's shape from ``spec`` (``"B,Hkv,1,Sk"``-like) and ``case``'s sizes."""
    sizes = {"B": case.batch, "H": case.heads, "Hkv": case.kv_heads, "Sq": case.seqlen_q, "Sk": case.seqlen_k}
    return tuple(sizes.get(s, 1) for s in spec.split(","))  # "1" is a broadcast dimension


@dataclasses.dataclass(frozen=True)
class Attention:
    """``flash_dma_func`` forward and backward. Mask and bias shapes are written like ``"B,Hkv,1,Sk"``.

    ``walk``: "auto" (as the backend chooses: small problems read the mask on every tile),
    "listed" (key list or in-call summary, as large problems), "summary" (``build_block_mask``
    of ``block_size`` passed in), "packed" (the mask as a ``BitMask`` in blocks of
    ``block_size``), "topk" (``topk_block_mask`` per query block of the bias, no mask),
    "intervals" (``KeyIntervals`` of a causal top-k of random per-key scores, a quarter of the keys
    kept per query, ``mask`` ``"B,1,1,Sk"`` its key padding, in blocks of ``block_size``).
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    mask: str | None = None
    mask_kind: str = "random"
    bias: str | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0
    walk: str = "auto"
    block_size: tuple[int, int] = (16, 32)
    deterministic: bool = False
    query_chunks: int = 0
    counted: bool = False

    def run(self, target: Target, gen: torch.Generator) -> Results:
        shape_q = (self.batch, self.seqlen_q, self.heads, self.head_dim)
        shape_kv = (self.batch, self.seqlen_k, self.kv_heads, self.head_dim)
        leaves = _attention_leaves(target, gen, shape_q, shape_kv, _dims(self, self.bias) if self.bias else None)
        mask = target.ints(_keep(_dims(self, self.mask), self.mask_kind, gen)) if self.mask else None
        block_mask = None
        if self.walk == "summary":
            block_mask = build_block_mask(mask, block_size=self.block_size)
        elif self.walk == "packed":
            mask = pack_mask(mask, block_size=self.block_size)
        elif self.walk == "topk":
            block_mask = topk_block_mask(
                leaves["attn_bias"].detach(), self.seqlen_k // 4, block_size=self.block_size, query_len=self.seqlen_q,
                is_causal=self.causal, sink_blocks=1, local_blocks=1,
            )
        elif self.walk == "intervals":
            scores = target.floats(torch.randn(self.batch, self.kv_heads, self.seqlen_k, generator=gen))
            padding = None if mask is None else mask[:, 0, 0]
            mask = causal_topk_intervals(scores, self.seqlen_k // 4, padding, query_len=self.seqlen_q, block_size=self.block_size)
        with _walk(self.walk == "listed", self.query_chunks, self.counted):  # the backward too: query_chunks is the dK/dV launch's
            out, lse = flash_dma_func(
                **leaves, attn_mask=mask, is_causal=self.causal, window_size=self.window, softcap=self.softcap,
                block_mask=block_mask, deterministic=self.deterministic, return_lse=True, backend=target.backend,
            )
            return {"out": out, "lse": lse, **_gradients(out, leaves, target, gen)}


@dataclasses.dataclass(frozen=True)
class Fp8:
    """``flash_dma_func``'s FP8 forward: e4m3 inputs with descales per (batch, key/value head) drawn
    in [0.5, 2], a float32 bias; the reference dequantizes the same inputs. Mask and bias shapes as
    :class:`Attention`'s; ``walk`` "auto", "summary" (``build_block_mask`` of ``block_size``) or
    "packed" (the mask as a ``BitMask`` in blocks of ``block_size``)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = FP8_DTYPE
    mask: str | None = None
    bias: str | None = None
    causal: bool = False
    walk: str = "auto"
    block_size: tuple[int, int] = (128, 128)

    def run(self, target: Target, gen: torch.Generator) -> Results:
        shape_q = (self.batch, self.seqlen_q, self.heads, self.head_dim)
        shape_kv = (self.batch, self.seqlen_k, self.kv_heads, self.head_dim)
        q, k, v = (torch.randn(shape, generator=gen).to(target.device, FP8_DTYPE) for shape in (shape_q, shape_kv, shape_kv))
        descales = {name: target.floats(0.5 + 1.5 * torch.rand(self.batch, self.kv_heads, generator=gen), fp32=True) for name in DESCALES}
        bias = target.floats(torch.randn(_dims(self, self.bias), generator=gen), fp32=True) if self.bias else None
        mask = target.ints(_keep(_dims(self, self.mask), "blocks", gen)) if self.mask else None
        block_mask = build_block_mask(mask, block_size=self.block_size) if self.walk == "summary" else None
        if self.walk == "packed":
            mask = pack_mask(mask, block_size=self.block_size)
        out, lse = flash_dma_func(
            q, k, v, mask, bias, is_causal=self.causal, block_mask=block_mask, return_lse=True, backend=target.backend, **descales,
        )
        return {"out": out, "lse": lse}


@dataclasses.dataclass(frozen=True)
class Topk:
    """``flash_dma_topk_func`` forward and backward: ``width`` keys listed per query and key/value
    head, drawn among the first ``hot`` keys (0: all), with -1 entries, entries past the keys and
    repeats. ``bias``: per pair ``"B,Sq,H,W"``-like, per key ``"B,Hkv,Sk"``-like, or None.
    ``walk``: "indices" (the index kernels, the backward split between the union and per-query
    walks by the default share), "union" or "per-query" (every query block's backward on one of
    them), or "packed" (the packed per-query mask), whatever the share of the keys the lists hold. ``deterministic``: dK/dV key-outer over the sorted inverse
    map, not added by atomics in the dQ walk."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    width: int
    dtype: torch.dtype = torch.bfloat16
    bias: str | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0
    hot: int = 0
    walk: str = "indices"
    deterministic: bool = False

    def run(self, target: Target, gen: torch.Generator) -> Results:
        sizes = {"B": self.batch, "H": self.heads, "Hkv": self.kv_heads, "Sq": self.seqlen_q, "Sk": self.seqlen_k, "W": self.width}
        shape = (self.batch, self.seqlen_q, self.kv_heads, self.width)
        indices = torch.randint(-1, (self.hot or self.seqlen_k) + 3, shape, generator=gen)
        indices = torch.where(torch.rand(shape, generator=gen) < 0.2, indices.roll(1, dims=-1), indices)
        leaves = _attention_leaves(
            target, gen, (self.batch, self.seqlen_q, self.heads, self.head_dim),
            (self.batch, self.seqlen_k, self.kv_heads, self.head_dim),
            tuple(sizes.get(s, 1) for s in self.bias.split(",")) if self.bias else None,
        )
        passes, share = {
            "indices": (TOPK_INDICES, union.UNION_SHARE), "union": (TOPK_INDICES, 1.0), "per-query": (TOPK_INDICES, -1.0),
            "packed": (TOPK_PACKED, union.UNION_SHARE),
        }[self.walk]
        with (
            mock.patch.object(dispatch, "TOPK_FORCED_PLAN", TopkPlan(passes, passes)),
            mock.patch.object(union, "UNION_SHARE", share),
        ):
            out, lse = flash_dma_topk_func(
                **leaves, indices=target.ints(indices.to(torch.int32)), is_causal=self.causal, window_size=self.window,
                softcap=self.softcap, deterministic=self.deterministic, return_lse=True, backend=target.backend,
            )
            return {"out": out, "lse": lse, **_gradients(out, leaves, target, gen)}


@dataclasses.dataclass(frozen=True)
class Varlen:
    """``flash_dma_varlen_func`` forward and backward over packed sequences.

    Mask and bias are per key with ``kv_heads`` heads: "packed" ``[Hkv, total_k]`` or "sequence"
    ``[N, Hkv, max_seqlen_k]``. ``walk`` as for :class:`Attention`, the summaries per sequence in
    blocks of ``block_size`` (128 x 128: the Hopper kernels' tiles divide them).
    """

    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    mask: str | None = None
    bias: str | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0
    walk: str = "auto"
    block_size: tuple[int, int] = (16, 16)

    def _per_key(self, form: str) -> tuple[int, ...]:
        if form == "packed":
            return self.kv_heads, sum(self.lens_k)
        return len(self.lens_k), self.kv_heads, max(self.lens_k)

    def run(self, target: Target, gen: torch.Generator) -> Results:
        total_q, total_k = sum(self.lens_q), sum(self.lens_k)
        leaves = _trainable({
            "q": target.floats(torch.randn(total_q, self.heads, self.head_dim, generator=gen)),
            "k": target.floats(torch.randn(total_k, self.kv_heads, self.head_dim, generator=gen)),
            "v": target.floats(torch.randn(total_k, self.kv_heads, self.head_dim, generator=gen)),
            "attn_bias": target.floats(torch.randn(self._per_key(self.bias), generator=gen)) if self.bias else None,
        })
        mask = target.ints(torch.rand(self._per_key(self.mask), generator=gen) < 0.6) if self.mask else None
        cu_q, cu_k = (_cumulative(target, lens) for lens in (self.lens_q, self.lens_k))
        sequences = {"cu_seqlens_k": cu_k, "max_seqlen_k": max(self.lens_k), "block_size": self.block_size}
        block_mask = None
        if self.walk == "summary":
            block_mask = build_block_mask(mask, **sequences)
        elif self.walk == "topk":
            block_mask = topk_block_mask(leaves["attn_bias"].detach(), 24, mask, **sequences)
        with _walk(self.walk == "listed"):
            out, lse = flash_dma_varlen_func(
                leaves["q"], leaves["k"], leaves["v"], cu_q, cu_k, max(self.lens_q), max(self.lens_k), mask,
                leaves["attn_bias"], is_causal=self.causal, window_size=self.window, softcap=self.softcap,
                block_mask=block_mask, return_lse=True, backend=target.backend,
            )
            return {"out": out, "lse": lse, **_gradients(out, leaves, target, gen)}


@dataclasses.dataclass(frozen=True)
class Decode:
    """``flash_dma_with_kvcache``: appends ``new`` keys to entries holding ``cached`` keys, then attends.

    ``page_size`` 0 is a contiguous cache (``rows``: entries read shuffled cache rows through
    ``cache_batch_idx``); otherwise a pool of pages in shuffled order, with spare pages never used.
    ``mask``: a per-key mask in which every fourth (entry, kv head) keeps no key. ``bias_heads``:
    the per-key bias's heads (0: no bias). ``num_splits`` > 1 forces split-KV and the combine
    kernel; 0 lets the backend choose. ``listed``: the mask is walked through a key list.
    """

    batch: int
    seqlen_q: int
    new: int
    cached: tuple[int, ...]
    capacity: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 0
    rows: bool = False
    mask: bool = True
    bias_heads: int = 0
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    num_splits: int = 0
    listed: bool = False

    def run(self, target: Target, gen: torch.Generator) -> Results:
        hkv, d = self.kv_heads, self.head_dim
        layout = {}
        if self.page_size:
            pages_per_entry = -(-self.capacity // self.page_size)
            num_pages = self.batch * pages_per_entry + 2
            slots = (num_pages, self.page_size)
            table = torch.randperm(num_pages, generator=gen)[: self.batch * pages_per_entry].view(self.batch, -1)
            layout["block_table"] = target.ints(table.to(torch.int32))
            capacity = pages_per_entry * self.page_size
        else:
            slots = (self.batch + 1 if self.rows else self.batch, self.capacity)
            if self.rows:
                rows = torch.randperm(self.batch + 1, generator=gen)[: self.batch]
                layout["cache_batch_idx"] = target.ints(rows.to(torch.int32))
            capacity = self.capacity
        caches = {
            "k_cache": target.floats(torch.randn(*slots, hkv, d, generator=gen)),
            "v_cache": target.floats(torch.randn(*slots, hkv, d, generator=gen)),
        }
        new = {
            "k": target.floats(torch.randn(self.batch, self.new, hkv, d, generator=gen)),
            "v": target.floats(torch.randn(self.batch, self.new, hkv, d, generator=gen)),
        }
        if self.bias_heads:  # float32, stored with the keys
            caches["bias_cache"] = target.floats(torch.randn(*slots, self.bias_heads, generator=gen), fp32=True)
            new["bias"] = target.floats(torch.randn(self.batch, self.new, self.bias_heads, generator=gen), fp32=True)
        q = target.floats(torch.randn(self.batch, self.seqlen_q, self.heads, d, generator=gen))
        mask = target.ints(_keep((self.batch, hkv, 1, capacity), "rows", gen)) if self.mask else None
        with _walk(self.listed):
            out, lse = flash_dma_with_kvcache(
                q, **caches, **new, **layout, cache_seqlens=target.ints(torch.tensor(self.cached, dtype=torch.int32)),
                attn_mask=mask, is_causal=self.causal, window_size=self.window, num_splits=self.num_splits,
                return_lse=True, backend=target.backend,
            )
        # The caches after the call: the new keys appended, nothing else changed (spare pages included).
        return {"out": out, "lse": lse, **caches}


def summary_block_state(target: Target, gen: torch.Generator) -> Results:
    """The block summary kernels (states, then the lists and their transpose) against the CPU builder,
    on masks with ragged edges, a per-key mask, a 1x1 mask and an integer mask broadcast through zero strides."""
    masks = [
        (target.ints(_keep((2, 4, 129, 257), "blocks", gen)), (16, 32)),
        (target.ints(_keep((2, 4, 129, 257), "rows", gen)), (128, 128)),
        (target.ints(_keep((2, 2, 1, 257), "blocks", gen)), (16, 16)),
        (target.ints(_keep((1, 1, 1, 1), "random", gen)), (16, 16)),
        (target.ints(_keep((1, 4, 17, 129), "rows", gen)).to(torch.int32).expand(3, 4, 17, 129), (32, 64)),
    ]
    results = {}
    for i, (mask, block_size) in enumerate(masks):
        if target.kernels:
            state = block_state(mask, *block_size)
            kv_lists, q_lists = block_lists(state, False), block_lists(state, True)
        else:
            summary = build_block_mask(mask, block_size=block_size)
            state, kv_lists, q_lists = summary.state, summary.kv_lists, summary.q_lists
        results.update({f"state{i}": state, f"kv_lists{i}": kv_lists, f"q_lists{i}": q_lists})
    return results


def summary_intervals(target: Target, gen: torch.Generator) -> Results:
    """The key-interval kernels (block states of runs of rows, with and without start rows, and a
    causal top-k's end rows over padded keys with ties) against the plain-torch builders on the
    CPU, on ragged lengths, 600 rows and one key."""
    results = {}
    for i, (batch, heads, query_len, key_len, block_size) in enumerate(
        [(2, 3, 129, 257, (16, 32)), (1, 2, 600, 70, (128, 128)), (2, 1, 17, 1, (32, 64))]
    ):
        start = torch.randint(-2, query_len + 2, (batch, heads, key_len), generator=gen, dtype=torch.int32)
        end = start + torch.randint(-2, query_len + 2, (batch, heads, key_len), generator=gen, dtype=torch.int32)
        start, end = target.ints(start), target.ints(end)
        for name, begin in (("", start), ("-from0", None)):
            if target.kernels:
                results[f"state{i}{name}"] = build_interval_state(begin, end, query_len, *block_size)
            else:
                results[f"state{i}{name}"] = interval_states(begin, end, query_len, block_size)
    scores = target.floats(torch.randint(0, 5, (2, 2, 300), generator=gen).float(), fp32=True)
    padding = target.ints(torch.rand(2, 1, 300, generator=gen) < 0.8).expand(2, 2, 300)
    for query_len, keep in ((300, 40), (129, 7)):
        build = build_causal_topk_ends if target.kernels else causal_topk_ends
        results[f"ends{query_len}"] = build(scores, padding, keep, query_len)
    return results


def summary_topk(target: Target, gen: torch.Generator) -> Results:
    """``topk_block_mask`` per key with a padding mask (on CUDA: the block top-k kernel), per query
    block under causal attention, and per packed sequence (the kernel again); the lists come from
    the block-lists kernel."""
    bias = target.floats(torch.randn(2, 2, 1, 300, generator=gen), fp32=True)
    padding = target.ints(torch.arange(300)[None, :] < torch.tensor([[300], [131]]))
    lens = (70, 1, 129)
    packed = target.floats(torch.randn(2, sum(lens), generator=gen), fp32=True)
    cu_k = _cumulative(target, lens)
    summaries = [
        topk_block_mask(bias, 64, padding, block_size=(16, 32), sink_blocks=1),
        topk_block_mask(bias, 64, block_size=(32, 16), query_len=257, is_causal=True, local_blocks=2),
        topk_block_mask(packed, 24, block_size=(16, 16), cu_seqlens_k=cu_k, max_seqlen_k=max(lens)),
    ]
    parts = ("state", "kv_lists", "q_lists")
    return {f"{part}{i}": getattr(summary, part) for i, summary in enumerate(summaries) for part in parts}


def summary_key_list(target: Target, gen: torch.Generator) -> Results:
    """The key-list kernels (kept counts per chunk, then the list) on one key, on ragged lengths, on
    2500 keys (three chunks) and on an integer mask broadcast over the batch."""
    masks = [
        target.ints(torch.rand(1, 1, 1, 1, generator=gen) < 0.5),
        target.ints(torch.rand(2, 3, 1, 17, generator=gen) < 0.3),
        target.ints(torch.rand(2, 1, 1, 2500, generator=gen) < 0.1),
        target.ints(torch.rand(1, 2, 1, 257, generator=gen) < 0.5).to(torch.int32).expand(3, 2, 1, 257),
    ]
    results = {}
    for i, mask in enumerate(masks):
        seqlen_k = mask.shape[-1]
        if target.kernels:
            key_list = build_key_list(mask, seqlen_k)
            order, rank = key_list[:, :, 0, :seqlen_k], key_list[:, :, 1]  # the order's last slot is never written
        else:
            # Kept positions in ascending order, then the dropped ones in descending order; and the ranks.
            keep = (mask[:, :, 0] != 0).long()
            positions = torch.arange(seqlen_k).expand_as(keep)
            order = torch.where(keep.bool(), positions, 2 * seqlen_k - positions).sort(-1).values
            order = torch.where(order >= seqlen_k, 2 * seqlen_k - order, order).int()
            rank = torch.nn.functional.pad(keep.cumsum(-1), (1, 0)).int()
        results.update({f"order{i}": order, f"rank{i}": rank})
    return results


@triton.jit
def _sanitizer_canary_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs <= n), mask=offs < n)  # reads X[n], one past the end


def canary_out_of_bounds(target: Target, gen: torch.Generator) -> Results:
    """Reads one element past a tensor of 20 floats. memcheck must report it: proof that the sanitizer
    sees Triton kernels and that allocations are exact (PYTORCH_NO_CUDA_MEMORY_CACHING=1)."""
    x = target.floats(torch.randn(20, generator=gen), fp32=True)
    y = torch.empty_like(x)
    _sanitizer_canary_kernel[(1,)](x, y, x.numel(), BLOCK=32)
    return {"y": y}


def _handoff(synced: bool) -> Callable[[Target, torch.Generator], Results]:
    def run(target: Target, gen: torch.Generator) -> Results:
        rounds = 200
        if not target.kernels:
            return {"out": handoff_probe.expected(rounds)}
        if target.device.type != "cuda" or torch.cuda.get_device_capability(target.device)[0] != 9:
            raise RuntimeError(f"the hand-over probe is a Hopper (sm90) kernel; the device is {target.device}")
        return {"out": handoff_probe.handoff(rounds, synced)}

    lanes = "after its lanes meet at a barrier" if synced else "with no barrier of its lanes before (the control)"
    run.__doc__ = f"The hand-over probe (tools/handoff_probe.py): a loader warp's stores handed over by one lane's arrive, {lanes}."
    return run


@dataclasses.dataclass(frozen=True)
class Case:
    """One named run of a group of kernels.

    ``run(target, generator)`` returns named results; the kernels' results must match the
    reference's (``reference=False``: only be finite). ``default``: part of a run that names no case.
    """

    name: str
    run: Callable[[Target, torch.Generator], Results]
    dtype: torch.dtype = torch.bfloat16
    reference: bool = True
    default: bool = True

    @property
    def description(self) -> str:
        """The spec's fields that differ from their defaults, or the first paragraph of the function's docstring."""
        spec = getattr(self.run, "__self__", None)
        if spec is None:
            return " ".join(self.run.__doc__.split("\n\n")[0].split())
        fields = [
            f"{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec)
            if f.default is dataclasses.MISSING or getattr(spec, f.name) != f.default
        ]
        return f"{type(spec).__name__}({', '.join(fields)})"


def _attention(name: str, **spec) -> Case:
    attention = Attention(**spec)
    return Case(name, attention.run, attention.dtype)


def _fp8(name: str, **spec) -> Case:
    fp8 = Fp8(**spec)
    return Case(name, fp8.run, fp8.dtype)


def _varlen(name: str, **spec) -> Case:
    varlen = Varlen(**spec)
    return Case(name, varlen.run, varlen.dtype)


def _topk(name: str, **spec) -> Case:
    topk = Topk(**spec)
    return Case(name, topk.run, topk.dtype)


def _decode(name: str, **spec) -> Case:
    decode = Decode(**spec)
    return Case(name, decode.run, decode.dtype)


CASES = {
    case.name: case
    for case in [
        # flash_dma_func: forward, dQ, dK/dV and preprocess kernels, on every walk.
        _attention("attn-dense-d72-causal", batch=2, seqlen_q=129, seqlen_k=257, heads=4, kv_heads=2, head_dim=72,
                   bias="B,H,Sq,Sk", causal=True),
        _attention("attn-mask-d64-window-rows", batch=2, seqlen_q=257, seqlen_k=129, heads=4, kv_heads=1, head_dim=64,
                   mask="B,1,Sq,Sk", mask_kind="rows", bias="1,Hkv,Sq,Sk", window=(32, 8)),
        _attention("attn-summary-d256-softcap", batch=1, seqlen_q=129, seqlen_k=257, heads=4, kv_heads=2,
                   head_dim=256, mask="B,H,Sq,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", softcap=5.0, walk="listed"),
        _attention("attn-keys-d128-deterministic", batch=2, seqlen_q=17, seqlen_k=257, heads=4, kv_heads=1,
                   head_dim=128, mask="B,Hkv,1,Sk", mask_kind="rows", bias="1,1,1,Sk", causal=True, walk="listed",
                   deterministic=True),
        _attention("attn-keys-d64-pair-bias-chunks", batch=2, seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=64,
                   mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True, walk="listed", query_chunks=3),
        # A key list's chunk sums (its kept slots' rows alone zeroed and read) and a per-key bias gradient the chunks add to.
        *[
            _attention(f"attn-keys-d128-key-bias-chunks{suffix}", batch=2, seqlen_q=300, seqlen_k=700, heads=4, kv_heads=2,
                       head_dim=128, mask="B,Hkv,1,Sk", bias="B,H,1,Sk", causal=True, walk="listed", query_chunks=3,
                       deterministic=deterministic)
            for suffix, deterministic in (("", False), ("-deterministic", True))
        ],
        _attention("attn-blockmask-d64-window", batch=2, seqlen_q=129, seqlen_k=129, heads=4, kv_heads=2, head_dim=64,
                   mask="1,1,Sq,Sk", mask_kind="blocks", bias="B,H,Sq,1", window=(40, 40), walk="summary"),
        # BitMasks: the Hopper kernels read the words (and a D = 64 per-pair bias) staged by TMA.
        _attention("attn-bits-d64-pair-bias", batch=1, seqlen_q=300, seqlen_k=256, heads=2, kv_heads=1, head_dim=64,
                   mask="1,1,Sq,Sk", bias="1,1,Sq,Sk", causal=True, walk="packed", block_size=(128, 128)),
        _attention("attn-bits-d128-rows-bias", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=128,
                   mask="B,Hkv,Sq,Sk", mask_kind="blocks", bias="B,H,Sq,1", window=(64, 8), walk="packed",
                   block_size=(128, 128)),
        _attention("attn-topk-d64-causal", batch=2, seqlen_q=257, seqlen_k=257, heads=4, kv_heads=2, head_dim=64,
                   bias="B,Hkv,1,Sk", causal=True, walk="topk", block_size=(32, 32)),
        # KeyIntervals (Doge's selection): each key's rows tested on PARTIAL tiles, by the Hopper
        # kernels at D = 64, 128 and 256; queries after cached keys, padded keys.
        _attention("attn-intervals-d64-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=64,
                   bias="B,Hkv,1,Sk", causal=True, walk="intervals", block_size=(128, 128)),
        _attention("attn-intervals-d128-padded", batch=2, seqlen_q=129, seqlen_k=300, heads=8, kv_heads=2, head_dim=128,
                   mask="B,1,1,Sk", bias="B,H,1,Sk", causal=True, walk="intervals", block_size=(64, 32)),
        _attention("attn-intervals-d128-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=128,
                   bias="B,Hkv,1,Sk", causal=True, walk="intervals", block_size=(128, 128)),
        _attention("attn-intervals-d256-causal", batch=1, seqlen_q=257, seqlen_k=300, heads=2, kv_heads=1, head_dim=256,
                   bias="B,Hkv,1,Sk", causal=True, walk="intervals", block_size=(128, 128)),
        _attention("attn-sq1-gqa-d128", batch=2, seqlen_q=1, seqlen_k=257, heads=4, kv_heads=1, head_dim=128,
                   mask="B,Hkv,1,Sk", bias="B,H,1,Sk", causal=True, walk="listed"),
        _attention("attn-len1", batch=3, seqlen_q=1, seqlen_k=1, heads=4, kv_heads=4, head_dim=64,
                   mask="B,H,Sq,Sk", mask_kind="rows", bias="B,H,Sq,Sk"),
        _attention("attn-fp32-d72-causal-short-keys", batch=1, seqlen_q=33, seqlen_k=17, heads=2, kv_heads=2,
                   head_dim=72, dtype=torch.float32, bias="1,1,Sq,Sk", causal=True, deterministic=True),
        _attention("attn-fp16-d64-window-softcap", batch=2, seqlen_q=129, seqlen_k=129, heads=4, kv_heads=4,
                   head_dim=64, dtype=torch.float16, mask="1,H,1,Sk", window=(16, 16), softcap=10.0, walk="listed"),
        # The Hopper kernels on a per-key summary walk (key scores staged by the loader), and with
        # softcap: forward, dQ and dK/dV through the cap's slope.
        _attention("attn-summary-d128-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=128, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 128)),
        _attention("attn-summary-d128-softcap-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=128, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", causal=True, softcap=5.0,
                   walk="summary", block_size=(128, 128)),
        # Summary blocks of 64 keys: the Hopper dQ in its tiles of 64 keys (``hopper/dq.SMALL_TILE``).
        _attention("attn-summary-d128-64-key-blocks", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=128, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 64)),
        # A head dim of 96 on Hopper: tiles of 128 columns, the copies filling the last 32 with zeros.
        _attention("attn-summary-d96-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=96, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 128)),
        # A head dim of 256: the Hopper forward in tiles of 64 keys with one Q slot, the Hopper dQ (one Q/dO
        # slot, K/V tiles of 32 keys) and dK/dV (items of 64 keys, dK and dV in a warpgroup each).
        _attention("attn-summary-d256-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=256, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 128)),
        # D = 192: the D = 256 kernels with their last 64 columns zero-filled (dK/dV in slices).
        _attention("attn-summary-d192-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=192, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 128)),
        # A per-pair bias alone with softcap at D = 192 and 256 (every tile computed, the bias's
        # gradient per pair), a per-row mask and bias at D = 128, and D = 32 (D = 64's rings).
        _attention("attn-pair-bias-d192-softcap", batch=1, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=192, bias="1,H,Sq,Sk", causal=True, softcap=5.0),
        _attention("attn-pair-bias-d256-softcap", batch=1, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=256, bias="1,Hkv,Sq,Sk", causal=True, softcap=5.0),
        _attention("attn-rows-d128-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=128,
                   mask="B,Hkv,Sq,1", bias="1,H,Sq,1", causal=True),
        # A 16-bit per-key bias the Hopper forward's tensor cores add (``adds_key_bias_by_mma``): on the
        # dense walk, in tiles of 128 and 256 columns, and on a key list's (its dropped keys' -inf in the operand).
        _attention("attn-dense-d128-key-bias-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=128,
                   bias="1,Hkv,1,Sk", causal=True),
        _attention("attn-dense-d192-key-bias", batch=2, seqlen_q=129, seqlen_k=300, heads=4, kv_heads=2, head_dim=192,
                   bias="B,H,1,Sk"),
        _attention("attn-keys-d128-key-bias-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=128,
                   mask="B,Hkv,1,Sk", bias="1,Hkv,1,Sk", causal=True, walk="listed"),
        _attention("attn-dense-d32-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=32,
                   bias="B,H,1,1", causal=True),
        _attention("attn-dense-d64-window", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=64,
                   bias="1,Hkv,1,1", window=(100, 20)),
        # D = 192's query chunks in slices of their own (deterministic), as D = 128's below.
        _attention("attn-summary-d192-deterministic-chunks", batch=1, seqlen_q=600, seqlen_k=600, heads=4, kv_heads=2,
                   head_dim=192, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="1,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 128), deterministic=True, query_chunks=3),
        # A per-pair bias the batch shares: its gradient added by atomics, from BitMask tiles at
        # D = 128 and from a key list's at D = 64.
        _attention("attn-bits-d128-shared-pair-bias", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2,
                   head_dim=128, mask="B,Hkv,Sq,Sk", mask_kind="blocks", bias="1,Hkv,Sq,Sk", causal=True, walk="packed",
                   block_size=(128, 128)),
        _attention("attn-keys-d64-shared-pair-bias", batch=2, seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2,
                   head_dim=64, mask="B,Hkv,1,Sk", bias="1,Hkv,Sq,Sk", causal=True, walk="listed"),
        # Deterministic on Hopper: dK/dV's query chunks wait for their turns (a per-key bias the batch shares).
        _attention("attn-summary-d128-deterministic-chunks", batch=2, seqlen_q=600, seqlen_k=600, heads=4, kv_heads=2,
                   head_dim=128, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="1,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 128), deterministic=True, query_chunks=3),
        # The Hopper dK/dV's chunks as its columns' work wants (``count_columns`` counts it in the preprocess), up to 4.
        _attention("attn-summary-d128-counted-chunks", batch=2, seqlen_q=600, seqlen_k=600, heads=4, kv_heads=2,
                   head_dim=128, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="B,Hkv,1,Sk", causal=True,
                   walk="summary", block_size=(128, 128), query_chunks=4, counted=True),
        # FP8 inputs: the Hopper forward (V copied transposed, P rounded to e4m3), D = 64 and 256.
        _fp8("fp8-summary-d64-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=64,
             mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True, walk="summary"),
        _fp8("fp8-dense-d256", batch=1, seqlen_q=130, seqlen_k=199, heads=4, kv_heads=1, head_dim=256, bias="1,H,1,Sk"),
        _fp8("fp8-summary-d128-causal", batch=2, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=128,
             mask="B,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True, walk="summary"),
        _fp8("fp8-summary-d256-causal", batch=1, seqlen_q=257, seqlen_k=300, heads=4, kv_heads=2, head_dim=256,
             mask="B,Hkv,1,Sk", bias="1,Hkv,1,Sk", causal=True, walk="summary"),
        _fp8("fp8-bits-d64-pair-bias", batch=1, seqlen_q=300, seqlen_k=256, heads=2, kv_heads=1, head_dim=64,
             mask="1,1,Sq,Sk", bias="1,1,Sq,Sk", causal=True, walk="packed"),
        _attention("attn-query-chunks", batch=1, seqlen_q=90, seqlen_k=70, heads=4, kv_heads=2, head_dim=64,
                   mask="B,Hkv,1,Sk", mask_kind="blocks", bias="1,1,1,Sk", causal=True, walk="summary",
                   block_size=(16, 16), query_chunks=2),
        # flash_dma_topk_func: the gathering forward, and dQ with dK/dV added by atomics.
        _topk("topk-gqa-d128-pairs-causal", batch=2, seqlen_q=129, seqlen_k=257, heads=8, kv_heads=2, head_dim=128,
              width=64, bias="B,Sq,H,W", causal=True),
        _topk("topk-mqa-d64-keys-window-hot", batch=1, seqlen_q=257, seqlen_k=129, heads=4, kv_heads=1, head_dim=64,
              width=33, bias="1,1,Sk", window=(32, 8), softcap=5.0, hot=8),
        _topk("topk-len1-d72", batch=3, seqlen_q=1, seqlen_k=1, heads=2, kv_heads=2, head_dim=72, width=5,
              bias="B,Sq,1,W"),
        # The backward over each query block's union of keys (dK/dV by atomics, from 64-row tiles),
        # every block, and a call split between it and the per-query walk (hot keys: small unions).
        _topk("topk-union-gqa-d128-keys-causal", batch=2, seqlen_q=129, seqlen_k=257, heads=8, kv_heads=2, head_dim=128,
              width=48, bias="B,Hkv,Sk", causal=True, walk="union"),
        _topk("topk-split-gqa8-d64-heads-window-hot", batch=1, seqlen_q=200, seqlen_k=300, heads=16, kv_heads=2, head_dim=64,
              width=24, bias="1,H,Sk", window=(100, 0), softcap=5.0, hot=20),
        # deterministic: dK/dV key-outer over the sorted inverse map (the others add them by atomics).
        _topk("topk-gqa-d64-keys-deterministic-hot", batch=2, seqlen_q=129, seqlen_k=257, heads=8, kv_heads=2, head_dim=64,
              width=40, bias="B,H,Sk", causal=True, hot=16, deterministic=True),
        # ... and a short call as it runs: the packed per-query mask of its entries, with its bias plane.
        _topk("topk-packed-gqa-pairs-causal", batch=2, seqlen_q=129, seqlen_k=200, heads=8, kv_heads=2, head_dim=64,
              width=64, bias="1,Sq,Hkv,W", causal=True, hot=40, walk="packed"),
        # flash_dma_with_kvcache: the forward kernel over cached entries, split-KV and the combine kernel.
        _decode("decode-contiguous-splits", batch=3, seqlen_q=1, new=1, cached=(5, 0, 300), capacity=320, heads=4,
                kv_heads=1, head_dim=128, rows=True, bias_heads=1, num_splits=3),
        _decode("decode-paged-splits", batch=3, seqlen_q=3, new=3, cached=(200, 7, 250), capacity=257, heads=8,
                kv_heads=2, head_dim=64, page_size=16, bias_heads=8, window=(64, 0), num_splits=4, listed=True),
        _decode("decode-paged-d256-auto-splits", batch=2, seqlen_q=1, new=1, cached=(1100, 17), capacity=1280, heads=4,
                kv_heads=2, head_dim=256, page_size=256, mask=False, bias_heads=2, causal=False),
        # 16K keys and D = 128: on a Hopper the tiles are copied whole from the pool of pages (TMA).
        _decode("decode-paged-tma-d128", batch=2, seqlen_q=1, new=1, cached=(16500, 300), capacity=16640, heads=8,
                kv_heads=2, head_dim=128, page_size=128, mask=False, bias_heads=2, num_splits=4),
        # A chunk of prefill over a contiguous cache (entries of other lengths, one empty): the Hopper
        # forward's cache path once routed.
        _decode("cache-prefill-contiguous-listed", batch=3, seqlen_q=130, new=130, cached=(300, 0, 900), capacity=1100,
                heads=4, kv_heads=2, head_dim=64, bias_heads=2, listed=True),
        # The same through cache_batch_idx and through pages of whole key tiles (the Hopper forward's
        # indexed cache), the tiles past each entry's keys read and zeroed.
        _decode("cache-prefill-rows", batch=3, seqlen_q=130, new=130, cached=(300, 0, 900), capacity=1100,
                heads=4, kv_heads=2, head_dim=64, rows=True, bias_heads=2, num_splits=1),
        _decode("cache-prefill-listed-d128", batch=3, seqlen_q=130, new=130, cached=(300, 0, 900), capacity=1100,
                heads=4, kv_heads=2, head_dim=128, bias_heads=2, listed=True, num_splits=1),
        _decode("cache-prefill-rows-d128", batch=3, seqlen_q=130, new=130, cached=(300, 0, 900), capacity=1100,
                heads=4, kv_heads=2, head_dim=128, rows=True, bias_heads=2, num_splits=1),
        _decode("cache-prefill-pages-d128", batch=3, seqlen_q=129, new=129, cached=(300, 0, 700), capacity=1024,
                heads=4, kv_heads=2, head_dim=128, page_size=256, bias_heads=4, num_splits=1),
        # flash_dma_varlen_func: packed sequences (one empty, one of length 1), forward and backward.
        _varlen("varlen-keys-causal", lens_q=(5, 0, 33, 1, 17), lens_k=(9, 3, 33, 1, 129), heads=4, kv_heads=2,
                head_dim=64, mask="packed", bias="packed", causal=True, walk="listed"),
        _varlen("varlen-summary-d72-window-softcap", lens_q=(17, 1, 40), lens_k=(33, 70, 1), heads=4, kv_heads=2,
                head_dim=72, mask="sequence", bias="packed", window=(6, 2), softcap=4.0, walk="summary"),
        # A sequence without queries and one without keys, all keys in one summary block: then the
        # kernels size the walk by the entry's own length, 0 (tiles_per_block = cdiv(0, BLOCK)).
        _varlen("varlen-empty-entries-summary", lens_q=(5, 0, 9, 1), lens_k=(7, 12, 0, 16), heads=4, kv_heads=2,
                head_dim=40, mask="sequence", bias="packed", walk="summary"),
        _varlen("varlen-topk-gqa3", lens_q=(40, 1, 70), lens_k=(40, 129, 70), heads=3, kv_heads=1, head_dim=64,
                bias="sequence", causal=True, walk="topk"),
        # Sequences of several 128-row blocks, summaries of 128 x 128 blocks: the Hopper kernels'
        # packed path once routed (a sequence's last rows, followed by the next's, stored from registers).
        _varlen("varlen-summary-d128-long", lens_q=(300, 0, 129, 513), lens_k=(300, 5, 129, 513), heads=4, kv_heads=2,
                head_dim=128, mask="sequence", bias="packed", causal=True, walk="summary", block_size=(128, 128)),
        # The builders of walks: block summaries and key lists.
        Case("summary-block-state", summary_block_state),
        Case("summary-topk", summary_topk),
        Case("summary-intervals", summary_intervals),
        Case("summary-key-list", summary_key_list),
        Case("canary-oob", canary_out_of_bounds, torch.float32, reference=False, default=False),
        # What racecheck reports on the Hopper kernels' hand-over of shared memory, alone (Hopper only).
        Case("handoff-synced", _handoff(True), torch.int32, default=False),
        Case("handoff-unsynced", _handoff(False), torch.int32, default=False),
    ]
}


def _problems(actual: Results, expected: Results | None, tolerance: float) -> list[str]:
    """What is wrong with a case's results: non-finite values, and differences from the reference."""
    problems = []
    for key, t in actual.items():
        t = t.detach()
        if t.is_floating_point():
            # An LSE is -inf for a row that sees no key; nothing else may be infinite, and nothing NaN.
            bad = t.isnan() | (t == float("inf"))
            if key != "lse":
                bad |= t == float("-inf")
            if bad.any():
                problems.append(f"{key}: {int(bad.sum())} non-finite values")
                continue
        if expected is None:
            continue
        want = expected[key].detach()
        if not t.is_floating_point():
            if not torch.equal(t.cpu(), want.cpu()):
                problems.append(f"{key}: differs from the CPU builder in {int((t.cpu() != want.cpu()).sum())} places")
            continue
        got, want = t.double().cpu(), want.double().cpu()
        error = torch.where(got == want, 0.0, got - want).abs().max().item() if got.numel() else 0.0
        scale = max(1.0, want[want.isfinite()].abs().max().item() if want.isfinite().any() else 0.0)
        if not error <= tolerance * scale:
            problems.append(f"{key}: max error {error:.3g} > {tolerance:g} x {scale:.3g} against the reference")
    return problems


HOPPER_VARIANTS = [variant for variant in VARIANTS if "-hopper-" in variant.name]


def launched_variants(case_name: Callable[[], str]):
    """A patch of ``Launcher.prepare`` that prints ``MARK variant <name> <case>`` for each launch
    specialised as a Hopper variant of ``variants.VARIANTS`` is (same kernel, same compile-time
    values), ``case_name()`` being the case running, and ``MARK unnamed <kernel> <case>
    <name=value,...>`` for a Hopper launch that no variant names. Launches are prepared once per
    layout: a later case with the same one goes unnamed."""
    prepare = Launcher.prepare

    def naming(self, grid, args, key, candidates):
        prepared = prepare(self, grid, args, key, candidates)
        mine = [variant for variant in HOPPER_VARIANTS if variant.launcher is self]
        if mine:  # a compiled launch: its template holds every compile-time value, the tile's too
            values = {self.kernel.arg_names[slot]: prepared.template[slot] for slot in self.constexpr_slots}
            named = [v.name for v in mine if all(values.get(k) == x for k, x in v.constexprs.items())]
            for name in named:
                print(f"{MARK} variant {name} {case_name()}", flush=True)
            if not named:
                spec = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in values.items())
                print(f"{MARK} unnamed {self.kernel.__name__} {case_name()} {spec}", flush=True)
        return prepared

    return mock.patch.object(Launcher, "prepare", naming)


def run_case(case: Case, device: torch.device, reference: bool) -> list[str]:
    """Run ``case`` on ``device``, synchronise, and return what is wrong with its results."""
    # The interpreter has no bfloat16: on the CPU the kernels compute in float32.
    dtype = case.dtype if device.type == "cuda" or case.dtype != torch.bfloat16 else torch.float32
    actual = case.run(Target(device, dtype, dtype, "triton"), _generator(case.name))
    if device.type == "cuda":
        torch.cuda.synchronize()
    expected = None
    if reference and case.reference:
        expected = case.run(Target(torch.device("cpu"), torch.float32, dtype, "reference"), _generator(case.name))
    return _problems(actual, expected, TOLERANCE[dtype])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="run this case (repeatable); default: every default case")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-reference", action="store_true", help="only check that results are finite")
    parser.add_argument("--variants", action="store_true", help="name the Hopper variants each case launches")
    args = parser.parse_args()
    if args.list:
        for case in CASES.values():
            flags = "not-default" if not case.default else ""
            print(f"{case.name:36s} {flags:22s} {case.description}")
        return 0
    unknown = [name for name in args.case or () if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; --list shows them")
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the kernels under the Triton interpreter: set TRITON_INTERPRET=1")
    cases = [CASES[name] for name in args.case] if args.case else [c for c in CASES.values() if c.default]
    failed = 0
    running = ""
    naming = launched_variants(lambda: running) if args.variants else nullcontext()
    with naming:
        for case in cases:
            running = case.name
            failed += _run_and_report(case, device, not args.no_reference)
    print(f"{MARK} {len(cases) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


def _run_and_report(case: Case, device: torch.device, reference: bool) -> bool:
    """Run ``case`` between its begin and end lines; whether it failed."""
    print(f"{MARK} begin {case.name}", flush=True)
    start = time.perf_counter()
    try:
        problems = run_case(case, device, reference)
    except Exception:  # report and go on: the other cases still say which kernels are sound
        problems = [traceback.format_exc().rstrip().splitlines()[-1]]
        traceback.print_exc()
    status = "ok" if not problems else "FAILED: " + "; ".join(problems)
    print(f"{MARK} end {case.name} {status} ({time.perf_counter() - start:.2f}s)", flush=True)
    return bool(problems)


if __name__ == "__main__":
    sys.exit(main())
