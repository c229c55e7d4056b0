"""Representative compile-time variants of every kernel, for compiling without a GPU.

``tools/compile_report.py`` compiles each for a GPU target with Triton's bundled ptxas and
reports registers, spills and shared memory; the CPU test suite compiles them for sm90, which
catches front-end errors that the interpreter lets through. One variant per code path that
matters: each walk (dense, block lists, key lists), per-key and full inputs, softcap, decode,
packed sequences (varlen) and a paged cache.

Each is compiled as a typical launch specialises it: pointers 16-byte aligned, and the ints
that the kernel's launcher lets Triton specialise divisible by 16 (without that, Triton cannot
vectorise the row loads, and the report would describe a kernel no launch runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flash_dma.backends.triton.backward import _DELTA_ROWS, dkdv_launcher, dq_launcher, preprocess_launcher
from flash_dma.backends.triton import bit_pack, key_intervals
from flash_dma.backends.triton.bit_pack import pack_launcher
from flash_dma.backends.triton.block_summary import lists_launcher, state_launcher
from flash_dma.backends.triton.forward import forward_launcher
from flash_dma.backends.triton.hopper import dkdv as hopper_dkdv
from flash_dma.backends.triton.hopper import dq as hopper_dq
from flash_dma.backends.triton.hopper import forward as hopper_forward
from flash_dma.backends.triton.hopper.common import (
    BIAS_KEYS,
    BIAS_PAIRS,
    BIAS_ROWS,
    CACHE_CONTIGUOUS,
    CACHE_PAGES,
    CACHE_ROWS,
    MASK_BITS,
    MASK_INTERVALS,
    MASK_KEYS,
    MASK_NONE,
    MASK_ROWS,
)
from flash_dma.backends.triton.key_list import count_launcher, gather_launcher, key_list_launcher
from flash_dma.backends.triton.topk import bits as topk_bits
from flash_dma.backends.triton.topk import union
from flash_dma.backends.triton.topk.backward import DKDV_LAUNCHER as topk_dkdv_launcher
from flash_dma.backends.triton.topk.backward import DQ_LAUNCHER as topk_dq_launcher
from flash_dma.backends.triton.topk.forward import FORWARD_LAUNCHER as topk_forward_launcher
from flash_dma.backends.triton.launch import Launcher
from flash_dma.backends.triton.layout import (
    DBIAS_FULL,
    DBIAS_NONE,
    DBIAS_PER_KEY,
    SEQ_CACHE,
    SEQ_FIXED,
    MASK_KINDS,
    SEQ_PACKED,
    WALK_BLOCKS,
    WALK_DENSE,
    WALK_KEYS,
)

# Pointer parameters (the launcher's named tensors) that do not hold the input dtype; the others do.
_POINTER_TYPES = {
    "Mask": "*u8", "Walk": "*i32", "Lse": "*fp32", "Delta": "*fp32", "DBias": "*fp32",
    "ScratchK": "*fp32", "ScratchV": "*fp32", "Turns": "*i32", "State": "*i8", "KeyList": "*i32", "Lists": "*i32",
    "SeqQ": "*i32", "SeqK": "*i32", "Queue": "*i32", "CacheRows": "*i32", "BlockTable": "*i32", "Counts": "*i32",
    "Indices": "*i32", "Order": "*i64", "Starts": "*i64", "Descale": "*fp32", "DKAcc": "*fp32", "DVAcc": "*fp32",
    "DBiasKeys": "*fp32", "Lengths": "*i32", "Keys": "*i32", "Words": "*i32", "Scratch": "*i32", "Workspace": "*i32",
    "Sums": "*fp32",
}
_FLOAT_SCALARS = ("scale", "scale_log2", "softcap_log2", "scale_over_cap", "lowest")


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation: its compile-time values and launch options."""

    name: str
    launcher: Launcher
    num_warps: int
    num_stages: int
    constexprs: dict = field(default_factory=dict)
    maxnreg: int | None = None
    pointers: dict = field(default_factory=dict)  # pointer types other than _POINTER_TYPES's, e.g. a BitMask's words

    @property
    def kernel(self):
        return self.launcher.kernel

    def attributes(self) -> dict:
        """Triton's ``attrs``: 16-divisibility of the aligned pointers and the specialised ints."""
        return {(slot,): [["tt.divisibility", 16]] for slot in (*self.launcher.tensor_slots, *self.launcher.int_slots)}

    def signature(self, dtype: str) -> dict:
        """Triton's ``signature`` for an ``ASTSource`` with inputs of ``dtype`` (e.g. ``"bf16"``)."""
        signature = {}
        pointers = {self.kernel.arg_names[slot] for slot in self.launcher.tensor_slots}
        for name in self.kernel.arg_names:
            if name in self.constexprs:
                signature[name] = "constexpr"
            elif name == "Out" and self.constexprs.get("SPLIT"):
                signature[name] = "*fp32"  # split-KV partial results
            elif name in pointers:
                signature[name] = self.pointers.get(name, _POINTER_TYPES.get(name, f"*{dtype}")).format(dtype=dtype)
            elif name in _FLOAT_SCALARS:
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
        return signature


