"""Test cases, input factories and the error-tolerance rule shared by the suites.

Tolerance follows FlashAttention's tests: a result in dtype X is compared with the float64
reference, and its error may be at most twice the error of PyTorch computing the same thing
in dtype X (the reference backend run with ``compute_dtype=X``), plus a small floor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import pytest
import torch

from flash_dma.backends.reference import reference_attention, reference_topk_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def seeded_generator(label: str) -> torch.Generator:
    """A CPU generator seeded from ``label``, the same in every process (``hash`` is salted per process)."""
    seed = int.from_bytes(hashlib.sha256(label.encode()).digest()[:4], "little")
    return torch.Generator(device="cpu").manual_seed(seed)
# Marks of the tests of the Hopper (Gluon) kernels: sm90 only; elsewhere test_compiles_for_gpu compiles them.
HOPPER_ONLY = [
    pytest.mark.gpu_only,
    pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.get_device_capability()[0] != 9, reason="the Hopper kernels need sm90"),
]
ON_GPU = DEVICE.type == "cuda"
# A test that repeats a call and wants the same bits: on a GPU the programs of a grid, and their
# atomics, run in an order that varies from launch to launch. The interpreter runs them one at a
# time in one order, so a repeat there could differ only by an output element left unwritten,
# which the poisoned outputs of the fuzz harness and the reference comparisons catch.
REPEATS_ON_GPU = pytest.mark.skipif(not ON_GPU, reason="a bitwise repeat: the interpreter runs programs in one fixed order")
# The Triton interpreter cannot do bf16, so kernels are tested in fp32/fp16 on the CPU.
KERNEL_DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32, torch.float16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def compiling_environment() -> dict[str, str]:
    """This process's environment for a child that compiles kernels, as on a GPU machine: without
    TRITON_INTERPRET (there ``@triton.jit`` makes compilable functions, with cache keys), the
    repository first on its PYTHONPATH."""
    import os
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    return env


def case_dtypes(cases) -> list:
    """The ``case, dtype`` parameters of a kernel sweep, with ids ``<case>-<dtype>``. On the GPU each
    case runs in each of KERNEL_DTYPES. On the CPU, where the interpreter takes seconds a case, each
    case runs in one of them, picked by a hash of its id, so that both dtypes meet every form of the
    sweep while `make test` keeps to its time (README, "The two commands")."""
    if ON_GPU:
        pairs = [(case, dtype) for dtype in KERNEL_DTYPES for case in cases]
    else:
        pairs = [(case, KERNEL_DTYPES[hashlib.sha256(str(case).encode()).digest()[0] % len(KERNEL_DTYPES)]) for case in cases]
    return [pytest.param(case, dtype, id=f"{case}-{DTYPE_IDS[dtype]}") for case, dtype in pairs]


@dataclass(frozen=True)
class Case:
    """One attention problem. Mask and bias shapes are written like ``"B,Hkv,1,Sk"``."""

    batch: int = 2
    seqlen_q: int = 17
    seqlen_k: int = 17
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mask: str | None = None
    bias: str | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    # "random": each element kept with probability 1/2; "blocks": 16x16 blocks that are empty,
    # full or random ("tiles": 128x128 blocks, whole kernel tiles); "rows": random, with about a
    # quarter of the query rows fully masked.
    mask_kind: str = "random"
    bias_fp32: bool = False
    # Block summary passed explicitly (small blocks make short sequences span many blocks);
    # None lets the backend summarise the mask itself.
    block_size: tuple[int, int] | None = None
    # Without a summary, small problems read the mask on every tile; "listed" makes the backend
    # walk them as it walks large ones (key lists, or a summary it builds).
    listed: bool = False
    # The mask passed packed, as a BitMask (with its own summary, in blocks of block_size).
    packed: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        parts = [
            f"B{self.batch}-Sq{self.seqlen_q}-Sk{self.seqlen_k}-H{self.heads}-Hkv{self.kv_heads}-D{self.head_dim}"
        ]
        if self.mask:
            parts.append(f"mask[{self.mask}]" + ("" if self.mask_kind == "random" else f"{self.mask_kind}"))
        if self.bias:
            parts.append(f"bias[{self.bias}]" + ("fp32" if self.bias_fp32 else ""))
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.block_size and self.mask:
            parts.append(f"blk{self.block_size[0]}x{self.block_size[1]}")
        if self.listed:
            parts.append("listed")
        if self.packed:
            parts.append("packed")
        return "-".join(parts)

    def with_(self, **changes) -> "Case":
        return replace(self, **changes)

    def dims(self, spec: str) -> tuple[int, ...]:
        sizes = {
            "1": 1,
            "B": self.batch,
            "H": self.heads,
            "Hkv": self.kv_heads,
            "Sq": self.seqlen_q,
            "Sk": self.seqlen_k,
        }
        return tuple(sizes[s] for s in spec.split(","))

    def generator(self, salt: str = "") -> torch.Generator:
        return seeded_generator(f"{self}{salt}")


# Masks and block sizes that every block-summary builder is checked on.
SUMMARY_BLOCK_SIZES = ((16, 16), (32, 64), (128, 128))
SUMMARY_CASES = (
    Case(seqlen_q=130, seqlen_k=239, mask="B,H,Sq,Sk", mask_kind="blocks"),
    Case(seqlen_q=63, seqlen_k=130, mask="1,Hkv,1,Sk", mask_kind="blocks"),
    Case(seqlen_q=17, seqlen_k=63, mask="B,1,Sq,1", mask_kind="rows"),
    Case(seqlen_q=1, seqlen_k=1, mask="1,1,1,1"),
)


def make_mask(case: Case, gen: torch.Generator, device=DEVICE) -> torch.Tensor | None:
    if case.mask is None:
        return None
    shape = case.dims(case.mask)
    mask = torch.rand(shape, generator=gen) < 0.5
    if case.mask_kind in ("blocks", "tiles"):
        # Blocks empty, full or left random, so that whole tiles are skipped or taken.
        block = 16 if case.mask_kind == "blocks" else 128
        nq, nk = -(-shape[2] // block), -(-shape[3] // block)
        kind = torch.randint(0, 3, (*shape[:2], nq, nk), generator=gen)
        kind = kind.repeat_interleave(block, 2).repeat_interleave(block, 3)[..., : shape[2], : shape[3]]
        mask = torch.where(kind == 0, False, torch.where(kind == 1, True, mask))
    elif case.mask_kind == "rows":
        dead = torch.rand(*shape[:3], 1, generator=gen) < 0.25
        mask = mask & ~dead
    elif case.mask_kind != "random":
        raise ValueError(case.mask_kind)
    return mask.to(device)


_GUARD = 4096


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` living inside a NaN-filled buffer: an out-of-bounds read brings NaN into the result."""
    buffer = torch.full((t.numel() + 2 * _GUARD,), float("nan"), dtype=t.dtype, device=t.device)
    view = buffer[_GUARD : _GUARD + t.numel()].view(t.shape)
    view.copy_(t)
    return view.detach()


