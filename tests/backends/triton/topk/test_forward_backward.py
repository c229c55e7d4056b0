"""flash_dma_topk_func on the Triton kernels against the float64 gather-based reference: output,
LSE and every gradient, with -1 entries, duplicates, out-of-range entries, rows with no counting
entry, causal and window rules on the indices, both bias forms, GQA and MQA; each through every
plan of its passes (the index kernels, the packed per-query mask, or one in each pass), and the
cost model that chooses the plan (``dispatch.topk_plan``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flash_dma import flash_dma_func, flash_dma_topk_func, topk_mask
from flash_dma.backends.triton import dispatch, launch
from flash_dma.backends.triton.dispatch import TOPK_INDICES, TOPK_PACKED, TopkPlan, topk_plan
from tests.conftest import TOPK_WALKS
from tests.helpers import (
    DEVICE, DTYPE_IDS, KERNEL_DTYPES, REPEATS_ON_GPU, Case, assert_close, call_kwargs, case_dtypes, guarded,
    topk_reference_outputs,
)


@dataclass(frozen=True)
class TopkCase(Case):
    """A top-k problem: ``bias`` is ``"pairs:<b>,<h>"`` or ``"keys:<b>,<h>"`` (b in {1, B}, h in {1, Hkv, H}) or None."""

    seqlen_k: int = 63
    width: int = 5
    # Keys drawn from the first `hot` keys only (0: all), so that many queries pick the same keys.
    hot: int = 0
    # No key listed twice in a row's list, passed on as unique_indices=True.
    unique: bool = False

    def __str__(self) -> str:
        return super().__str__() + f"-W{self.width}" + (f"-hot{self.hot}" if self.hot else "") + ("-unique" if self.unique else "")

    @property
    def splits(self) -> bool:
        """Whether the passes may walk differently: unique indices and no bias per listed pair."""
        return self.unique and not (self.bias or "").startswith("pairs")


def make_indices(case: TopkCase, gen: torch.Generator) -> torch.Tensor:
    """Random keys with -1 entries, entries past Sk, repeats (none for a unique case), and one query
    row listing nothing."""
    shape = (case.batch, case.seqlen_q, case.kv_heads, case.width)
    high = case.hot or max(case.seqlen_k, 1)  # with no key at all, key 0 is out of range too
    if case.unique:  # distinct draws among the keys and 3 past them, then -1 where the list is longer
        draws = max(high + 3, case.width)
        indices = torch.rand(*shape[:3], draws, generator=gen).argsort(-1)[..., : case.width]
        indices = torch.where(indices >= high + 3, -1, torch.where(indices >= high, case.seqlen_k + indices - high, indices))
    else:
        indices = torch.randint(0, high, shape, generator=gen)
    draw = torch.rand(shape, generator=gen)
    indices = torch.where(draw < 0.15, -1, indices)
    if not case.unique:
        indices = torch.where(draw > 0.95, case.seqlen_k + torch.randint(0, 3, shape, generator=gen), indices)
        repeat = torch.rand(shape, generator=gen) < 0.2
        indices = torch.where(repeat, indices.roll(1, dims=-1), indices)
    indices[:, case.seqlen_q // 2 :][:, :1] = -1
    return indices.to(DEVICE, torch.int32)


def make_topk_inputs(case: TopkCase, dtype: torch.dtype, requires_grad: bool = True) -> dict:
    gen = case.generator()
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, generator=gen)
    k = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, generator=gen)
    v = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, generator=gen)
    bias = None
    if case.bias:
        form, dims = case.bias.split(":")
        b, h = (int({"B": case.batch, "H": case.heads, "Hkv": case.kv_heads}.get(d, d)) for d in dims.split(","))
        shape = (b, case.seqlen_q, h, case.width) if form == "pairs" else (b, h, case.seqlen_k)
        bias = guarded(torch.randn(shape, generator=gen).to(DEVICE, torch.float32 if case.bias_fp32 else dtype))
        bias.requires_grad_(requires_grad)
    q, k, v = (guarded(t.to(DEVICE, dtype)).requires_grad_(requires_grad) for t in (q, k, v))
    return {"query": q, "key": k, "value": v, "indices": make_indices(case, gen), "attn_bias": bias}


def reference(case: TopkCase, inputs: dict, dout: torch.Tensor, compute_dtype: torch.dtype):
    """``(out, lse, grads)`` of the reference in ``compute_dtype`` (inputs cast to it in float64)."""
    window = (case.window[0], 0) if case.causal else case.window
    return topk_reference_outputs(inputs, dout, compute_dtype, window, softcap=case.softcap)


def run_triton(case: TopkCase, inputs: dict, **kwargs):
    out, lse = flash_dma_topk_func(
        **inputs, **call_kwargs(case), unique_indices=case.unique, return_lse=True, backend="triton", **kwargs
    )
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    out.backward(dout)
    return out, lse, dout


def check_against_reference(case: TopkCase, dtype: torch.dtype, deterministic: bool = False) -> None:
    """Output, LSE and every gradient (in its input's dtype and shape) against the float64 reference."""
    inputs = make_topk_inputs(case, dtype)
    out, lse, dout = run_triton(case, inputs, deterministic=deterministic)
    oracle_out, oracle_lse, oracle = reference(case, inputs, dout, torch.float64)
    base_out, base_lse, baseline = reference(case, inputs, dout, dtype)
    assert_close("out", out, oracle_out, base_out)
    assert_close("lse", lse, oracle_lse, base_lse)
    for name, expected in oracle.items():
        grad = inputs[name].grad
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        assert_close(name, grad, expected, baseline[name])


TOPK_CASES = [
    TopkCase(bias="pairs:B,H", causal=True),
    TopkCase(batch=1, seqlen_q=63, seqlen_k=17, heads=3, kv_heads=1, head_dim=40, width=64, bias="keys:1,1", window=(8, 2)),
    TopkCase(seqlen_q=1, seqlen_k=130, heads=2, kv_heads=2, head_dim=64, width=64, softcap=2.0),
    TopkCase(batch=1, seqlen_q=130, seqlen_k=130, heads=8, kv_heads=2, width=1, bias="keys:B,H", causal=True),
    TopkCase(seqlen_q=17, seqlen_k=1, heads=4, kv_heads=4, width=5, bias="pairs:1,Hkv"),
    TopkCase(batch=1, seqlen_q=63, seqlen_k=63, head_dim=64, width=64, bias="pairs:1,1", bias_fp32=True, softcap=3.0, causal=True, hot=6),
    TopkCase(batch=2, seqlen_q=17, seqlen_k=63, heads=4, kv_heads=1, width=5, bias="keys:B,Hkv", bias_fp32=True, causal=True, hot=3),
    # Unique lists: the passes may walk differently (the split walks), without a bias plane.
    TopkCase(batch=1, seqlen_q=33, seqlen_k=100, width=16, bias="keys:B,H", causal=True, unique=True),
    TopkCase(batch=1, seqlen_q=63, seqlen_k=40, heads=6, kv_heads=2, head_dim=40, width=16, window=(20, 3), unique=True),
]
SPLIT_WALKS = [walk for walk, (forward, backward, _) in TOPK_WALKS.items() if forward != backward]


def skip_unless_open(case: TopkCase, walk: str) -> None:
    """A split walk on a case that cannot split runs as the 'packed' or 'split' walk does: skipped."""
    if walk in SPLIT_WALKS and not case.splits:
        pytest.skip("a split needs unique indices and no per-pair bias: both passes take the forward's walk")


@pytest.mark.parametrize("case, dtype", case_dtypes(TOPK_CASES))
def test_topk_matches_reference(case, dtype, topk_walk, poison_outputs):
    """dK and dV added by atomics in the dQ walk (the index kernels), a packed per-query mask, or
    one in each pass."""
    skip_unless_open(case, topk_walk)
    check_against_reference(case, dtype)


@pytest.mark.parametrize("case, dtype", case_dtypes(TOPK_CASES))
def test_deterministic_topk_matches_reference(case, dtype, poison_outputs, monkeypatch):
    """deterministic=True on the index kernels: dK and dV key-outer, over the sorted inverse map."""
    monkeypatch.setattr(dispatch, "TOPK_FORCED_PLAN", TopkPlan(TOPK_INDICES, TOPK_INDICES))
    check_against_reference(case, dtype, deterministic=True)


LLM = dict(batch=1, num_heads=16, num_kv_heads=4, head_dim=128, window=(-1, 0), deterministic=False)
INDICES, PACKED = TopkPlan(TOPK_INDICES, TOPK_INDICES), TopkPlan(TOPK_PACKED, TOPK_PACKED)


@pytest.mark.parametrize(
    ("seqlen", "width", "plane_heads", "needs_grad", "plan"),
    [
        # The measured rows (docs/benchmarks.md, W = 2048): at 32K the packed mask wins both passes,
        # at 64K its forward, at 128K the index forward.
        (32768, 2048, 0, True, PACKED),
        (65536, 2048, 0, False, PACKED),
        (131072, 2048, 0, False, INDICES),
        # Lists of 1/64 of the keys: the band costs the mask 32x the index walk's entries.
        (32768, 512, 0, False, INDICES),
        (32768, 512, 0, True, INDICES),
        # A bias plane costs 4 Sk bytes per query and head: none past 4 keys per list entry.
        (8192, 2048, 4, True, PACKED),
        (8193, 2048, 4, True, INDICES),
    ],
    ids=["32K-fwdbwd", "64K-fwd", "128K-fwd", "W512-fwd", "W512-fwdbwd", "plane-4W", "plane-past-4W"],
)
def test_topk_plan_at_measured_and_bounding_points(seqlen, width, plane_heads, needs_grad, plan):
    assert topk_plan(seqlen_q=seqlen, seqlen_k=seqlen, width=width, plane_heads=plane_heads, needs_grad=needs_grad, **LLM) == plan


def _costs(walk_forward: float, walk_backward: float) -> dispatch.TopkCosts:
    """Costs where the index walk's passes cost the given multiples of the packed mask's."""
    return dispatch.TopkCosts(
        walk_forward=walk_forward, walk_backward_overlapping=walk_backward, walk_backward_random=walk_backward,
        walk_backward_deterministic=walk_backward, walk_backward_growth=0.0, packed_forward=1.0, packed_backward=1.0,
        packed_backward_deterministic=1.0, bits_entry=0.0, bits_pair=0.0, plane_forward=0.0, plane_backward=0.0,
    )


# 16K causal, W = 1024: 2^26 entries and 2^31 pairs of tiles, so an entry costs 32 pairs' worth.
@pytest.mark.parametrize(
    ("walk_forward", "walk_backward", "plane_heads", "needs_grad", "plan"),
    [
        (1.0, 1.0, 0, True, INDICES),
        (64.0, 64.0, 0, True, PACKED),
        (1.0, 64.0, 0, True, TopkPlan(TOPK_INDICES, TOPK_PACKED)),
        (64.0, 1.0, 0, True, TopkPlan(TOPK_PACKED, TOPK_INDICES)),
        (64.0, 1.0, 0, False, PACKED),  # a forward alone: the backward's costs do not count
        # With a plane (W = 4096: a pass of the mask costs 8 entries' worth), no split, though one
        # would cost least: 8 + 1 and 1 + 8 entries' worth against 65 and 16, or 13 and 16.
        (64.0, 1.0, 4, True, PACKED),
        (1.0, 12.0, 4, True, INDICES),
    ],
    ids=["index-cheaper", "mask-cheaper", "split-mask-backward", "split-mask-forward", "forward-only",
         "plane-packed-not-split", "plane-indices-not-split"],
)
def test_topk_plan_takes_each_pass_where_it_costs_least(walk_forward, walk_backward, plane_heads, needs_grad, plan, monkeypatch):
    monkeypatch.setattr(dispatch, "TOPK_COSTS", _costs(walk_forward, walk_backward))
    shape = dict(seqlen_q=16384, seqlen_k=16384, width=1024 if plane_heads == 0 else 4096)
    assert topk_plan(**shape, plane_heads=plane_heads, needs_grad=needs_grad, **LLM) == plan


def test_a_forced_plan_wins_where_it_is_open(monkeypatch):
    monkeypatch.setattr(dispatch, "TOPK_FORCED_PLAN", TopkPlan(TOPK_PACKED, TOPK_INDICES))
    shape = dict(seqlen_q=64, seqlen_k=1 << 20, width=1, needs_grad=True, **LLM)  # far past every bound
    assert topk_plan(plane_heads=0, **shape) == TopkPlan(TOPK_PACKED, TOPK_INDICES)
    assert topk_plan(plane_heads=4, **shape) == PACKED  # a plane: both passes take the forward's walk


@pytest.mark.parametrize("bias", ["pairs:1,H", "keys:1,H"])
def test_rows_with_no_counting_entry_give_zero_and_no_gradient(bias, topk_walk, poison_outputs):
    """Rows whose listed keys all lie past the diagonal, or that list none: out 0, LSE -inf and no
    gradient, in every walk (unique lists of a per-key bias run each split: the pass that walks the
    indices reads the LSE the packed mask's pass wrote, and the reverse)."""
    unique = bias.startswith("keys")
    case = TopkCase(batch=1, seqlen_q=20, seqlen_k=10, heads=2, kv_heads=1, width=4, bias=bias, causal=True, unique=unique)
    skip_unless_open(case, topk_walk)
    inputs = make_topk_inputs(case, KERNEL_DTYPES[-1])
    # Past the diagonal for queries 0..11 (Sq > Sk: query i sees keys up to i - 10): none counts.
    inputs["indices"][:, :12] = torch.arange(6, 10, dtype=torch.int32, device=DEVICE)
    inputs["indices"][:, 15] = -1
    out, lse, _ = run_triton(case, inputs)
    empty = torch.tensor([i for i in range(20) if i < 12 or i == 15])
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()
    for name in ("query", "key", "value", "attn_bias"):
        assert not inputs[name].grad.isnan().any(), name
    for name in ("query", "attn_bias") if not unique else ("query",):  # a per-key bias has no query axis
        assert torch.equal(inputs[name].grad[:, empty], torch.zeros_like(inputs[name].grad[:, empty])), name


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_one_tile_choice_per_key(deterministic, monkeypatch):
    """A launcher chooses a kernel's tile once per key (``launch.Launcher``), so every launch of a
    top-k kernel under one key must offer the same tiles, whatever the GQA group: a union tile of
    32 rows chosen for groups of 2 heads and taken by a later call with groups of 4 left half the
    heads' dQ unwritten on the GPU."""
    offered: dict = {}
    launch_one = launch.Launcher.launch

    def recording(self, layout, tensors, build, candidates, grid):
        _, key = build()
        offered.setdefault((self.kernel.__name__, key), set()).add(tuple(repr(c.all_kwargs()) for c in candidates()))
        return launch_one(self, layout, tensors, build, candidates, grid)

    monkeypatch.setattr(launch.Launcher, "launch", recording)
    for heads in (2, 4, 8):  # tiles of 16 rows at most, then the union's 64: blocks of 16 queries and fewer
        case = TopkCase(batch=1, seqlen_q=40, seqlen_k=40, heads=heads, kv_heads=1, width=3, bias="keys:1,H", causal=True)
        run_triton(case, make_topk_inputs(case, KERNEL_DTYPES[0]), deterministic=deterministic)
    assert {"_topk_fwd_kernel", "_topk_dq_kernel"} <= {name for name, _ in offered}
    assert ("_union_bwd_kernel" if not deterministic else "_topk_dkdv_kernel") in {name for name, _ in offered}
    for (name, _), tiles in offered.items():
        assert len(tiles) == 1, f"{name}: one key, several tile sets {tiles}"


@REPEATS_ON_GPU
@pytest.mark.parametrize("bias", ["pairs:1,1", "keys:1,H"])
def test_gradients_are_bitwise_reproducible(bias, topk_walk):
    # Many queries pick the same few keys: the dK/dV sums are longest there. Unique lists of a per-key
    # bias run every split too.
    case = TopkCase(seqlen_q=24, seqlen_k=30, width=8, bias=bias, causal=True, **({"hot": 4} if bias.startswith("pairs") else {"unique": True}))
    skip_unless_open(case, topk_walk)
    runs = []
    for _ in range(2):
        inputs = make_topk_inputs(case, KERNEL_DTYPES[0])
        run_triton(case, inputs, deterministic=True)
        runs.append([inputs[n].grad for n in ("query", "key", "value", "attn_bias")])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_equals_flash_dma_func_with_the_bit_mask_of_distinct_indices():
    case = TopkCase(batch=1, seqlen_q=33, seqlen_k=70, width=12, causal=True)
    inputs = make_topk_inputs(case, KERNEL_DTYPES[0], requires_grad=False)
    gen = case.generator("distinct")
    inputs["indices"] = torch.rand(1, 33, 2, 70, generator=gen).argsort(-1)[..., :12].to(DEVICE, torch.int32)
    top = flash_dma_topk_func(**inputs, is_causal=True, backend="triton")
    dense = flash_dma_func(
        inputs["query"], inputs["key"], inputs["value"], topk_mask(inputs["indices"], 70, block_size=(16, 32)),
        is_causal=True, backend="triton",
    )
    # Two kernels, each rounding its output to the dtype: they may differ by an ulp (bf16: eps = 2**-7).
    tolerance = max(2e-3, 2 * torch.finfo(KERNEL_DTYPES[0]).eps)
    torch.testing.assert_close(top, dense, atol=tolerance, rtol=tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_topk_long_llm_shape(dtype):
    case = TopkCase(batch=1, seqlen_q=1023, seqlen_k=1500, heads=16, kv_heads=4, head_dim=128, width=256, bias="keys:1,Hkv", causal=True)
    check_against_reference(case, dtype)