_PER_KEY = dict(
    HAS_MASK=True, HAS_BIAS=True, WALK=WALK_BLOCKS, MASK_PER_KEY=True, BIAS_PER_KEY=True, SOFTCAP=False, DOT_PRECISION="tf32",
    SEQ=SEQ_FIXED, MASK_KIND=MASK_KINDS["elements"],
)
_KEYS = dict(_PER_KEY, HAS_MASK=False, WALK=WALK_KEYS, MASK_PER_KEY=False)
_DENSE = dict(_PER_KEY, HAS_MASK=False, WALK=WALK_DENSE, MASK_PER_KEY=False, BIAS_PER_KEY=False, SOFTCAP=True)
_FULL_MASK = dict(_PER_KEY, MASK_PER_KEY=False, BIAS_PER_KEY=False)
_BITS = dict(_FULL_MASK, MASK_KIND=MASK_KINDS["bits"])
_INTERVALS = dict(_PER_KEY, MASK_KIND=MASK_KINDS["intervals"], BIAS_PER_KEY=False)
# Hopper with aligned inputs: TMA loads (the kernels keep row-by-row loads where rows are gathered).
_FORWARD = dict(TMA=True, PACK_GQA=False, SPLIT=False, PAGED=False, PAGE_TILES=False, BLOCK_M=128, BLOCK_N=128, BLOCK_D=128)
_DKDV = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_D=128, DBIAS_HEAD_SHARED=True, DBIAS_ATOMIC=False, CHUNKS_IN_ORDER=False)
_DQ = dict(TMA=True, BLOCK_M=128, BLOCK_N=128, BLOCK_D=128)
_HOPPER = dict(MASK=MASK_KEYS.value, BIAS=BIAS_KEYS.value, WALK=WALK_BLOCKS, HEAD_DIM=128, COLUMNS=128, STAGED_BIAS=False, SOFTCAP=False, KV_STAGES=2)
_HOPPER_PAIRS = dict(_HOPPER, MASK=MASK_BITS.value, BIAS=BIAS_PAIRS.value, HEAD_DIM=64, COLUMNS=64, KV_STAGES=3)
_HOPPER_ROWS = dict(_HOPPER, MASK=MASK_ROWS.value, BIAS=BIAS_ROWS.value, WALK=WALK_DENSE)
_HOPPER_DKDV = dict(
    MASK=MASK_KEYS.value, BIAS=BIAS_KEYS.value, WALK=WALK_BLOCKS, HEAD_DIM=128, COLUMNS=128, STAGED_BIAS=False, SOFTCAP=False,
    DBIAS=DBIAS_PER_KEY, DBIAS_ATOMIC=False, DBIAS_HEAD_SHARED=True, SLICES=False, Q_STAGES=2, KV_BUFFERS=2, ROLES=False,
    SEQ=SEQ_FIXED,
)
# A bias with no gradient to make (none asked for, or zero: a row's, or one value for all keys):
# the flags the backward then launches dK/dV with (``backward.py``, ``dbias_flags``).
_NO_DBIAS = dict(DBIAS=DBIAS_NONE, DBIAS_HEAD_SHARED=False)
_HOPPER_DKDV_PAIRS = dict(
    _HOPPER_DKDV, MASK=MASK_BITS.value, BIAS=BIAS_PAIRS.value, HEAD_DIM=64, COLUMNS=64, Q_STAGES=3, DBIAS=DBIAS_FULL,
)