def poisoned_empty(real_empty):
    """``torch.empty`` that fills float tensors with NaN and integer ones with a large value."""

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        with torch.no_grad():  # callers may ask for requires_grad=True
            t.fill_(float("nan") if t.dtype.is_floating_point else True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)
        return t

    return empty


def make_inputs(case: Case, dtype: torch.dtype, device=DEVICE, requires_grad: bool = False) -> dict:
    """Fresh random inputs for ``case`` (seeded by the case, so a failure reproduces)."""
    gen = case.generator()
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, generator=gen)
    k = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, generator=gen)
    v = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, generator=gen)
    bias = None
    if case.bias is not None:
        bias = torch.randn(case.dims(case.bias), generator=gen).to(device, torch.float32 if case.bias_fp32 else dtype)
    q, k, v = (guarded(t.to(device, dtype)).requires_grad_(requires_grad) for t in (q, k, v))
    if bias is not None:
        bias = guarded(bias.detach()).requires_grad_(requires_grad)
    return {
        "query": q,
        "key": k,
        "value": v,
        "attn_mask": make_mask(case, gen, device),
        "attn_bias": bias,
    }


def hopper_passes(monkeypatch, passes=("forward", "dkdv", "dq")) -> list[str]:
    """Record each of ``passes`` that a call runs on the Hopper kernels, so that a test meant for
    them can check that they ran (and not the Triton kernels in their place).

    A pass is recorded where its Hopper kernel launches, once per launch, not where it is routed:
    the routing is memoised per layout, and a call's dry run (``launch.py``, "Compiling ahead"), which
    goes through the same host code launching nothing, may be the one that routes it. What the dry
    run reaches is left out (``flash_dma.memo.dry_running``).
    """
    from flash_dma.backends.triton import backward, forward
    from flash_dma.memo import dry_running

    taken = []

    def recorded(pass_, launch):
        def launched(*args):
            if not dry_running():
                taken.append(pass_)
            return launch(*args)

        return launched

    modules = {"forward": forward, "dkdv": backward, "dq": backward}
    for pass_ in passes:
        name = f"hopper_{pass_}"
        monkeypatch.setattr(modules[pass_], name, recorded(pass_, getattr(modules[pass_], name)))
    return taken


