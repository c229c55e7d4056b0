"""The benchmark cases: shapes, mask sparsity, and which methods and passes run on each.

Two suites:

- ``llm``: a GQA model layer (B=1, H=16, Hkv=4, D=128) at 4K-32K with 1 to 1/32 of the key
  blocks kept, plus one case whose bias is per query and key.
- ``seed``: the shapes of the project's seeds (B=1, H=2, Hkv=1, D=64): prefill with a
  2048-key window, decode (one query row) over long caches, and a window sweep at S=32K.

Masks are per key (``[1, Hkv, 1, Sk]``) and keep whole blocks of :data:`MASK_BLOCK` keys, so a
case's sparsity is the fraction ``keep`` of its key blocks. Dense methods ignore the mask, so
they run only in the first case of each shape (the one with the most blocks kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from flash_dma.block_mask import cdiv

MASK_BLOCK = 128  # keys per block of the top-k mask: the default block of flash-dma and Flex
# Run order: the llm suite holds most targets, so a run cut short has them first.
SUITES = ("llm", "seed")
MODES = ("fwd", "fwdbwd")

MASKED_METHODS = ("flash-dma", "flex", "sdpa-additive")
DENSE_METHODS = ("sdpa-flash", "sdpa-cudnn")
# The per-call summary variant shows what reusing the block mask saves; one suite is enough.
LLM_MASKED_METHODS = ("flash-dma", "flash-dma-percall", "flex", "sdpa-additive")

SEED_SHAPE = {"batch": 1, "heads": 2, "kv_heads": 1, "head_dim": 64}
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

# --quick: a few rows per suite, with one Flex compilation per suite.
QUICK_SEED_PREFILL_LENGTHS = (4096,)
QUICK_SEED_DECODE_LENGTHS = (524288,)
QUICK_LLM_LENGTHS = (4096,)
QUICK_LLM_KEEPS = (1.0, 1 / 8)


def kept_block_count(keep: float, num_blocks: int) -> int:
    """Blocks a mask keeping the fraction ``keep`` of ``num_blocks`` holds: at least one."""
    return max(1, min(num_blocks, round(keep * num_blocks)))


def format_fraction(x: float) -> str:
    """``0.125`` -> ``"1/8"``, ``1.0`` -> ``"1"``."""
    return str(Fraction(x).limit_denominator(1 << 20))


@dataclass(frozen=True)
class Case:
    """One attention problem, benchmarked by each of ``methods`` in each of ``modes``.

    Inputs: q ``[B, Sq, H, D]``, k/v ``[B, Sk, Hkv, D]`` bf16; mask ``[1, Hkv, 1, Sk]`` bool;
    bias ``[1, Hkv, 1, Sk]`` (``bias="key"``) or ``[1, H, Sq, Sk]`` (``bias="full"``) bf16.
    Attention is causal, aligned bottom-right when Sq != Sk.
    """

    suite: str  # "seed" | "llm"
    kind: str  # "prefill" | "decode" | "window"
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    keep: float  # fraction of the MASK_BLOCK-key blocks the mask keeps, per head
    methods: tuple[str, ...]
    modes: tuple[str, ...]
    bias: str = "key"
    window: int | None = None  # keys per row that ``keep`` was derived from (seed suite)

    @property
    def is_decode(self) -> bool:
        """Decode rows are forward-only and timed under CUDA graphs (launch overhead removed)."""
        return self.kind == "decode"

    @property
    def needs_grad(self) -> bool:
        return "fwdbwd" in self.modes

    @property
    def key_blocks(self) -> int:
        return cdiv(self.seqlen_k, MASK_BLOCK)

    @property
    def kept_blocks(self) -> int:
        return kept_block_count(self.keep, self.key_blocks)

    @property
    def label(self) -> str:
        """Short description for tables and the progress bar, e.g. ``"S=4096 keep=1/8"``."""
        length = f"Sk={self.seqlen_k}" if self.seqlen_q != self.seqlen_k else f"S={self.seqlen_k}"
        sparsity = f"W={self.window}" if self.kind == "window" else f"keep={format_fraction(self.keep)}"
        bias = f" bias[1,{self.heads},Sq,Sk]" if self.bias == "full" else ""
        return f"{length} {sparsity}{bias}"

    def shape_text(self) -> str:
        return f"B={self.batch} H={self.heads} Hkv={self.kv_heads} D={self.head_dim}"


def _window_keep(window: int, seqlen: int) -> float:
    return min(1.0, window / seqlen)


def _with_dense(masked_methods: tuple[str, ...], first_of_shape: bool) -> tuple[str, ...]:
    """Dense methods ignore the mask, so they run once per shape: in its first case."""
    return masked_methods + (DENSE_METHODS if first_of_shape else ())


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


def llm_cases(quick: bool = False) -> list[Case]:
    lengths = QUICK_LLM_LENGTHS if quick else LLM_LENGTHS
    keeps = QUICK_LLM_KEEPS if quick else LLM_KEEPS
    cases = [
        Case("llm", "prefill", **LLM_SHAPE, seqlen_q=s, seqlen_k=s, keep=keep,
             methods=_with_dense(LLM_MASKED_METHODS, first_of_shape=i == 0), modes=MODES)
        for s in lengths
        for i, keep in enumerate(keeps)
    ]
    if not quick:
        cases.append(
            Case("llm", "prefill", **LLM_SHAPE, seqlen_q=LLM_FULL_BIAS_LENGTH, seqlen_k=LLM_FULL_BIAS_LENGTH,
                 keep=LLM_FULL_BIAS_KEEP, methods=MASKED_METHODS, modes=MODES, bias="full")
        )
    return cases


def build_cases(suite: str = "all", quick: bool = False, modes=MODES, methods=None) -> list[Case]:
    """The cases of ``suite`` ("seed", "llm" or "all"), keeping only the given modes and methods.

    A case left with no mode or no method is dropped (``--mode fwdbwd`` drops the decode cases).
    """
    if suite not in (*SUITES, "all"):
        raise ValueError(f"suite: expected one of {SUITES + ('all',)}, got {suite!r}")
    builders = {"llm": llm_cases, "seed": seed_cases}
    cases = [case for name in SUITES if suite in (name, "all") for case in builders[name](quick)]
    selected = []
    for case in cases:
        case_modes = tuple(m for m in case.modes if m in modes)
        case_methods = tuple(m for m in case.methods if methods is None or m in methods)
        if case_modes and case_methods:
            selected.append(replace(case, modes=case_modes, methods=case_methods))
    return selected