_INT32_MASK = {"Mask": "*i32"}  # a BitMask's words, key intervals' rows
# FP8 inputs (e4m3) and their bfloat16 output (the Hopper forward).
_FP8 = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv", "Out": "*bf16", "Bias": "*bf16"}
# Top-k index attention (topk/forward.py, topk/backward.py): a GQA group of 4 heads padded to 16 rows.
_TOPK_PAIRS = dict(HAS_BIAS=True, BIAS_PER_KEY=False, SOFTCAP=False, DOT_PRECISION="tf32", BLOCK_D=128)
_TOPK_SPLIT = dict(UNION_QUERIES=16)  # the per-query dQ walk beside the union kernel (topk/union.py)
_TOPK_KEYS = dict(_TOPK_PAIRS, BIAS_PER_KEY=True, SOFTCAP=True)
_TOPK_TILE = dict(BLOCK_M=16, BLOCK_N=64)
_TOPK_DQ_TILE = dict(_TOPK_TILE, UNION_QUERIES=0)
_TOPK_DKDV_TILE = dict(BLOCK_E=8, BLOCK_G=4)
# The top-k backward over a query block's union (topk/union.py): 16 queries x a group of 4 heads, 64 rows.
_UNION_KEYS = dict(_TOPK_KEYS, SOFTCAP=False, QUERIES=16, BLOCK_M=64)


def _gluon_variants(prefix: str, launcher, tile, *named_flags: tuple[str, dict]) -> list[Variant]:
    """Variants of a Gluon kernel, each with the kernel's one configuration ``tile`` (a ``triton.Config``)."""
    return [
        Variant(
            f"{prefix}-{name}", launcher, tile.num_warps, tile.num_stages, {**flags, **tile.kwargs}, tile.maxnreg,
            {**(_INT32_MASK if flags["MASK"] in (MASK_BITS.value, MASK_INTERVALS.value) else {}),
             **({"DBias": "*{dtype}"} if flags.get("DBIAS") == DBIAS_FULL and not flags["DBIAS_ATOMIC"] else {}),
             **(_FP8 if flags.get("FP8") else {})},
        )
        for name, flags in named_flags
    ]