def make_fp8_inputs(case: Case, device=DEVICE) -> tuple[dict, dict, torch.Tensor]:
    """``(fp8_inputs, dequantized, descale)``: ``case``'s inputs quantized to e4m3 with random
    descale factors ``[B, Hkv, 3]`` (a bias in bfloat16, or float32), and their exact float32 values."""
    from flash_dma.inputs import FP8_DTYPE, dequantize, head_descale

    inputs = make_inputs(case, torch.float32, device)
    descale = (0.5 + 1.5 * torch.rand(case.batch, case.kv_heads, 3, generator=case.generator("descale"))).to(device)
    quantized, exact = dict(inputs), dict(inputs)
    for i, name in enumerate(("query", "key", "value")):
        quantized[name] = (inputs[name] / head_descale(descale[..., i], inputs[name].shape[2])).to(FP8_DTYPE)
        exact[name] = dequantize(quantized[name], descale[..., i])
    if inputs["attn_bias"] is not None and not case.bias_fp32:
        quantized["attn_bias"] = exact["attn_bias"] = inputs["attn_bias"].to(torch.bfloat16)
    return quantized, exact, descale


def call_kwargs(case: Case) -> dict:
    return {"is_causal": case.causal, "window_size": case.window, "softcap": case.softcap}


def triton_call(case: Case, inputs: dict, **kwargs):
    """``flash_dma_func`` on the Triton backend, with the case's block summary if it names one."""
    import flash_dma.backends.triton as triton_backend
    from flash_dma import build_block_mask, flash_dma_func, pack_mask

    if case.packed:
        inputs = {**inputs, "attn_mask": pack_mask(inputs["attn_mask"], block_size=case.block_size)}
    elif case.block_size and inputs["attn_mask"] is not None:
        kwargs.setdefault("block_mask", build_block_mask(inputs["attn_mask"], block_size=case.block_size))
    small = triton_backend.SMALL_PROBLEM
    triton_backend.SMALL_PROBLEM = 0 if case.listed else small
    try:
        return flash_dma_func(**inputs, **call_kwargs(case), backend="triton", **kwargs)
    finally:
        triton_backend.SMALL_PROBLEM = small


