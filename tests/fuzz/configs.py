"""Random attention problems, reproducible from (seed, trial index).

Compiling a Triton kernel takes about a second, so a GPU run can afford a hundred or two
compilations, and the kernels are specialised on many things: the constexpr flags that the
mask and bias shapes select (per key or not, the bias-gradient kind, atomics), the walk, the
tiles (chosen from the lengths and the block summary), whether GQA heads are packed and the
keys split, every pointer's dtype, and for every int argument whether it is 1 or a multiple of
16 (lengths and strides). Sampling is therefore two-level:

- a run draws a pool of :class:`Family` from its seed. A family fixes everything that selects
  a compiled kernel: dtype, head dim, GQA ratio, batch and head counts, mask and bias shapes
  and dtypes, the walk and its block sizes, softcap on or off, deterministic, the memory layout,
  and one length *range* per axis inside which no specialisation changes: a range lies between
  consecutive powers of two (tiles and summary blocks are powers of two) and holds either only
  multiples of 16 or none;
- a trial picks a family and draws everything else: lengths inside the ranges, causal and
  window, the softcap value, the scale, the mask's contents (fully masked rows included), the
  bias values (-inf included), the top-k block selection, and which extra checks to run.

A padded layout (the last dimension of every input stored with a stride rounded up to a multiple
of 16, the padding poisoned) keeps all strides multiples of 16 whatever the lengths, so such a
family compiles each kernel once. Contiguous families may compile a few variants.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from dataclasses import dataclass

WALKS = ("dense", "listed", "summary", "topk")
# flash_dma_topk_func's families: keys listed per query (drawn after the others' draws, so that a
# seed's other families stay as they were).
INDICES = "indices"
_INDICES_FRACTION = 0.2
# Families whose mask is KeyIntervals (a causal top-k's, or runs of rows of any kind), drawn after
# the indices draw, so that a seed's other families stay as they were.
INTERVALS = "intervals"
_INTERVALS_FRACTION = 0.15
INTERVAL_KINDS = ("topk", "runs")
WIDTHS = (1, 5, 16, 64)
BLOCK_SIZES = (16, 32, 64, 128, 256)
MASK_DTYPES = ("bool", "uint8", "int64")
# Lengths between consecutive powers of two; longer ranges are cut at the space's maximum.
RANGES = ((1, 1), (2, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, 512), (513, 1024))
_MASK_PATTERNS = ("random", "blocks", "rows", "keys", "none", "all")
_MASK_PATTERN_WEIGHTS = (35, 25, 20, 10, 4, 6)


@dataclass(frozen=True)
class Space:
    """What a run samples from.

    Attributes:
        dtypes: input dtypes (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8"``: e4m3 with descales, forward only).
        head_dims: head dims the families draw from.
        extra_head_dims: head dims given one family each, on top of ``families``.
        families: families drawn from ``head_dims``; each costs a few compiled kernels on a GPU.
        max_seqlen: longest query and key length.
        max_seqlen_k_long: longest key length of the split-KV families (keys past 512, few
            queries); 0 leaves them out.
        max_batch, max_heads: largest batch and number of query heads.
    """

    dtypes: tuple[str, ...] = ("bf16", "fp16")
    head_dims: tuple[int, ...] = (64, 128)
    extra_head_dims: tuple[int, ...] = ()
    families: int = 24
    max_seqlen: int = 300
    max_seqlen_k_long: int = 1024
    max_batch: int = 2
    max_heads: int = 8


@dataclass(frozen=True)
class Family:
    """The compile-time side of a trial (see the module docstring). Ranges are ``(lo, hi, aligned)``."""

    dtype: str
    head_dim: int
    batch: int
    kv_heads: int
    group: int
    mask: str | None  # broadcast form, e.g. "B,Hkv,1,Sk"
    mask_dtype: str
    bias: str | None
    bias_fp32: bool
    walk: str
    block_size: tuple[int, int] | None
    topk_per_query: bool
    softcap: bool
    deterministic: bool
    padded: bool
    seqlen_q: tuple[int, int, bool]
    seqlen_k: tuple[int, int, bool]

    def __str__(self) -> str:
        lengths = [
            f"{axis}{lo}" + (f"-{hi}" if hi > lo else "") + ("x16" if aligned else "")
            for axis, (lo, hi, aligned) in (("Sq", self.seqlen_q), ("Sk", self.seqlen_k))
        ]
        parts = [f"{self.dtype} D{self.head_dim} B{self.batch} H{self.kv_heads * self.group}/{self.kv_heads}", *lengths]
        parts.append(f"mask[{self.mask}]{self.mask_dtype}" if self.mask else "no-mask")
        parts.append(f"bias[{self.bias}]{'fp32' if self.bias_fp32 else ''}" if self.bias else "no-bias")
        parts.append(self.walk + (f"{self.block_size[0]}x{self.block_size[1]}" if self.block_size else ""))
        parts += [name for name in ("softcap", "deterministic", "padded") if getattr(self, name)]
        return " ".join(parts + (["per-query"] if self.topk_per_query else []))


@dataclass(frozen=True)
class Trial:
    """One attention problem and what to check on it: everything ``check.run_trial`` needs.

    Walks: ``dense`` passes the mask alone to a small problem (read element-wise); ``listed``
    makes the backend walk it as it walks large problems (a key list for per-key masks, else a
    summary it builds); ``summary`` passes ``build_block_mask(mask, block_size)``, or with
    ``packed`` the mask as a ``BitMask`` in blocks of ``block_size``; ``topk`` passes
    ``topk_block_mask`` (with the mask, if any, as its padding mask); ``indices`` calls
    ``flash_dma_topk_func`` with ``width`` keys listed per query (no mask; the mask pattern and
    density shape the lists, ``check.py``), its bias per pair ``"{1|B},Sq,{1|Hkv|H},W"`` or per
    key ``"{1|B},{1|Hkv|H},Sk"``; ``intervals`` passes the mask as ``KeyIntervals`` in blocks of
    ``block_size``, described by ``intervals``: a causal top-k (``causal_topk_intervals`` of random
    scores, ``keep`` per query, few distinct values with ``ties``, keys padded as the mask pattern
    and density say) or random runs of rows (``interval_mask``, with a start row or from row 0;
    ``aligned`` puts them on multiples of 128 rows, which makes the Hopper kernels' tiles per key).
    """

    index: int
    family: int
    data_seed: int
    dtype: str
    head_dim: int
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    mask: str | None
    mask_dtype: str
    # random | blocks (empty, full or random, at the summary's block size) | rows (some fully masked)
    # | keys (the same keys for every query) | none (all masked) | all
    mask_pattern: str
    mask_density: float
    bias: str | None
    bias_fp32: bool
    bias_scale: float
    bias_neg_inf: float  # fraction of bias entries set to -inf
    walk: str
    block_size: tuple[int, int] | None
    topk: dict | None  # topk_block_mask arguments: keys, per_query, causal, sink_blocks, local_blocks, reduce
    causal: bool
    window: tuple[int, int]
    softcap: float
    softmax_scale: float | None
    deterministic: bool
    padded: bool
    query_chunks: int  # > 1: dK/dV programs split each key tile's queries as for long sequences
    grad_qkv: bool  # False: only the bias requires a gradient
    repeat_backward: bool  # run the backward twice and require bitwise-equal gradients
    check_inputs: bool  # require the inputs unchanged afterwards
    packed: bool = False  # summary walk: the mask passed as a BitMask, which carries its own summary
    width: int = 0  # indices walk: W, the keys listed per query
    union_share: float | None = None  # indices walk: the backward's union share forced (-1: no block, 1: every block)
    intervals: dict | None = None  # intervals walk: kind, keep, ties, start (class docstring)
    counted: bool = False  # with query_chunks > 1: at most that many, as the Hopper dK/dV kernel counts its columns' work

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Trial":
        fields = json.loads(text)
        for name in ("window", "block_size"):
            if fields[name] is not None:
                fields[name] = tuple(fields[name])
        return cls(**fields)

    def dims(self, form: str) -> tuple[int, ...]:
        """Shape of a mask or bias written like ``"B,Hkv,1,Sk"``."""
        sizes = {
            "1": 1, "B": self.batch, "H": self.heads, "Hkv": self.kv_heads, "Sq": self.seqlen_q, "Sk": self.seqlen_k, "W": self.width,
        }
        return tuple(sizes[s] for s in form.split(","))

    def __str__(self) -> str:
        parts = [
            f"#{self.index} {self.dtype} B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k} "
            f"H{self.heads}/{self.kv_heads} D{self.head_dim}"
        ]
        if self.mask:
            parts.append(f"mask[{self.mask}]{self.mask_dtype}:{self.mask_pattern}{self.mask_density:.2f}")
        if self.bias:
            neg_inf = f"-inf{self.bias_neg_inf:g}" if self.bias_neg_inf else ""
            parts.append(f"bias[{self.bias}]{'fp32' if self.bias_fp32 else ''}{neg_inf}")
        if self.walk != "dense":
            parts.append(self.walk + (f"{self.block_size[0]}x{self.block_size[1]}" if self.block_size else "") + ("-packed" if self.packed else ""))
        if self.walk == INDICES:
            parts.append(f"W{self.width}")
        if self.walk == INTERVALS:
            kind = self.intervals["kind"]
            parts.append(kind + (f"-keep{self.intervals['keep']}" if kind == "topk" else "-aligned" if self.intervals["aligned"] else ""))
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale:.3g}")
        flags = [n for n in ("deterministic", "padded") if getattr(self, n)] + ([] if self.grad_qkv else ["bias-grad-only"])
        if self.query_chunks > 1:
            flags.append(f"chunks{'<=' if self.counted else ''}{self.query_chunks}")
        if self.union_share is not None:
            flags.append({-1.0: "per-query-backward", 1.0: "union-backward"}[self.union_share])
        return " ".join(parts + flags)


def _form(rng: random.Random, per_key: bool = False) -> str:
    """A broadcast form ``{1|B},{1|Hkv|H},{1|Sq},{1|Sk}``; ``per_key``: ``{1|B},1,1,Sk``."""
    if per_key:
        return f"{rng.choice(('1', 'B'))},1,1,Sk"
    # Every form occurs; broadcasting over the keys (a whole row on or off) less often.
    keys = "Sk" if rng.random() < 0.75 else "1"
    return ",".join((rng.choice(("1", "B")), rng.choice(("1", "Hkv", "H")), rng.choice(("1", "Sq")), keys))


def _range(rng: random.Random, ranges: list[tuple[int, int]], weight_of_one: float = 1.0) -> tuple[int, int, bool]:
    lo, hi = rng.choices(ranges, [weight_of_one if r == (1, 1) else 1.0 for r in ranges])[0]
    has_multiple = hi // 16 * 16 >= lo
    return lo, hi, has_multiple and rng.random() < 0.25


def _ranges(limit: int, lowest: int = 1) -> list[tuple[int, int]]:
    return [(lo, min(hi, limit)) for lo, hi in RANGES if lowest <= lo <= limit]


def _block_size(rng: random.Random) -> tuple[int, int]:
    # Small blocks make short sequences span many blocks.
    weights = (30, 25, 20, 15, 10)
    return rng.choices(BLOCK_SIZES, weights)[0], rng.choices(BLOCK_SIZES, weights)[0]


def _sample_family(rng: random.Random, space: Space, head_dim: int) -> Family:
    group = rng.choice([g for g in (1, 1, 2, 4, 8) if g <= space.max_heads])
    kv_heads = rng.choice([h for h in (1, 2, 4, 8) if h * group <= space.max_heads])
    walk = rng.choices(WALKS, (40, 15, 30, 15))[0]
    if walk == "topk":
        # The mask, if any, is topk_block_mask's padding mask: per key, one for all heads.
        mask = _form(rng, per_key=True) if rng.random() < 0.5 else None
    elif walk == "dense" and rng.random() < 0.3:
        mask = None
    else:
        mask = _form(rng)
    seqlen_q = _range(rng, _ranges(space.max_seqlen))
    # Split-KV needs keys past 512; those families keep few queries so that they stay cheap.
    long_keys = space.max_seqlen_k_long > 512 and seqlen_q[1] <= 64
    # A single key is a degenerate problem: half as likely as the other ranges.
    seqlen_k = _range(rng, _ranges(space.max_seqlen) + (_ranges(space.max_seqlen_k_long, 513) if long_keys else []), 0.5)
    family = Family(
        dtype=rng.choice(space.dtypes),
        head_dim=head_dim,
        batch=rng.randint(1, space.max_batch),
        kv_heads=kv_heads,
        group=group,
        mask=mask,
        mask_dtype=rng.choices(MASK_DTYPES, (70, 15, 15))[0],
        bias=_form(rng) if rng.random() < 0.7 else None,
        bias_fp32=rng.random() < 0.5,
        walk=walk,
        block_size=_block_size(rng) if walk in ("summary", "topk") else None,
        topk_per_query=walk == "topk" and rng.random() < 0.4,
        softcap=rng.random() < 0.2,
        deterministic=rng.random() < 0.3,
        padded=rng.random() < 0.75,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
    )
    if rng.random() >= _INDICES_FRACTION or family.dtype == "fp8":  # flash_dma_topk_func takes no FP8
        if rng.random() >= _INTERVALS_FRACTION:
            return family
        # Key intervals span the queries and keys: they broadcast over batch and heads only.
        mask = f"{rng.choice(('1', 'B'))},{rng.choice(('1', 'Hkv', 'H'))},Sq,Sk"
        block_q, block_k = _block_size(rng)
        return dataclasses.replace(
            family, walk=INTERVALS, mask=mask, mask_dtype="int32", block_size=(block_q, max(32, block_k)), topk_per_query=False,
        )
    bias = None
    if family.bias is not None:
        batch, heads = rng.choice(("1", "B")), rng.choice(("1", "Hkv", "H"))
        bias = f"{batch},Sq,{heads},W" if rng.random() < 0.5 else f"{batch},{heads},Sk"
    return dataclasses.replace(family, walk=INDICES, mask=None, bias=bias, block_size=None, topk_per_query=False)


@functools.lru_cache(maxsize=8)
def family_pool(space: Space, seed: int) -> tuple[Family, ...]:
    """The run's families: one per extra head dim, then ``space.families`` from ``head_dims``."""
    pool = []
    for i, dim in enumerate([*space.extra_head_dims, *[None] * space.families]):
        rng = random.Random(f"{seed}:family:{i}")
        pool.append(_sample_family(rng, space, dim if dim is not None else rng.choice(space.head_dims)))
    return tuple(pool)


def _length(rng: random.Random, lo: int, hi: int, aligned: bool) -> int:
    if aligned:
        return 16 * rng.randint(-(-lo // 16), hi // 16)
    while True:
        n = rng.randint(lo, hi)
        if n == 1 or n % 16:
            return n


def _window(rng: random.Random, seqlen_k: int, causal: bool) -> tuple[int, int]:
    """-1 (unbounded) or a width from 0 to past the key length, on each side; causal sets right to 0 itself."""
    if rng.random() < (0.3 if causal else 0.6):
        return (-1, -1)
    side = lambda: -1 if rng.random() < 0.3 else rng.randint(0, seqlen_k + 8)  # noqa: E731
    left, right = side(), side()
    return (left, -1) if causal else (left, right)


def sample_trial(space: Space, seed: int, index: int) -> Trial:
    """Trial ``index`` of the run with ``seed``: a function of its arguments only."""
    pool = family_pool(space, seed)
    rng = random.Random(f"{seed}:trial:{index}")
    family_index = rng.randrange(len(pool))
    family = pool[family_index]
    seqlen_q = _length(rng, *family.seqlen_q)
    seqlen_k = _length(rng, *family.seqlen_k)
    causal = rng.random() < 0.35
    topk = None
    if family.walk == "topk":
        topk = {
            "keys": rng.randint(0, seqlen_k),
            "per_query": family.topk_per_query,
            "causal": family.topk_per_query and rng.random() < 0.5,
            "sink_blocks": rng.choice((0, 0, 1, 2)),
            "local_blocks": rng.choice((0, 1, 2)) if family.topk_per_query else 0,
            "reduce": rng.choice(("max", "mean")),
        }
        if not (topk["sink_blocks"] or topk["local_blocks"]):
            # A window of 0 keys is an error without forced blocks; raised after the draws, so a seed's trials stay the same.
            topk["keys"] = max(topk["keys"], 1)
    return Trial(
        index=index,
        family=family_index,
        data_seed=rng.getrandbits(31),
        dtype=family.dtype,
        head_dim=family.head_dim,
        batch=family.batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads=family.kv_heads * family.group,
        kv_heads=family.kv_heads,
        mask=family.mask,
        mask_dtype=family.mask_dtype,
        mask_pattern=rng.choices(_MASK_PATTERNS, _MASK_PATTERN_WEIGHTS)[0],
        mask_density=round(rng.uniform(0.05, 0.95), 3),
        bias=family.bias,
        bias_fp32=family.bias_fp32,
        bias_scale=round(rng.uniform(0.5, 4.0), 3),
        bias_neg_inf=rng.choice((0.0, 0.0, 0.0, 0.0, 0.1, 0.5)),
        walk=family.walk,
        block_size=family.block_size,
        topk=topk,
        causal=causal,
        window=_window(rng, seqlen_k, causal),
        softcap=round(rng.uniform(1.0, 30.0), 2) if family.softcap else 0.0,
        softmax_scale=None if rng.random() < 0.6 else round(rng.uniform(0.3, 3.0) * family.head_dim**-0.5, 4),
        deterministic=family.deterministic,
        padded=family.padded,
        query_chunks=rng.choices((1, 2, 3, 8), (80, 10, 5, 5))[0],
        grad_qkv=family.bias is None or rng.random() < 0.9,
        repeat_backward=rng.random() < 0.25,
        check_inputs=rng.random() < 0.25,
        # Drawn last, so that a seed's other draws stay as they were.
        packed=family.walk == "summary" and family.mask is not None and family.block_size[1] >= 32 and rng.random() < 0.5,
        width=rng.choice(WIDTHS) if family.walk == INDICES else 0,
        union_share=rng.choice((None, -1.0, 1.0)) if family.walk == INDICES else None,
        intervals=_intervals(rng, seqlen_k) if family.walk == INTERVALS else None,
        counted=rng.random() < 0.5,
    )


def _intervals(rng: random.Random, seqlen_k: int) -> dict:
    """An intervals trial's contents (``Trial``): a causal top-k keeping up to past every key, or runs."""
    return {
        "kind": rng.choice(INTERVAL_KINDS),
        "keep": rng.randint(0, seqlen_k + 2),
        "ties": rng.random() < 0.3,
        "start": rng.random() < 0.7,
        "aligned": rng.random() < 0.5,
    }
