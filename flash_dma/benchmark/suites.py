"""The benchmark cases: shapes, masks, and which methods and passes run on each.

Suites, in the order ``--suite all`` runs them, are :data:`SUITE_HELP`'s (the llm suite holds
most targets, so a run cut short has them first). "The seeds" are the project's founding examples:
v1's Quick Start shape (B=1, H=2, Hkv=1, D=64) and its token-level ``create_mask`` selection.

Block masks (``mask="block"``) are per key (``[1, Hkv, 1, Sk]``) and keep whole blocks of
:data:`MASK_BLOCK` keys, so a case's sparsity is the fraction ``keep`` of its key blocks. Dense
methods ignore the mask, so they run only in the first case of each shape (the one with the
most blocks kept).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from fractions import Fraction

from flash_dma.integers import cdiv

MASK_BLOCK = 128  # keys per block of the top-k masks: the default block of flash-dma and Flex
# The model suites' workloads. They live here, not beside the models (llama.py, layers.py, which
# import torch and take them from here), so that `flash-dma bench --help` lists the suites at once.
GENERATE_NEW_TOKENS = 8
# The batching suite's serving workload: 16 requests of 128 to 2048 prompt tokens, 32 new tokens each.
BATCH_PROMPT_LENGTHS = tuple(128 << (i % 5) for i in range(16))
BATCH_NEW_TOKENS = 32
# Blocks of its paged KV cache; None: transformers' default, sized from the device's free memory.
BATCH_CACHE_BLOCKS: int | None = None
LAYER_CONFIG = {
    "hidden_size": 2048,
    "num_heads": 16,
    "num_kv_heads": 4,
    "window_size": 2048,
    "block_size": 128,
    "sink_blocks": 1,
}
LAYER_COUNT = 4
# The suites in run order (the llm suite holds most targets, so a run cut short has them first), and
# what each runs, as `flash-dma bench --help` lists them.
SUITE_HELP = {
    "llm": "a GQA layer (B=1, H=16, Hkv=4, D=128), block top-k per key: S=4K-32K keeping 1 to 1/32 of the "
           "128-key blocks, 128K keeping 1/8, and a per-pair bias; vs Flex, SDPA and cuDNN",
    "seedtable": "the seeds' headline table: S=32K, B=1, H=2, Hkv=1, D=64, causal, a per-pair bias [1,1,S,S] and "
                 "each query's top-W keys of it (create_mask, packed) for W=32..32K; vs the same call without "
                 "the mask and SDPA with the additive mask",
    "pqtoken": "the llm shape at 16K with each query's top-2048 keys of a per-pair score (a per-query mask "
               "[1,4,S,S], packed) and a per-key bias; vs the same call without the mask, Flex and cuDNN",
    "topk": "each query's top-2048 keys as top-k indices (flash_dma_topk_func) and a per-key bias: the llm "
            "shape at 32K vs the same selection as a packed per-query mask, the call without the mask (dense "
            "causal) and Flex; at 128K vs dense causal and Flex; a wide group (H=64, Hkv=4) at 128K",
    "topkq": "the llm shape at 16K with a per-query-block top-k (each 128-query block keeps its own 1/8 of "
             "the key blocks, with block 0 and its diagonal block); vs Flex",
    "token": "the llm shape at 16K with a token-level mask (the 2048 keys of largest bias per head, "
             "create_mask), and with the bias alone; vs Flex",
    "seed": "the seeds' shape (B=1, H=2, Hkv=1, D=64): prefill with a 2048-key window, decode (one query row) "
            "over caches up to 512K, and a window sweep at 32K",
    "host": "host time per call at S=128, with the seeds' mask and bias and with neither; vs Flex and SDPA",
    "llama": "the train step of a 4-layer transformers Llama at 4K and 16K, attention by flash-dma or SDPA",
    "doge": "the train step of a 4-layer transformers Doge (hidden 1024, 8/2 heads, keep_window_size 1024: its "
            "own dynamic per-query mask) at 4K, 8K and 16K, attention by flash-dma or SDPA, with peak memory",
    "batching": f"transformers' continuous batching: the 4-layer Llama serving {len(BATCH_PROMPT_LENGTHS)} requests of "
                f"{min(BATCH_PROMPT_LENGTHS)} to {max(BATCH_PROMPT_LENGTHS)} prompt tokens, {BATCH_NEW_TOKENS} new tokens "
                "each, with generate_batch over its paged cache; attention by flash-dma or SDPA, in generated tokens/s",
    "layer": f"a stack of {LAYER_COUNT} DynamicMaskAttention layers (hidden {LAYER_CONFIG['hidden_size']}, "
             f"{LAYER_CONFIG['num_heads']}/{LAYER_CONFIG['num_kv_heads']} heads, window {LAYER_CONFIG['window_size']} "
             f"in blocks of {LAYER_CONFIG['block_size']}, {LAYER_CONFIG['sink_blocks']} sink block) at 16K: its eager "
             "train step against the same stack dense with the bias only, and one layer's key selection alone",
    "firstcall": "the first call in a new process, with warm and with cold compiler caches, and a new "
                 "process's first Llama generate and train step",
    "varlen": "the llm shape over 8 documents of 512 to 8K tokens packed into 32K (flash_dma_varlen_func), "
              "each keeping 1/8 of its blocks; vs Flex with a document mask and vs the documents padded",
    "kvcache": "decode through flash_dma_with_kvcache over a full cache, contiguous and paged, with a per-key "
               "mask and bias: B=8 over 32K keys, B=1 over 512K",
    "forms": "the llm shape at 16K, block top-k 1/8, plain and in the contract's other forms (softcap, "
             "deterministic gradients, FP8 inputs, a KV cache, each query's top 1/8 of the keys as key "
             "intervals): what each form costs against the plain call; and at head dims 96, 192 and 256 "
             "against Flex",
    "topkfit": "the sweep behind flash_dma_topk_func's choice of walk per pass (dispatch.TOPK_COSTS): the "
               "llm shape with each query's top-2048 keys, random and overlapping, at 16K-128K, through the index "
               "walk, the packed mask built in the call, the same mask handed over built, and the plan chosen; "
               "8K with a bias plane, and H=64 at 32K. `python -m flash_dma.benchmark.topk_fit` fits the costs",
}
SUITES = tuple(SUITE_HELP)
MODES = ("fwd", "fwdbwd")
# Attention calls timed on the GPU; then host time per call; then a model's train step and generate.
ATTENTION_KINDS = ("prefill", "decode", "window")
MODEL_KINDS = ("train", "generate", "serve", "select")
KINDS = (*ATTENTION_KINDS, "host", *MODEL_KINDS)

MASKED_METHODS = ("flash-dma", "flex", "sdpa-additive")
DENSE_METHODS = ("sdpa-flash", "sdpa-cudnn")
# The per-call summary variant shows what reusing the block mask saves, and the Flex backend what
# flash-dma's contract costs on Flex; one suite is enough for both.
LLM_MASKED_METHODS = ("flash-dma", "flash-dma-percall", "flash-dma-flex", "flex", "sdpa-additive")
# Beside the llm shape's dense ceilings, flash-dma with neither mask nor bias: what the bias costs.
LLM_DENSE_METHODS = (*DENSE_METHODS, "flash-dma-nobias")
# cuDNN, the dense ceiling, is what the "vs cuDNN" column of the report compares each row with.
CEILING = "sdpa-cudnn"

SEED_SHAPE = {"batch": 1, "heads": 2, "kv_heads": 1, "head_dim": 64}
SEEDTABLE_LENGTH = 32768
SEEDTABLE_WINDOWS = (32, 1024, 8192, 32768)  # the seeds' table's W
SEEDTABLE_HEADLINE_WINDOW = 1024
PQTOKEN_LENGTH = 16384
PQTOKEN_KEPT_KEYS = 2048  # per query
# The per-query suites' own rows: the same call with no mask, beside flash-dma's.
PER_QUERY_METHODS = ("flash-dma", "flash-dma-nomask")
# Each query's top keys of a per-pair score, as top-k indices: random scores, or scores smooth in the
# query, so that neighbouring queries' selections overlap (``inputs.overlapping_topk_indices``).
INDEX_SELECTIONS = ("query-index", "query-index-overlap")
PER_QUERY_SELECTIONS = ("query-token", *INDEX_SELECTIONS)  # masks of each query's top keys of a per-pair score
INDEX_LABELS = {"query-index": " (indices)", "query-index-overlap": " (indices, overlapping)"}
TOPK_LENGTH = 32768
TOPK_LONG_LENGTH = 131072
TOPK_KEPT_KEYS = 2048  # per query and K/V head: DSA's
TOPK_METHODS = ("flash-dma-topk", *PER_QUERY_METHODS, "flex")
# At 128K the packed mask (8 GiB of bits, its time about 16x the 32K row's) is left to the 32K row.
TOPK_LONG_METHODS = ("flash-dma-topk", "flash-dma-nomask", "flex")
SEED_PREFILL_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SEED_PREFILL_WINDOW = 2048  # keys kept per query row: the seeds' default window
SEED_DECODE_LENGTHS = (256, 1024, 4096, 16384, 65536, 131072, 262144, 524288)
SEED_DECODE_KEEPS = (1.0, 1 / 8)
SEED_SWEEP_LENGTH = 32768
SEED_SWEEP_WINDOWS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

LLM_SHAPE = {"batch": 1, "heads": 16, "kv_heads": 4, "head_dim": 128}
LLM_LENGTHS = (4096, 8192, 16384, 32768)
LLM_KEEPS = (1.0, 1 / 2, 1 / 8, 1 / 32)
LLM_FULL_BIAS_LENGTH = 4096
LLM_FULL_BIAS_KEEP = 1 / 8
LLM_LONG_LENGTH = 131072
LLM_LONG_KEEP = 1 / 8
# MLA-like: many query heads share each gather of the listed keys (the topk suite's TFLOP/s targets).
TOPK_WIDE_SHAPE = {**LLM_SHAPE, "heads": 64}
TOPKFIT_LENGTHS = (16384, 32768, 65536, 131072)
TOPKFIT_PLANE_LENGTH = 8192  # 4 keys per list entry: the longest a bias plane is allowed
# The plan the model picks; each pass on the index walk; on the packed mask, built in the call; the
# mask handed over built (its conversion excluded); the last two's difference is the conversion.
TOPKFIT_METHODS = ("flash-dma-topk", "flash-dma-topk-indices", "flash-dma-topk-packed", "flash-dma")

TOPKQ_LENGTH = 16384
TOPKQ_KEEP = 1 / 8  # of the key blocks, per query block, the sink and local blocks included
TOPKQ_SINK_BLOCKS = 1
TOPKQ_LOCAL_BLOCKS = 1

TOKEN_LENGTH = 16384
TOKEN_KEPT_KEYS = 2048  # per (batch, K/V head): the seeds' window

HOST_LENGTH = 128
HOST_METHODS = ("flash-dma", "flex", "sdpa")

LLAMA_LENGTHS = (4096, 8192, 16384)
DOGE_SHAPE = {"batch": 1, "heads": 8, "kv_heads": 2, "head_dim": 128}
DOGE_LENGTHS = (4096, 8192, 16384)
DOGE_METHODS = ("doge-flash-dma", "doge-sdpa")
LLAMA_METHODS = ("llama-flash-dma", "llama-sdpa")
BATCHING_METHODS = ("batch-flash-dma", "batch-sdpa")
LAYER_LENGTH = 16384
LAYER_METHODS = ("layer-flash-dma", "layer-dense-bias")
LLAMA_PROMPT_LENGTH = 128

FIRST_CALL_LENGTH = 4096
FIRST_CALL_KEEP = 1 / 8

# varlen: documents of VARLEN_MIN..VARLEN_MAX tokens, drawn with a fixed seed, packed into VARLEN_TOTAL.
VARLEN_DOCUMENTS = 8
VARLEN_MIN, VARLEN_MAX = 512, 8192
VARLEN_TOTAL = 32768
VARLEN_SEED = 0
VARLEN_KEEP = 1 / 8  # of each document's own MASK_BLOCK-key blocks, block 0 of each document included
VARLEN_METHODS = ("flash-dma-varlen", "flex", "flash-dma-padded")

# kvcache: one new query row over a full cache (no new key appended: the call times attention only).
KVCACHE_SHAPE = {"batch": 8, "heads": 32, "kv_heads": 8, "head_dim": 128}
KVCACHE_LENGTH = 32768
KVCACHE_KEEPS = (1.0, 1 / 8)  # of the cached keys, per (entry, K/V head), chosen at random
KVCACHE_LAYOUTS = ("contiguous", "paged")
KVCACHE_PAGE_SIZE = 256
KVCACHE_LONG_SHAPE = SEED_SHAPE
KVCACHE_LONG_LENGTH = 524288
KVCACHE_LONG_KEEP = 1 / 8
KVCACHE_METHODS = ("flash-dma-kvcache",)
FORMS_LENGTH = 16384
FORMS_FP8_SHORT_LENGTH = 4096  # the FP8 forward where the call's host time is a large share
FORMS_KEEP = 1 / 8
FORMS_SOFTCAP = 30.0  # Gemma 2's attention cap
FORMS_HEAD_DIMS = (96, 192, 256)  # large models' head dims, against Flex
FORMS_PREFILL_QUERIES, FORMS_CACHE_LENGTH = 4096, 65536  # chunked prefill: 4K new queries over a 64K cache

# --quick: a few rows per suite, with about one Flex compilation per suite.
QUICK_SEED_PREFILL_LENGTHS = (4096,)
QUICK_SEED_DECODE_LENGTHS = (524288,)
QUICK_LLM_LENGTHS = (4096,)
QUICK_LLM_KEEPS = (1.0, 1 / 8)
QUICK_LLAMA_LENGTHS = (4096,)
QUICK_KVCACHE_KEEPS = (1 / 8,)

CACHE_LABELS = {"warm": ", new process, warm cache", "cold": ", new process, cold caches"}


def kept_block_count(keep: float, num_blocks: int) -> int:
    """Blocks a mask keeping the fraction ``keep`` of ``num_blocks`` holds: at least one."""
    return max(1, min(num_blocks, round(keep * num_blocks)))


def document_lengths(
    count: int = VARLEN_DOCUMENTS, low: int = VARLEN_MIN, high: int = VARLEN_MAX, total: int = VARLEN_TOTAL,
    seed: int = VARLEN_SEED,
) -> tuple[int, ...]:
    """``count`` document lengths summing to ``total``: the first ``count - 1`` drawn uniformly from
    ``[low, high]``, the last making up the total; drawn again (from the same generator) until the
    last is in ``[low, high]`` too. Deterministic: the same seed gives the same documents."""
    rng = random.Random(seed)
    while True:
        first = [rng.randint(low, high) for _ in range(count - 1)]
        last = total - sum(first)
        if low <= last <= high:
            return (*first, last)


def format_fraction(x: float) -> str:
    """``0.125`` -> ``"1/8"``, ``1.0`` -> ``"1"``."""
    return str(Fraction(x).limit_denominator(1 << 20))


@dataclass(frozen=True)
class Case:
    """One attention problem (or one model run), benchmarked by each of ``methods`` in each of ``modes``.

    Inputs: q ``[B, Sq, H, D]``, k/v ``[B, Sk, Hkv, D]`` bf16; mask ``[1, Hkv, 1, Sk]`` bool
    (``mask="block"`` or ``"token"``), a block mask per query block (``"query-block"``) or none;
    bias ``[1, Hkv, 1, Sk]`` (``bias="key"``), ``[1, H, Sq, Sk]`` (``"full"``) bf16, or none.
    Attention is causal, aligned bottom-right when Sq != Sk. Model kinds ("train", "generate")
    take token ids ``[B, S]`` instead; their shape fields are the model's attention's.

    Packed documents (``documents``, varlen suite): q/k/v hold ``len(documents)`` documents end to
    end (``batch`` 1, ``seqlen_q == seqlen_k`` their total), each attending causally to itself
    only, and ``keep`` is the fraction of each document's own key blocks kept.
    KV-cache decode (``kv_layout``, kvcache suite): one query row per entry over a full cache of
    ``seqlen_k`` keys, contiguous or paged, with ``mask="random"`` (the fraction ``keep`` of the
    keys of each (entry, K/V head), chosen at random) and a per-key bias stored with the cache.
    """

    suite: str  # one of SUITES
    kind: str  # one of KINDS
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    keep: float  # fraction of the MASK_BLOCK-key blocks (of each query block's: "query-block") or keys kept
    methods: tuple[str, ...]
    modes: tuple[str, ...]
    bias: str = "key"  # "key" | "full" [1, H, Sq, Sk] | "pair" [1, Hkv, Sq, Sk] | "none"
    window: int | None = None  # keys per row (seed suite) or per head ("token") that ``keep`` comes from
    # "block": block top-k per key | "query-block": per query block | "token" | "random"
    # | "query-token": each query's top-k keys of a per-pair score, as a BitMask
    # | "query-index": the same selection as top-k indices (flash_dma_topk_func), with its BitMask
    # | "query-index-overlap": top-k indices of a score smooth in the query, with its BitMask
    # | "intervals": each query's top keys of the per-key bias under the causal rule, as KeyIntervals
    #   (Doge's selection, ``causal_topk_intervals``) | "none"
    mask: str = "block"
    cache: str | None = None  # "warm" | "cold" compiler caches: the first call in a new process; None: here
    documents: tuple[int, ...] | None = None  # lengths of the packed documents (varlen suite); None: unpacked
    kv_layout: str | None = None  # "contiguous" | "paged" KV cache (kvcache suite); None: no KV cache
    softcap: float = 0.0  # flash_dma_func's softcap (forms suite)
    deterministic: bool = False  # flash_dma_func's deterministic (forms suite)

    @property
    def is_decode(self) -> bool:
        """Decode rows are forward-only and timed under CUDA graphs (launch overhead removed)."""
        return self.kind == "decode"

    @property
    def is_host(self) -> bool:
        """Host rows time the host's work per call, the GPU's excluded."""
        return self.kind == "host"

    @property
    def is_model(self) -> bool:
        """Model rows run a model (a transformers Llama or Doge, the layer stack) on token ids rather
        than one attention call."""
        return self.kind in MODEL_KINDS

    @property
    def generated_tokens(self) -> int | None:
        """Tokens a serving row generates per call (one request per batch row); None for other rows."""
        return self.batch * BATCH_NEW_TOKENS if self.kind == "serve" else None

    @property
    def counts_work(self) -> bool:
        """Whether the row's time is attention kernels' time, so that TFLOP/s (and GB/s) apply."""
        return self.kind in ATTENTION_KINDS and self.cache is None

    @property
    def needs_grad(self) -> bool:
        return "fwdbwd" in self.modes

    @property
    def uses_kv_cache(self) -> bool:
        """KV-cache rows call ``flash_dma_with_kvcache`` (decode, timed under CUDA graphs)."""
        return self.kv_layout is not None

    @property
    def page_size(self) -> int | None:
        """Keys per page of a paged KV cache; None otherwise."""
        return KVCACHE_PAGE_SIZE if self.kv_layout == "paged" else None

    @property
    def key_blocks(self) -> int:
        """Key blocks (of each document, summed, for packed documents)."""
        if self.documents is not None:
            return sum(cdiv(n, MASK_BLOCK) for n in self.documents)
        return cdiv(self.seqlen_k, MASK_BLOCK)

    @property
    def kept_blocks(self) -> int:
        """Blocks kept (each document's own ``keep`` of its blocks, summed, for packed documents)."""
        if self.documents is not None:
            return sum(kept_block_count(self.keep, cdiv(n, MASK_BLOCK)) for n in self.documents)
        return kept_block_count(self.keep, self.key_blocks)

    @property
    def kept_keys(self) -> int:
        """Keys a token-level mask keeps per head (a random one: per entry and K/V head)."""
        if self.mask in ("random", "intervals"):
            return max(1, min(self.seqlen_k, round(self.keep * self.seqlen_k)))
        return min(self.window, self.seqlen_k)

    @property
    def kept_text(self) -> str:
        """What the mask keeps, for the tables: ``"4/32"`` blocks, ``"16/128 per q-block"``, ``"2048/16384 keys"``."""
        if self.mask == "none":
            return "all"
        if self.mask in ("token", "random", "intervals", *PER_QUERY_SELECTIONS):
            per_query = self.mask in (*PER_QUERY_SELECTIONS, "intervals")
            return f"{self.kept_keys}/{self.seqlen_k} keys" + (" per query" if per_query else "")
        if self.documents is not None:
            return f"{self.kept_blocks}/{self.key_blocks} per doc"
        per_query_block = " per q-block" if self.mask == "query-block" else ""
        return f"{self.kept_blocks}/{self.key_blocks}{per_query_block}"

    @property
    def label(self) -> str:
        """Short description for tables and the progress bar, e.g. ``"S=4096 keep=1/8"``."""
        if self.kind == "train":
            text = f"S={self.seqlen_k} train step"
        elif self.kind == "generate":
            text = f"prompt={self.seqlen_k} generate {GENERATE_NEW_TOKENS}"
        elif self.kind == "serve":
            text = f"{self.batch} requests, prompts up to {self.seqlen_k}, {BATCH_NEW_TOKENS} new tokens each"
        elif self.kind == "select":
            text = f"S={self.seqlen_k} one layer's key selection"
        else:
            length = f"Sk={self.seqlen_k}" if self.seqlen_q != self.seqlen_k else f"S={self.seqlen_k}"
            if 1 < self.seqlen_q != self.seqlen_k:
                length = f"Sq={self.seqlen_q} {length}"
            bias = {"full": f" bias[1,{self.heads},Sq,Sk]", "pair": f" bias[1,{self.kv_heads},Sq,Sk]"}.get(self.bias, "")
            docs = f" {len(self.documents)} docs" if self.documents is not None else ""
            layout = ""
            if self.uses_kv_cache:
                layout = f" {self.kv_layout}" + (f" {self.page_size}" if self.page_size else "")
            form = (f" softcap={self.softcap:g}" if self.softcap else "") + (" deterministic" if self.deterministic else "")
            if self.suite == "forms" and self.head_dim != LLM_SHAPE["head_dim"]:
                form += f" D={self.head_dim}"
            text = f"{length}{docs} {self._mask_text()}{bias}{layout}{form}"
        return text + CACHE_LABELS.get(self.cache, "")

    def _mask_text(self) -> str:
        if self.kind == "window":
            return f"W={self.window}"
        if self.mask == "token":
            return f"top-{self.kept_keys} keys"
        if self.mask in PER_QUERY_SELECTIONS:
            return f"top-{self.kept_keys} keys per query" + INDEX_LABELS.get(self.mask, "")
        if self.mask == "intervals":
            return f"top-{self.kept_keys} keys per query, key intervals"
        if self.mask == "none":
            return "bias only" if self.bias != "none" else "no mask, no bias"
        if self.mask == "random":
            return f"keep={format_fraction(self.keep)}" + (" random" if self.keep < 1 else "")
        per_query_block = " per q-block" if self.mask == "query-block" else ""
        return f"keep={format_fraction(self.keep)}{per_query_block}"

    def shape_text(self) -> str:
        if self.is_model:
            from flash_dma.benchmark.layers import describe_layers  # the models' modules import torch
            from flash_dma.benchmark.llama import describe_doge, describe_llama

            describe = {"doge": describe_doge, "layer": describe_layers}.get(self.suite, describe_llama)
            return f"{describe()}, B={self.batch}"
        heads = f"H={self.heads} Hkv={self.kv_heads} D={self.head_dim}"
        if self.documents is not None:
            return f"{len(self.documents)} documents packed (lengths {', '.join(map(str, self.documents))}), {heads}"
        return f"B={self.batch} {heads}"


def _window_keep(window: int, seqlen: int) -> float:
    return min(1.0, window / seqlen)


def _with_dense(
    masked_methods: tuple[str, ...], first_of_shape: bool, dense_methods: tuple[str, ...] = DENSE_METHODS,
) -> tuple[str, ...]:
    """Dense methods ignore the mask, so they run once per shape: in its first case."""
    return masked_methods + (dense_methods if first_of_shape else ())


def seed_cases(quick: bool = False) -> list[Case]:
    prefill_lengths = QUICK_SEED_PREFILL_LENGTHS if quick else SEED_PREFILL_LENGTHS
    decode_lengths = QUICK_SEED_DECODE_LENGTHS if quick else SEED_DECODE_LENGTHS
    windows = () if quick else SEED_SWEEP_WINDOWS
    cases = [
        Case("seed", "prefill", **SEED_SHAPE, seqlen_q=s, seqlen_k=s, keep=_window_keep(SEED_PREFILL_WINDOW, s),
             methods=_with_dense(MASKED_METHODS, first_of_shape=True), modes=MODES, window=SEED_PREFILL_WINDOW)
        for s in prefill_lengths
    ]
    cases += [
        Case("seed", "decode", **SEED_SHAPE, seqlen_q=1, seqlen_k=s, keep=keep,
             methods=_with_dense(MASKED_METHODS, first_of_shape=i == 0), modes=("fwd",))
        for s in decode_lengths
        for i, keep in enumerate(SEED_DECODE_KEEPS)
    ]
    # The dense and additive baselines do not depend on the window: the prefill S=32K rows hold them.
    cases += [
        Case("seed", "window", **SEED_SHAPE, seqlen_q=SEED_SWEEP_LENGTH, seqlen_k=SEED_SWEEP_LENGTH,
             keep=_window_keep(w, SEED_SWEEP_LENGTH), methods=("flash-dma", "flex"), modes=MODES, window=w)
        for w in windows
    ]
    return cases


def seedtable_cases(quick: bool = False) -> list[Case]:
    """The seeds' table at every W (the mask made from the bias itself); SDPA with the additive mask at
    the seeds' headline W only (its time does not depend on W). ``quick``: that W alone."""
    windows = (SEEDTABLE_HEADLINE_WINDOW,) if quick else SEEDTABLE_WINDOWS
    return [
        Case("seedtable", "window", **SEED_SHAPE, seqlen_q=SEEDTABLE_LENGTH, seqlen_k=SEEDTABLE_LENGTH,
             keep=_window_keep(w, SEEDTABLE_LENGTH),
             methods=PER_QUERY_METHODS + ("flash-dma-v1",)
             + (("sdpa-additive", "pack-dense") if w == SEEDTABLE_HEADLINE_WINDOW else ()),
             modes=MODES, window=w, mask="query-token", bias="pair")
        for w in windows
    ]


def pqtoken_cases(quick: bool = False) -> list[Case]:
    """One case: each query's top-2048 keys of a random per-pair score, the bias per key."""
    return [
        Case("pqtoken", "prefill", **LLM_SHAPE, seqlen_q=PQTOKEN_LENGTH, seqlen_k=PQTOKEN_LENGTH,
             keep=PQTOKEN_KEPT_KEYS / PQTOKEN_LENGTH, methods=(*PER_QUERY_METHODS, "flex", CEILING), modes=MODES,
             window=PQTOKEN_KEPT_KEYS, mask="query-token")
    ]


def topk_cases(quick: bool = False) -> list[Case]:
    """Each query's top-2048 keys as indices: at 32K against the packed per-query mask of the same
    selection, random and overlapping (neighbouring queries picking many of the same keys), and at
    128K (not with ``quick``) against dense causal attention, in the llm shape and with a wide
    group; the issue's targets."""
    selection = dict(modes=MODES, window=TOPK_KEPT_KEYS, mask="query-index")
    short = dict(seqlen_q=TOPK_LENGTH, seqlen_k=TOPK_LENGTH, keep=TOPK_KEPT_KEYS / TOPK_LENGTH)
    cases = [Case("topk", "prefill", **LLM_SHAPE, **short, methods=TOPK_METHODS, **selection)]
    if not quick:
        long = dict(seqlen_q=TOPK_LONG_LENGTH, seqlen_k=TOPK_LONG_LENGTH, keep=TOPK_KEPT_KEYS / TOPK_LONG_LENGTH)
        cases += [
            Case("topk", "prefill", **LLM_SHAPE, **short, methods=("flash-dma-topk", "flash-dma"),
                 **{**selection, "mask": "query-index-overlap"}),
            Case("topk", "prefill", **LLM_SHAPE, **long, methods=TOPK_LONG_METHODS, **selection),
            Case("topk", "prefill", **LLM_SHAPE, **long, methods=("flash-dma-topk", "flash-dma-nomask"),
                 **{**selection, "mask": "query-index-overlap"}),
            Case("topk", "prefill", **TOPK_WIDE_SHAPE, **long, methods=("flash-dma-topk",), **selection),
        ]
    return cases


def llm_cases(quick: bool = False) -> list[Case]:
    lengths = QUICK_LLM_LENGTHS if quick else LLM_LENGTHS
    keeps = QUICK_LLM_KEEPS if quick else LLM_KEEPS
    cases = [
        Case("llm", "prefill", **LLM_SHAPE, seqlen_q=s, seqlen_k=s, keep=keep,
             methods=_with_dense(LLM_MASKED_METHODS, first_of_shape=i == 0, dense_methods=LLM_DENSE_METHODS), modes=MODES)
        for s in lengths
        for i, keep in enumerate(keeps)
    ]
    if not quick:
        cases.append(
            Case("llm", "prefill", **LLM_SHAPE, seqlen_q=LLM_FULL_BIAS_LENGTH, seqlen_k=LLM_FULL_BIAS_LENGTH,
                 keep=LLM_FULL_BIAS_KEEP, methods=MASKED_METHODS, modes=MODES, bias="full")
        )
        # 128K, keep 1/8 only: keep 1 there costs about 0.1 s a forward and 0.45 s a forward +
        # backward per method. sdpa-additive is skipped by its float mask budget (512 GiB). Of
        # the dense ceilings only cuDNN runs, for the "vs cuDNN" column; FA2 would add 0.75 s a
        # call and nothing that the shorter lengths do not already show.
        cases.append(
            Case("llm", "prefill", **LLM_SHAPE, seqlen_q=LLM_LONG_LENGTH, seqlen_k=LLM_LONG_LENGTH,
                 keep=LLM_LONG_KEEP, methods=(*LLM_MASKED_METHODS, CEILING), modes=MODES)
        )
    return cases


def topkfit_cases(quick: bool = False) -> list[Case]:
    """The top-k cost model's sweep (``dispatch.TopkCosts``): at each of :data:`TOPKFIT_LENGTHS`,
    random and overlapping selections of 2048 keys per query through :data:`TOPKFIT_METHODS`,
    forward and forward+backward; then the bias plane at :data:`TOPKFIT_PLANE_LENGTH` (the packed
    mask with and without it) and a wide group (H=64) at 32K, whose chosen forward is a case of its
    own: ``quick`` runs that one row. ``flash_dma.benchmark.topk_fit`` turns the results into the
    constants."""

    def case(shape: dict, length: int, mask: str, methods: tuple[str, ...]) -> Case:
        return Case("topkfit", "prefill", **shape, seqlen_q=length, seqlen_k=length, keep=TOPK_KEPT_KEYS / length,
                    methods=methods, modes=MODES, window=TOPK_KEPT_KEYS, mask=mask)

    wide_chosen = replace(case(TOPK_WIDE_SHAPE, TOPK_LENGTH, "query-index", TOPKFIT_METHODS[:1]), modes=("fwd",))
    if quick:
        return [wide_chosen]
    cases = [case(LLM_SHAPE, length, mask, TOPKFIT_METHODS) for length in TOPKFIT_LENGTHS for mask in INDEX_SELECTIONS]
    return cases + [
        case(LLM_SHAPE, TOPKFIT_PLANE_LENGTH, "query-index", ("flash-dma-topk-indices", "flash-dma-topk-packed", "flash-dma-topk-plane")),
        case(TOPK_WIDE_SHAPE, TOPK_LENGTH, "query-index", TOPKFIT_METHODS[1:]),
        wide_chosen,
    ]


def topkq_cases(quick: bool = False) -> list[Case]:
    """One case: each query block picks its own blocks, so there is no per-call variant (the
    selection is only ever a block mask) and no float-mask SDPA (an 8 GiB ``[H, S, S]`` mask)."""
    return [
        Case("topkq", "prefill", **LLM_SHAPE, seqlen_q=TOPKQ_LENGTH, seqlen_k=TOPKQ_LENGTH, keep=TOPKQ_KEEP,
             methods=("flash-dma", "flash-dma-bits", "flex", CEILING), modes=MODES, mask="query-block")
    ]


def token_cases(quick: bool = False) -> list[Case]:
    """The token-level mask and, on the same shape, the bias alone: flash-dma's cost of the mask."""
    shape = dict(**LLM_SHAPE, seqlen_q=TOKEN_LENGTH, seqlen_k=TOKEN_LENGTH, modes=MODES)
    return [
        Case("token", "prefill", **shape, keep=TOKEN_KEPT_KEYS / TOKEN_LENGTH, methods=("flash-dma", "flex"),
             window=TOKEN_KEPT_KEYS, mask="token"),
        Case("token", "prefill", **shape, keep=1.0, methods=("flash-dma", CEILING), mask="none"),
    ]


def host_cases(quick: bool = False) -> list[Case]:
    """The seeds' call at S=128 (their 2048-key window keeps every key there), and a bare call."""
    shape = dict(**SEED_SHAPE, seqlen_q=HOST_LENGTH, seqlen_k=HOST_LENGTH, keep=1.0, methods=HOST_METHODS, modes=MODES)
    return [
        Case("host", "host", **shape, window=SEED_PREFILL_WINDOW, mask="token"),
        Case("host", "host", **shape, mask="none", bias="none"),
    ]


def llama_cases(quick: bool = False) -> list[Case]:
    lengths = QUICK_LLAMA_LENGTHS if quick else LLAMA_LENGTHS
    return [
        Case("llama", "train", **LLM_SHAPE, seqlen_q=s, seqlen_k=s, keep=1.0, methods=LLAMA_METHODS,
             modes=("fwdbwd",), mask="none", bias="none")
        for s in lengths
    ]


def doge_cases(quick: bool = False) -> list[Case]:
    lengths = DOGE_LENGTHS[:1] if quick else DOGE_LENGTHS
    return [
        Case("doge", "train", **DOGE_SHAPE, seqlen_q=s, seqlen_k=s, keep=1.0, methods=DOGE_METHODS, modes=("fwdbwd",),
             mask="none", bias="none")
        for s in lengths
    ]


def batching_cases(quick: bool = False) -> list[Case]:
    """One serving workload (:data:`BATCH_PROMPT_LENGTHS`), one request per row."""
    shape = dict(LLM_SHAPE, batch=len(BATCH_PROMPT_LENGTHS))
    longest = max(BATCH_PROMPT_LENGTHS)
    return [Case("batching", "serve", **shape, seqlen_q=longest, seqlen_k=longest, keep=1.0, methods=BATCHING_METHODS,
                 modes=("fwd",), mask="none", bias="none")]


def layer_cases(quick: bool = False) -> list[Case]:
    """The layer stack's train step, sparse and dense, and one layer's selection alone (forward)."""
    shape = dict(batch=1, heads=LAYER_CONFIG["num_heads"], kv_heads=LAYER_CONFIG["num_kv_heads"],
                 head_dim=LAYER_CONFIG["hidden_size"] // LAYER_CONFIG["num_heads"], seqlen_q=LAYER_LENGTH,
                 seqlen_k=LAYER_LENGTH, keep=LAYER_CONFIG["window_size"] / LAYER_LENGTH, mask="none", bias="none")
    return [
        Case("layer", "train", **shape, methods=LAYER_METHODS, modes=("fwdbwd",)),
        Case("layer", "select", **shape, methods=("layer-select",), modes=("fwd",)),
    ]


def first_call_cases(quick: bool = False) -> list[Case]:
    """A first-time user's call (no block mask built beforehand), then the Llama's first generate and step."""
    attention = dict(**LLM_SHAPE, seqlen_q=FIRST_CALL_LENGTH, seqlen_k=FIRST_CALL_LENGTH, keep=FIRST_CALL_KEEP,
                     methods=("flash-dma-percall",), modes=MODES)
    model = dict(**LLM_SHAPE, keep=1.0, methods=("llama-flash-dma",), mask="none", bias="none", cache="warm")
    cases = [Case("firstcall", "prefill", **attention, cache="warm")]
    if not quick:
        cases += [
            Case("firstcall", "prefill", **attention, cache="cold"),
            Case("firstcall", "generate", **model, seqlen_q=LLAMA_PROMPT_LENGTH, seqlen_k=LLAMA_PROMPT_LENGTH,
                 modes=("fwd",)),
            Case("firstcall", "train", **model, seqlen_q=FIRST_CALL_LENGTH, seqlen_k=FIRST_CALL_LENGTH,
                 modes=("fwdbwd",)),
        ]
    return cases


def varlen_cases(quick: bool = False) -> list[Case]:
    """One case, already a sanity-sized run (one Flex compilation), so ``quick`` keeps it whole."""
    documents = document_lengths()
    return [
        Case("varlen", "prefill", **{**LLM_SHAPE, "batch": 1}, seqlen_q=sum(documents), seqlen_k=sum(documents),
             keep=VARLEN_KEEP, methods=VARLEN_METHODS, modes=MODES, documents=documents)
    ]


def kvcache_cases(quick: bool = False) -> list[Case]:
    """B=8 over a 32K cache, keep 1 and 1/8, contiguous and paged; then B=1 over 512K, keep 1/8.

    ``quick``: keep 1/8 only (both layouts, for the paged/contiguous ratio) and the 512K row.
    """
    keeps = QUICK_KVCACHE_KEEPS if quick else KVCACHE_KEEPS
    decode = dict(seqlen_q=1, methods=KVCACHE_METHODS, modes=("fwd",), mask="random")
    cases = [
        Case("kvcache", "decode", **KVCACHE_SHAPE, seqlen_k=KVCACHE_LENGTH, keep=keep, kv_layout=layout, **decode)
        for keep in keeps
        for layout in KVCACHE_LAYOUTS
    ]
    cases.append(
        Case("kvcache", "decode", **KVCACHE_LONG_SHAPE, seqlen_k=KVCACHE_LONG_LENGTH, keep=KVCACHE_LONG_KEEP,
             kv_layout="contiguous", **decode)
    )
    return cases


def forms_cases(quick: bool = False) -> list[Case]:
    """The plain llm call at 16K keep 1/8 (and its FP8 forward, also at keep 1), then the same call
    in each other form (softcap, deterministic gradients, and each query's top 1/8 of the keys by
    the bias as key intervals, Doge's selection), a chunk of prefill over a KV cache (contiguous,
    and paged at keep 1) against the same problem without one, the plain call's forward at 4K
    (bf16 and FP8), and the llm call at other head dims against Flex; ``quick`` leaves out the last
    two (the head dims cost a Flex compilation each)."""
    plain = Case("forms", "prefill", **LLM_SHAPE, seqlen_q=FORMS_LENGTH, seqlen_k=FORMS_LENGTH, keep=FORMS_KEEP,
                 methods=("flash-dma", "flash-dma-fp8"), modes=MODES)
    single = replace(plain, methods=("flash-dma",))
    prefill = Case(
        "forms", "prefill", **LLM_SHAPE, seqlen_q=FORMS_PREFILL_QUERIES, seqlen_k=FORMS_CACHE_LENGTH, keep=FORMS_KEEP,
        methods=("flash-dma-kvcache", "flash-dma-nocache"), modes=("fwd",), mask="random", kv_layout="contiguous",
    )
    forms = [
        plain, replace(plain, keep=1, modes=("fwd",)),
        replace(single, softcap=FORMS_SOFTCAP), replace(single, deterministic=True, modes=("fwdbwd",)),
        replace(single, mask="intervals"),
        prefill,
        # Every key kept (no mask): a paged cache's pages read whole, against the contiguous call without a cache.
        replace(prefill, keep=1, methods=("flash-dma-nocache",)),
        replace(prefill, keep=1, methods=("flash-dma-kvcache",), kv_layout="paged"),
    ]
    if quick:  # one Flex compilation per head dim and mode: minutes
        return forms
    short = replace(plain, seqlen_q=FORMS_FP8_SHORT_LENGTH, seqlen_k=FORMS_FP8_SHORT_LENGTH, modes=("fwd",))
    return [*forms, short, *(replace(plain, head_dim=head_dim, methods=("flash-dma", "flex")) for head_dim in FORMS_HEAD_DIMS)]


BUILDERS = {
    "llm": llm_cases,
    "seedtable": seedtable_cases,
    "pqtoken": pqtoken_cases,
    "topk": topk_cases,
    "topkq": topkq_cases,
    "token": token_cases,
    "seed": seed_cases,
    "host": host_cases,
    "llama": llama_cases,
    "doge": doge_cases,
    "batching": batching_cases,
    "layer": layer_cases,
    "firstcall": first_call_cases,
    "varlen": varlen_cases,
    "kvcache": kvcache_cases,
    "forms": forms_cases,
    "topkfit": topkfit_cases,
}


def build_cases(
    suite: str = "all", quick: bool = False, modes=MODES, methods=None, lengths=None, keeps=None,
) -> list[Case]:
    """The cases of ``suite`` (one of :data:`SUITES`, or "all"), keeping only the given modes and methods,
    and, when given, the cases whose key length is in ``lengths`` and whose ``keep`` is in ``keeps``.

    A case left with no mode or no method is dropped (``--mode fwdbwd`` drops the decode cases).
    """
    if suite not in (*SUITES, "all"):
        raise ValueError(f"suite: expected one of {SUITES + ('all',)}, got {suite!r}")
    cases = [case for name in SUITES if suite in (name, "all") for case in BUILDERS[name](quick)]
    selected = []
    for case in cases:
        if (lengths is not None and case.seqlen_k not in lengths) or (keeps is not None and case.keep not in keeps):
            continue
        case_modes = tuple(m for m in case.modes if m in modes)
        case_methods = tuple(m for m in case.methods if methods is None or m in methods)
        if case_modes and case_methods:
            selected.append(replace(case, modes=case_modes, methods=case_methods))
    return selected