# The Hopper kernels' per-query forms (tests/backends/triton/test_*_hopper.py): BitMasks (bits read
# on PARTIAL tiles, FULL and EMPTY tiles from the summary), biases per pair (read per tile; their
# gradients written per tile, added over a group's heads in registers, or by atomics where
# programs share them), and masks and biases per query row (read once per work item).
# The seeds' form: one bias and one mask shared by the group's heads, causal.
# (Sk a multiple of 8 at D = 64: the loader stages the bias with TMA, and dK/dV stores its gradient so.)
SEED_FORM_CASE = Case(
    batch=1, seqlen_q=1000, seqlen_k=1000, heads=2, kv_heads=1, head_dim=64, mask="1,1,Sq,Sk", bias="1,1,Sq,Sk", causal=True, packed=True,
    block_size=(128, 128),
)
HOPPER_PAIR_CASES = [
    SEED_FORM_CASE,
    Case(seqlen_q=904, seqlen_k=1000, heads=4, kv_heads=2, head_dim=64, mask="B,Hkv,Sq,Sk", bias="B,H,Sq,Sk", mask_kind="tiles", causal=True, packed=True, block_size=(128, 128)),
    Case(seqlen_q=1023, seqlen_k=1024, heads=2, kv_heads=1, head_dim=64, mask="1,1,Sq,Sk", bias="1,1,Sq,Sk", window=(300, 0), packed=True, block_size=(128, 128)),
    Case(seqlen_q=700, seqlen_k=900, head_dim=128, mask="B,Hkv,Sq,Sk", bias="B,H,Sq,Sk", mask_kind="tiles", causal=True, packed=True, block_size=(128, 128)),
    Case(seqlen_q=500, seqlen_k=700, heads=4, kv_heads=2, head_dim=64, mask="B,H,Sq,Sk", bias="1,Hkv,Sq,Sk", window=(100, 3), packed=True, block_size=(128, 128)),
    Case(seqlen_q=300, seqlen_k=63, heads=3, kv_heads=1, head_dim=128, mask="B,Hkv,Sq,Sk", bias="B,Hkv,1,Sk", causal=True, packed=True, block_size=(128, 128)),
    Case(seqlen_q=600, seqlen_k=777, head_dim=64, mask="1,Hkv,Sq,Sk", bias="B,1,Sq,Sk", mask_kind="tiles", packed=True, block_size=(256, 256)),
    Case(seqlen_q=17, seqlen_k=1023, head_dim=64, bias="1,1,Sq,Sk", bias_fp32=True, causal=True),
    Case(seqlen_q=1023, seqlen_k=1023, head_dim=128, mask="B,H,Sq,1", bias="1,Hkv,Sq,1", mask_kind="rows", causal=True),
    Case(seqlen_q=300, seqlen_k=400, head_dim=64, mask="B,Hkv,1,Sk", bias="B,H,Sq,1", causal=True, block_size=(128, 128)),
    Case(batch=2, seqlen_q=2048, seqlen_k=2048, heads=8, kv_heads=2, head_dim=128, mask="B,Hkv,Sq,Sk", bias="B,Hkv,1,Sk", mask_kind="tiles", causal=True, packed=True, block_size=(128, 128)),
]


def kernel_call(
    inputs: dict, summary=None, key_list=None, *, softmax_scale: float, window=(-1, -1), softcap: float = 0.0,
    deterministic: bool = False, mask=None,
):
    """The Triton backend's :class:`~flash_dma.backends.triton.layout.Call` of ``inputs``, walked by
    ``summary`` (a ``BlockMask``) or ``key_list``, for tests that launch kernels directly. ``mask``
    overrides the inputs' (a BitMask's words make the call read bits)."""
    from flash_dma.backends.triton import walk_fields
    from flash_dma.backends.triton.layout import Call
    from flash_dma.bit_mask import BitMask

    mask = inputs["attn_mask"] if mask is None else mask
    kind = "elements"
    if isinstance(mask, BitMask):
        mask, summary, kind = mask.words, mask.summary, "bits"
    call = Call(
        inputs["query"], inputs["key"], inputs["value"], None if key_list is not None else mask, inputs["attn_bias"],
        None, None, key_list, None, None, None, 0, 0, softmax_scale, *window, softcap, deterministic, 0, 0, kind,
    )
    if summary is None:
        return call
    return call._replace(**walk_fields(summary.state, summary.block_size, summary.kv_lists, summary.q_lists))


def listed_variants(cases: list[Case]) -> list[Case]:
    """The cases with a mask and no summary again, walked as large problems are."""
    return [case.with_(listed=True) for case in cases if case.mask and not case.block_size]