VARIANTS = [
    Variant("forward-key-list", forward_launcher, 8, 2, {**_KEYS, **_FORWARD}),
    Variant("forward-per-key-blocks", forward_launcher, 8, 2, {**_PER_KEY, **_FORWARD}),
    Variant("forward-per-key-blocks-pointers", forward_launcher, 8, 2, {**_PER_KEY, **_FORWARD, "TMA": False}),
    Variant("forward-full-mask", forward_launcher, 8, 2, {**_FULL_MASK, **_FORWARD}),
    Variant("forward-dense-softcap", forward_launcher, 8, 2, {**_DENSE, **_FORWARD}),
    Variant("forward-dense-mask", forward_launcher, 4, 3, {**_FULL_MASK, **_FORWARD, "WALK": WALK_DENSE, "BLOCK_M": 64, "BLOCK_N": 64}),
    Variant("forward-decode", forward_launcher, 4, 3, {**_KEYS, **_FORWARD, "PACK_GQA": True, "SPLIT": True, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_D": 64}),
    Variant("forward-varlen", forward_launcher, 8, 2, {**_KEYS, **_FORWARD, "SEQ": SEQ_PACKED}),
    Variant(
        "forward-paged-decode", forward_launcher, 4, 3,
        {**_KEYS, **_FORWARD, "SEQ": SEQ_CACHE, "PAGED": True, "PACK_GQA": True, "SPLIT": True, "BLOCK_M": 16, "BLOCK_D": 64},
    ),
    Variant(  # pages holding whole tiles: K and V tiles copied from the pool
        "forward-paged-tiles-decode", forward_launcher, 4, 4,
        {**_PER_KEY, **_FORWARD, "HAS_MASK": False, "WALK": WALK_DENSE, "SEQ": SEQ_CACHE, "PAGED": True, "PAGE_TILES": True,
         "PACK_GQA": True, "SPLIT": True, "BLOCK_M": 16, "BLOCK_N": 64},
    ),
    Variant("forward-d256", forward_launcher, 8, 2, {**_KEYS, **_FORWARD, "BLOCK_N": 32, "BLOCK_D": 256}),
    Variant("forward-bits", forward_launcher, 8, 2, {**_BITS, **_FORWARD}, pointers=_INT32_MASK),
    Variant("forward-intervals", forward_launcher, 8, 2, {**_INTERVALS, **_FORWARD}, pointers=_INT32_MASK),
    *_gluon_variants(
        "forward-hopper", hopper_forward.hopper_launcher, hopper_forward.TILE,
        *((name, {"FP8": False, "SEQ": SEQ_FIXED, "CACHE": CACHE_CONTIGUOUS.value, **flags, "Q_SLOTS": 2}) for name, flags in (
            ("per-key-blocks", _HOPPER),
            ("key-list", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_KEYS)),
            ("dense-d64", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_DENSE, HEAD_DIM=64, COLUMNS=64, KV_STAGES=3)),
            ("dense-d32", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_DENSE, HEAD_DIM=32, COLUMNS=32, KV_STAGES=3)),
            ("pairs-d64", _HOPPER_PAIRS),
            ("pairs-d64-staged", dict(_HOPPER_PAIRS, STAGED_BIAS=True, KV_STAGES=2)),
            ("pairs-d128", dict(_HOPPER_PAIRS, HEAD_DIM=128, COLUMNS=128, KV_STAGES=2)),
            ("intervals", dict(_HOPPER, MASK=MASK_INTERVALS.value)),
            ("rows", _HOPPER_ROWS),
            ("per-key-blocks-softcap", dict(_HOPPER, SOFTCAP=True)),
            ("per-key-blocks-d96", dict(_HOPPER, COLUMNS=96)),
            ("per-key-blocks-fp8", dict(_HOPPER, FP8=True, KV_STAGES=3)),
            ("pairs-d64-fp8", dict(_HOPPER_PAIRS, FP8=True)),
            ("per-key-blocks-varlen", dict(_HOPPER, SEQ=SEQ_PACKED)),
            ("key-list-cache", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_KEYS, SEQ=SEQ_CACHE)),
            ("per-key-cache-rows", dict(_HOPPER, WALK=WALK_DENSE, SEQ=SEQ_CACHE, CACHE=CACHE_ROWS.value)),
            ("per-key-cache-pages", dict(_HOPPER, WALK=WALK_DENSE, SEQ=SEQ_CACHE, CACHE=CACHE_PAGES.value)),
            # A 16-bit per-key bias, added by the tensor cores (not on the per-key-block walk) (``common.adds_key_bias_by_mma``).
            ("dense-bias-mma", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_DENSE, STAGED_BIAS=True)),
            ("key-list-bias-mma", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_KEYS, STAGED_BIAS=True)),
        )),
    ),
    *_gluon_variants(
        "forward-hopper", hopper_forward.hopper_launcher, hopper_forward.WIDE_TILE,
        ("per-key-blocks-d256", dict(_HOPPER, HEAD_DIM=256, COLUMNS=256, Q_SLOTS=1, FP8=False, SEQ=SEQ_FIXED, CACHE=CACHE_CONTIGUOUS.value)),
        ("per-key-blocks-d192", dict(_HOPPER, HEAD_DIM=256, COLUMNS=192, Q_SLOTS=1, FP8=False, SEQ=SEQ_FIXED, CACHE=CACHE_CONTIGUOUS.value)),
        ("per-key-blocks-d256-fp8", dict(_HOPPER, HEAD_DIM=256, COLUMNS=256, Q_SLOTS=1, FP8=True, SEQ=SEQ_FIXED, CACHE=CACHE_CONTIGUOUS.value)),
        ("dense-d192-bias-mma", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_DENSE, HEAD_DIM=256, COLUMNS=192, Q_SLOTS=1, FP8=False,
                                    SEQ=SEQ_FIXED, CACHE=CACHE_CONTIGUOUS.value, STAGED_BIAS=True)),
    ),
    Variant("dkdv-key-list", dkdv_launcher, 4, 3, {**_KEYS, **_DKDV, "DBIAS": DBIAS_PER_KEY}),
    Variant("dkdv-per-key-blocks", dkdv_launcher, 4, 3, {**_PER_KEY, **_DKDV, "DBIAS": DBIAS_PER_KEY}),
    Variant("dkdv-per-key-blocks-in-order", dkdv_launcher, 4, 3, {**_PER_KEY, **_DKDV, "DBIAS": DBIAS_PER_KEY, "CHUNKS_IN_ORDER": True}),
    Variant("dkdv-varlen", dkdv_launcher, 4, 3, {**_KEYS, **_DKDV, "DBIAS": DBIAS_PER_KEY, "SEQ": SEQ_PACKED}),
    Variant("dkdv-full-bias-atomic", dkdv_launcher, 4, 3, {**_FULL_MASK, **_DKDV, "DBIAS": DBIAS_FULL, "DBIAS_ATOMIC": True}),
    Variant("dkdv-dense-softcap", dkdv_launcher, 4, 3, {**_DENSE, **_DKDV, "DBIAS": DBIAS_NONE}),
    Variant("dkdv-dense-mask", dkdv_launcher, 4, 3, {**_PER_KEY, **_DKDV, "WALK": WALK_DENSE, "DBIAS": DBIAS_PER_KEY, "BLOCK_M": 32, "BLOCK_N": 64}),
    Variant("dkdv-bits-full-bias", dkdv_launcher, 4, 3, {**_BITS, **_DKDV, "DBIAS": DBIAS_FULL}, pointers=_INT32_MASK),
    Variant("dkdv-intervals-full-bias", dkdv_launcher, 4, 3, {**_INTERVALS, **_DKDV, "DBIAS": DBIAS_FULL}, pointers=_INT32_MASK),
    *_gluon_variants(
        "dkdv-hopper", hopper_dkdv.hopper_dkdv_launcher, hopper_dkdv.TILE,
        ("per-key-blocks", _HOPPER_DKDV),
        # The llm shape's form at keep 1/8: query chunks, whose per-key bias gradients add by atomics.
        ("per-key-blocks-atomic", dict(_HOPPER_DKDV, DBIAS_ATOMIC=True)),
        ("dense-d64", dict(_HOPPER_DKDV, MASK=MASK_NONE.value, WALK=WALK_DENSE, HEAD_DIM=64, COLUMNS=64, Q_STAGES=3, **_NO_DBIAS)),
        ("dense-d32", dict(_HOPPER_DKDV, MASK=MASK_NONE.value, WALK=WALK_DENSE, HEAD_DIM=32, COLUMNS=32, Q_STAGES=3, **_NO_DBIAS)),
        ("pairs-d64", _HOPPER_DKDV_PAIRS),
        ("pairs-d64-staged", dict(_HOPPER_DKDV_PAIRS, STAGED_BIAS=True)),
        ("pairs-d128-atomic", dict(_HOPPER_DKDV_PAIRS, HEAD_DIM=128, COLUMNS=128, Q_STAGES=2, DBIAS_ATOMIC=True)),
        ("intervals", dict(_HOPPER_DKDV, MASK=MASK_INTERVALS.value)),
        ("rows", dict(_HOPPER_DKDV, MASK=MASK_ROWS.value, BIAS=BIAS_ROWS.value, WALK=WALK_DENSE, **_NO_DBIAS)),
        ("per-key-blocks-softcap", dict(_HOPPER_DKDV, SOFTCAP=True)),
        ("per-key-blocks-slices", dict(_HOPPER_DKDV, SLICES=True)),
        ("per-key-blocks-d96", dict(_HOPPER_DKDV, COLUMNS=96)),
        ("per-key-blocks-varlen", dict(_HOPPER_DKDV, SEQ=SEQ_PACKED)),
        ("key-list", dict(_HOPPER_DKDV, MASK=MASK_NONE.value, WALK=WALK_KEYS)),
        # Query chunks over a key list, a bias per query head: each head's per-key gradient added by atomics.
        ("key-list-atomic", dict(_HOPPER_DKDV, MASK=MASK_NONE.value, WALK=WALK_KEYS, DBIAS_ATOMIC=True, DBIAS_HEAD_SHARED=False)),
        ("key-list-pairs-atomic", dict(_HOPPER_DKDV_PAIRS, MASK=MASK_NONE.value, WALK=WALK_KEYS, DBIAS_ATOMIC=True)),
    ),
    *_gluon_variants(
        "dkdv-hopper", hopper_dkdv.hopper_dkdv_launcher, hopper_dkdv.WIDE_TILE,
        *((name, dict(_HOPPER_DKDV, HEAD_DIM=256, KV_BUFFERS=1, ROLES=True, **flags)) for name, flags in (
            ("per-key-blocks-d256", dict(COLUMNS=256)),
            ("per-key-blocks-d192-slices", dict(COLUMNS=192, SLICES=True)),
            ("intervals-d256", dict(COLUMNS=256, MASK=MASK_INTERVALS.value)),
            ("pairs-d256-softcap", dict(COLUMNS=256, MASK=MASK_NONE.value, BIAS=BIAS_PAIRS.value, WALK=WALK_DENSE, DBIAS=DBIAS_FULL,
                                        SOFTCAP=True)),
        )),
    ),
    *_gluon_variants(  # 128 keys a tile: one Q/dO slot at D = 128 (``hopper_dq.RINGS``)
        "dq-hopper", hopper_dq.hopper_dq_launcher, hopper_dq.TILE,
        *((name, {"SEQ": SEQ_FIXED, "Q_SLOTS": 1, **flags}) for name, flags in (
            ("per-key-blocks", _HOPPER),
            ("key-list", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_KEYS)),
            ("dense-d64", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_DENSE, HEAD_DIM=64, COLUMNS=64, KV_STAGES=3, Q_SLOTS=2)),
            ("dense-d32", dict(_HOPPER, MASK=MASK_NONE.value, WALK=WALK_DENSE, HEAD_DIM=32, COLUMNS=32, KV_STAGES=3, Q_SLOTS=2)),
            ("bits-rows-bias", dict(_HOPPER, MASK=MASK_BITS.value, BIAS=BIAS_ROWS.value)),
            ("rows", _HOPPER_ROWS),
            ("per-key-blocks-d96", dict(_HOPPER, COLUMNS=96)),
            ("intervals", dict(_HOPPER, MASK=MASK_INTERVALS.value)),
            ("pairs-d64-staged", dict(_HOPPER_PAIRS, STAGED_BIAS=True, KV_STAGES=2, Q_SLOTS=2)),  # ``hopper_dq.STAGED_BIAS_RINGS``
        )),
    ),
    *_gluon_variants(  # 64 keys a tile (``hopper_dq.SMALL_TILE``)
        "dq-hopper", hopper_dq.hopper_dq_launcher, hopper_dq.SMALL_TILE,
        *((name, {"SEQ": SEQ_FIXED, "Q_SLOTS": 2, **flags}) for name, flags in (
            ("pairs-d64", _HOPPER_PAIRS),
            ("per-key-blocks-softcap", dict(_HOPPER, SOFTCAP=True)),
            ("per-key-blocks-64-keys", _HOPPER),
            ("per-key-blocks-varlen", dict(_HOPPER, SEQ=SEQ_PACKED)),
        )),
    ),
    *_gluon_variants(
        "dq-hopper", hopper_dq.hopper_dq_launcher, hopper_dq.WIDE_TILE,
        ("per-key-blocks-d256", dict(_HOPPER, HEAD_DIM=256, COLUMNS=256, KV_STAGES=2, Q_SLOTS=1, SEQ=SEQ_FIXED)),
        ("pairs-d192-softcap", dict(_HOPPER, MASK=MASK_NONE.value, BIAS=BIAS_PAIRS.value, WALK=WALK_DENSE, HEAD_DIM=256, COLUMNS=192,
                                    SOFTCAP=True, KV_STAGES=2, Q_SLOTS=1, SEQ=SEQ_FIXED)),
    ),
    Variant("dq-key-list", dq_launcher, 8, 2, {**_KEYS, **_DQ}),
    Variant("dq-per-key-blocks", dq_launcher, 8, 2, {**_PER_KEY, **_DQ}),
    Variant("dq-varlen", dq_launcher, 8, 2, {**_KEYS, **_DQ, "SEQ": SEQ_PACKED}),
    Variant("dq-full-mask", dq_launcher, 8, 2, {**_FULL_MASK, **_DQ}),
    Variant("dq-intervals", dq_launcher, 8, 2, {**_INTERVALS, **_DQ}, pointers=_INT32_MASK),
    Variant("dq-dense-mask", dq_launcher, 4, 3, {**_FULL_MASK, **_DQ, "WALK": WALK_DENSE, "BLOCK_M": 64, "BLOCK_N": 64}),
    Variant("topk-forward-pairs", topk_forward_launcher, 4, 2, {**_TOPK_PAIRS, **_TOPK_TILE}),
    Variant("topk-forward-keys-softcap", topk_forward_launcher, 4, 2, {**_TOPK_KEYS, **_TOPK_TILE}),
    Variant("topk-dq-pairs-dbias", topk_dq_launcher, 4, 2, {
        **_TOPK_PAIRS, **_TOPK_DQ_TILE, "DBIAS_PAIRS": True, "DBIAS_PER_HEAD": True, "ATOMIC_DKDV": False, "DBIAS_KEYS": False,
    }),
    Variant("topk-dq-keys-softcap", topk_dq_launcher, 4, 2, {
        **_TOPK_KEYS, **_TOPK_DQ_TILE, "DBIAS_PAIRS": False, "DBIAS_PER_HEAD": False, "ATOMIC_DKDV": False, "DBIAS_KEYS": False,
    }),
    Variant("topk-dq-atomic-dkdv-pairs-dbias", topk_dq_launcher, 4, 2, {
        **_TOPK_PAIRS, **_TOPK_DQ_TILE, "DBIAS_PAIRS": True, "DBIAS_PER_HEAD": False, "ATOMIC_DKDV": True, "DBIAS_KEYS": False,
    }),
    Variant("topk-dq-atomic-dkdv-keys-dbias-split", topk_dq_launcher, 4, 2, {
        **_TOPK_KEYS, **_TOPK_DQ_TILE, **_TOPK_SPLIT, "DBIAS_PAIRS": False, "DBIAS_PER_HEAD": True, "ATOMIC_DKDV": True, "DBIAS_KEYS": True,
    }),
    Variant("topk-dkdv-keys-dbias", topk_dkdv_launcher, 4, 1, {**_TOPK_KEYS, **_TOPK_DKDV_TILE, "DBIAS_KEYS": True, "DBIAS_PER_HEAD": True}),
    Variant("topk-dkdv-pairs", topk_dkdv_launcher, 4, 1, {**_TOPK_PAIRS, **_TOPK_DKDV_TILE, "DBIAS_KEYS": False, "DBIAS_PER_HEAD": False}),
    Variant("topk-union-backward-keys-dbias", union.BACKWARD_LAUNCHER, 4, 3, {
        **_UNION_KEYS, "BLOCK_N": 32, "DBIAS_PER_HEAD": True, "DBIAS_KEYS": True,
    }),
    Variant("topk-union-backward-softcap", union.BACKWARD_LAUNCHER, 4, 3, {
        **_UNION_KEYS, "HAS_BIAS": False, "SOFTCAP": True, "BLOCK_N": 32, "DBIAS_PER_HEAD": False, "DBIAS_KEYS": False,
    }),
    Variant("topk-union-lists", union.BUILD_LAUNCHER, 4, 1, dict(QUERIES=16, CHUNK=1024)),
    # The backward's preprocess: delta alone, with the workspace zeroed, with the Hopper dK/dV's
    # columns counted too, and zeroing only the chunk sums' rows it adds to, walking a key list.
    *[
        Variant(f"backward-preprocess{name}", preprocess_launcher, 4, 1, dict(
            BLOCK_M=_DELTA_ROWS, BLOCK_D=128, WORKSPACE=workspace, COUNT=count, LIVE=live,
            COUNT_BLOCK_M=hopper_dkdv.TILE.kwargs["BLOCK_M"], COUNT_BLOCK_N=hopper_dkdv.TILE.kwargs["BLOCK_N"],
        ))
        for name, workspace, count, live in (
            ("", False, False, WALK_DENSE), ("-workspace", True, False, WALK_DENSE), ("-counted", True, True, WALK_BLOCKS),
            ("-key-list", True, False, WALK_KEYS),
        )
    ],
    *[
        Variant(f"dkdv-write-gradients-{chunks}{name}", hopper_dkdv._write_gradients_launcher, 4, 1, dict(
            CHUNKS=chunks, LIVE=live, SLOTS=hopper_dkdv._WRITE_SLOTS, BLOCK_D=128,
            BLOCK_M=hopper_dkdv.TILE.kwargs["BLOCK_M"], BLOCK_N=hopper_dkdv.TILE.kwargs["BLOCK_N"],
        ))
        for chunks, name, live in ((1, "", WALK_DENSE), (4, "-blocks", WALK_BLOCKS), (4, "-key-list", WALK_KEYS))
    ],
    Variant("kept-count", count_launcher, 4, 1, dict(CHUNK=1024)),
    Variant("key-list", key_list_launcher, 4, 1, dict(CHUNK=1024, CHUNKS=1024)),
    Variant("gather-kept-keys", gather_launcher, 4, 1, dict(BLOCK=128, BLOCK_D=128)),
    Variant("block-state", state_launcher, 4, 1, dict(ROWS=16, COLS=128)),
    Variant("block-lists", lists_launcher, 4, 1, dict(CHUNK=1024)),
    # Dense masks into bits: bool read as int32 (four keys an element), and an additive float mask.
    *[
        Variant(f"bits-pack-{kind}", pack_launcher, 4, bit_pack._STAGES, dict(
            ROWS=bit_pack.step_rows(128 // lanes, 128), BLOCK_K=128, LANES=lanes, ADDITIVE=kind == "additive",
            KEYS_CONTIGUOUS=True, STAGES=bit_pack._STAGES,
        ), pointers={"Mask": mask})
        for kind, lanes, mask in (("bool", 4, "*i32"), ("additive", 1, "*{dtype}"))
    ],
    Variant("intervals-state", key_intervals.state_launcher, 4, 1, dict(BLOCK_K=128, BLOCKS=key_intervals._KEYS // 128,
            HAS_START=True), pointers={"Start": "*i32", "End": "*i32"}),
    Variant("intervals-causal-topk-end", key_intervals.end_launcher, 4, 1, dict(TILE=key_intervals._TILE, HAS_ALLOWED=True),
            pointers={"Scores": "*{dtype}", "Allowed": "*u8", "End": "*i32"}),
    Variant("topk-bits", topk_bits._BITS_LAUNCHER, 4, 1, dict(BLOCK_W=topk_bits._ENTRIES)),
    Variant("topk-bits-states", topk_bits._STATES_LAUNCHER, 4, 1, dict(BLOCK_Q=128, BLOCK_K=128,
            KEY_BLOCKS=topk_bits._KEY_BLOCKS)),
]