def packed_variants(cases: list[Case]) -> list[Case]:
    """The cases with a mask again, the mask packed into a BitMask (whose key blocks hold whole words)."""
    return [
        case.with_(packed=True, block_size=((case.block_size or (16, 32))[0], max(32, (case.block_size or (16, 32))[1])))
        for case in cases
        if case.mask
    ]


def reference_outputs(case: Case, inputs: dict, dout: torch.Tensor | None, compute_dtype: torch.dtype, **kwargs):
    """``(out, lse, grads)`` of the reference backend computing in ``compute_dtype``.

    Inputs are cast to ``compute_dtype`` when it is float64 (the oracle) and kept otherwise
    (PyTorch's own error in the input dtype). Grads are for q, k, v and bias, when ``dout`` is given.
    """
    window = (case.window[0], 0) if case.causal else case.window
    cast = (lambda t: t.detach().double()) if compute_dtype == torch.float64 else (lambda t: t.detach())
    leaves = {
        name: cast(inputs[name]).requires_grad_(dout is not None)
        for name in ("query", "key", "value", "attn_bias")
        if inputs[name] is not None
    }
    out, lse = reference_attention(
        leaves["query"],
        leaves["key"],
        leaves["value"],
        inputs["attn_mask"],
        leaves.get("attn_bias"),
        window=window,
        softcap=case.softcap,
        compute_dtype=compute_dtype,
        **kwargs,
    )
    grads = {}
    if dout is not None:
        out.backward(cast(dout))
        grads = {name: t.grad for name, t in leaves.items()}
    return out.detach(), lse, grads


def topk_reference_outputs(inputs: dict, dout: torch.Tensor, compute_dtype: torch.dtype, window, **kwargs):
    """``(out, lse, grads)`` of ``flash_dma_topk_func``'s reference computing in ``compute_dtype``,
    cast as :func:`reference_outputs` casts; ``window`` with causal folded in."""
    cast = (lambda t: t.detach().double()) if compute_dtype == torch.float64 else (lambda t: t.detach())
    leaves = {
        name: cast(inputs[name]).requires_grad_(inputs[name].requires_grad)
        for name in ("query", "key", "value", "attn_bias")
        if inputs[name] is not None
    }
    out, lse = reference_topk_attention(
        leaves["query"], leaves["key"], leaves["value"], inputs["indices"], leaves.get("attn_bias"),
        window=window, compute_dtype=compute_dtype, **kwargs,
    )
    out.backward(cast(dout))
    return out.detach(), lse.detach(), {name: t.grad for name, t in leaves.items() if t.requires_grad}


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max absolute difference; equal infinities (the -inf LSE of an empty row) count as exact."""
    if actual.numel() == 0:
        return 0.0
    actual, expected = actual.double(), expected.double()
    return torch.where(actual == expected, 0.0, actual - expected).abs().max().item()


def _magnitude(t: torch.Tensor) -> float:
    finite = t[t.isfinite()]
    return finite.abs().max().item() if finite.numel() else 0.0


def assert_close(name: str, actual, oracle, baseline, floor: float = 1e-5) -> None:
    """``|actual - oracle| <= 2 |baseline - oracle| + floor * max(1, |oracle|)`` (max norm), no NaN."""
    assert actual.shape == oracle.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(oracle.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    error = max_error(actual, oracle)
    allowed = 2 * max_error(baseline, oracle) + floor * max(1.0, _magnitude(oracle))
    assert error <= allowed, f"{name}: max error {error:.3e} > allowed {allowed:.3e}"


def assert_gradients_close(inputs: dict, oracle: dict, baseline: dict) -> None:
    """Each leaf's ``.grad`` has its dtype and shape and passes :func:`assert_close`."""
    for name, expected in oracle.items():
        grad = inputs[name].grad
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        assert_close(name, grad, expected, baseline[name])


# Every broadcast pattern of a mask or bias that the contract allows, for [B, H, Sq, Sk].
BROADCAST_SHAPES = (
    "B,H,Sq,Sk",
    "B,Hkv,Sq,Sk",
    "1,1,Sq,Sk",
    "B,Hkv,1,Sk",
    "1,H,1,Sk",
    "B,1,1,Sk",
    "1,Hkv,Sq,1",
    "B,H,Sq,1",
    "1,1,1,1",
)


def broadcast_cases(base: Case) -> list[Case]:
    """Each broadcast shape once as the mask and once as the bias, paired with a rotating partner."""
    cases = []
    for i, shape in enumerate(BROADCAST_SHAPES):
        partner = BROADCAST_SHAPES[(i + 3) % len(BROADCAST_SHAPES)]
        cases.append(base.with_(mask=shape, bias=partner))
        cases.append(base.with_(mask=partner, bias=shape, bias_fp32=i % 2 == 0))
    return cases


def run_tool(script: str, *args: str, check: bool = False, **env: str):
    """``tools/<script>`` run in a new process from the repository root, with ``env`` added to this
    process's environment: its completed process, output captured (a non-zero exit fails the test
    with ``check``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, f"tools/{script}", *args], cwd=repo, capture_output=True, text=True, check=check,
        env={**os.environ, "PYTHONPATH": str(repo), **env},
    )


def run_tool_on_cpu(script: str, *args: str):
    """``tools/<script>`` on the CPU (the Triton interpreter): :func:`run_tool`, a non-zero exit
    failing the test."""
    return run_tool(script, "--device", "cpu", *args, check=True, TRITON_INTERPRET="1")


def speed_up_interpreter() -> None:
    """Two savings for Triton's interpreter, neither changing what a kernel computes or reports:
    :func:`scan_interpreter_builtins_once` and :func:`skip_dropped_overflow_checks`."""
    scan_interpreter_builtins_once()
    skip_dropped_overflow_checks()


def skip_dropped_overflow_checks() -> None:
    """Skip the interpreter's integer-overflow checks whose verdict would be thrown away.

    On every +, - and * of 32-bit integers, Triton's front end casts both sides to int64, redoes the
    operation and compares it with both bounds (``binary_op_sanitize_overflow_impl``), then hands
    the result to ``device_assert``, which drops it unless the options ask for debugging (triton
    3.6 to 3.9; the interpreter's options never do). Under the interpreter that work is numpy calls
    on every index computation: a third of a backward's time on the CPU. Here the check runs only
    when its assert would; tests/test_helpers.py checks that premise on the installed Triton."""
    from triton.language.semantic import TritonSemantic

    check = TritonSemantic.binary_op_sanitize_overflow_impl
    if getattr(check, "checks_only_when_asserted", False):
        return

    def check_when_asserted(self, lhs, rhs, binary_op):
        if self.builder.options.debug:
            check(self, lhs, rhs, binary_op)

    check_when_asserted.checks_only_when_asserted = True
    TritonSemantic.binary_op_sanitize_overflow_impl = check_when_asserted


def scan_interpreter_builtins_once() -> None:
    """Let Triton's interpreter find triton.language's builtins once per process, not per call.

    At every call of a jit function from a kernel (``interpreter.InterpretedFunction.__call__``,
    triton 3.6 to 3.9), the interpreter patches the language's builtins again, each time scanning
    whole modules with ``inspect.getmembers`` (``_patch_builtin``); inside a launch they are patched
    already, so the scans find nothing to do, and they were about a quarter of a kernel sweep's time
    on the CPU. Here each module's builtins are listed once, before any launch, and each patch
    walks that list: what gets patched, and when, is unchanged. A Triton without these functions,
    or a module not listed, keeps its own scan."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    scan = getattr(interpreter, "_patch_builtin", None)
    patch = getattr(interpreter, "_patch_attr", None)
    if scan is None or patch is None or getattr(scan, "listed", None) is not None:
        return
    modules = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    listed = {pkg: [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)] for pkg in modules}

    def patch_listed(pkg, builder, scope):
        names = listed.get(pkg)
        if names is None:
            return scan(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                patch(pkg, name, member, builder, scope)

    patch_listed.listed, patch_listed.scan = listed, scan
    interpreter._patch_builtin = patch_listed
