"""Triton ``flash_dma_with_kvcache`` against the reference: contiguous and paged caches, every walk."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import flash_dma.backends.triton as triton_backend
from flash_dma import flash_dma_with_kvcache
from tests.helpers import DEVICE, DTYPE_IDS, KERNEL_DTYPES, max_error, seeded_generator


@dataclass(frozen=True)
class CacheCase:
    batch: int = 3
    seqlen_q: int = 1
    new: int = 1  # keys appended by the call
    cached: tuple[int, ...] = (5, 0, 60)  # keys already in each entry's cache
    capacity: int = 80
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 0  # 0: contiguous
    rows: bool = False  # contiguous only: entries use shuffled cache rows (cache_batch_idx)
    mask: bool = True
    bias: bool = True
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    listed: bool = False
    num_splits: int = 0

    def __str__(self) -> str:
        parts = [f"B{self.batch}-Sq{self.seqlen_q}-new{self.new}-cached{'-'.join(map(str, self.cached))}-cap{self.capacity}"]
        parts.append(f"H{self.heads}-Hkv{self.kv_heads}-D{self.head_dim}")
        parts += [f"paged{self.page_size}"] if self.page_size else (["rows"] if self.rows else ["contiguous"])
        parts += ["mask"] if self.mask else []
        parts += ["bias"] if self.bias else []
        parts += ["causal"] if self.causal else []
        parts += [f"win{self.window[0]},{self.window[1]}"] if self.window != (-1, -1) else []
        parts += ["listed"] if self.listed else []
        parts += [f"splits{self.num_splits}"] if self.num_splits else []
        return "-".join(parts)


def make_cache_inputs(case: CacheCase, dtype: torch.dtype) -> dict:
    gen = seeded_generator(str(case))
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)  # noqa: E731
    hkv, d = case.kv_heads, case.head_dim
    if case.page_size:
        pages_per_entry = -(-case.capacity // case.page_size)
        num_pages = case.batch * pages_per_entry + 3  # spare pages, never used
        slots = (num_pages, case.page_size)
        table = torch.randperm(num_pages, generator=gen)[: case.batch * pages_per_entry].view(case.batch, pages_per_entry)
        layout = {"block_table": table.to(DEVICE, torch.int32)}
        capacity = pages_per_entry * case.page_size
    else:
        slots = (case.batch + 1 if case.rows else case.batch, case.capacity)
        layout = {"cache_batch_idx": torch.tensor([2, 0, 3][: case.batch], dtype=torch.int32, device=DEVICE)} if case.rows else {}
        capacity = case.capacity
    inputs = {
        "q": rand(case.batch, case.seqlen_q, case.heads, d),
        "k_cache": rand(*slots, hkv, d),
        "v_cache": rand(*slots, hkv, d),
        "k": rand(case.batch, case.new, hkv, d) if case.new else None,
        "v": rand(case.batch, case.new, hkv, d) if case.new else None,
        "cache_seqlens": torch.tensor(case.cached, dtype=torch.int32, device=DEVICE),
        "attn_mask": (torch.rand(case.batch, hkv, 1, capacity, generator=gen) > 0.3).to(DEVICE) if case.mask else None,
        "bias_cache": rand(*slots, hkv).float() if case.bias else None,
        "bias": rand(case.batch, case.new, hkv).float() if case.bias and case.new else None,
        **layout,
    }
    return inputs


def poison_unwritten(case: CacheCase, inputs: dict) -> None:
    """NaN in every K/V slot the call must not read: past each entry's keys (cached and new), and
    in the rows or pages no entry uses."""
    unwritten = torch.ones(inputs["k_cache"].shape[:2], dtype=torch.bool)
    if case.page_size:
        table = inputs["block_table"].cpu()
        for entry, length in enumerate(case.cached):
            for key in range(length + case.new):
                unwritten[table[entry, key // case.page_size], key % case.page_size] = False
    else:
        rows = inputs.get("cache_batch_idx")
        rows = range(case.batch) if rows is None else rows.tolist()
        for row, length in zip(rows, case.cached):
            unwritten[row, : length + case.new] = False
    for name in ("k_cache", "v_cache"):
        inputs[name][unwritten.to(DEVICE)] = float("nan")


def run(case: CacheCase, inputs: dict, backend: str):
    """``(out, lse, k_cache, v_cache, bias_cache)`` after the call, on copies of the caches."""
    inputs = {name: t.clone() if isinstance(t, torch.Tensor) and name.endswith("cache") else t for name, t in inputs.items()}
    small = triton_backend.SMALL_PROBLEM
    triton_backend.SMALL_PROBLEM = 0 if case.listed else small
    try:
        out, lse = flash_dma_with_kvcache(
            **inputs, is_causal=case.causal, window_size=case.window, num_splits=case.num_splits,
            return_lse=True, backend=backend,
        )
    finally:
        triton_backend.SMALL_PROBLEM = small
    return out, lse, inputs["k_cache"], inputs["v_cache"], inputs["bias_cache"]


CASES = [
    CacheCase(),
    CacheCase(rows=True),
    CacheCase(page_size=16),
    CacheCase(page_size=24, seqlen_q=3, new=3, window=(7, 0)),
    CacheCase(seqlen_q=4, new=0, cached=(9, 1, 80), heads=8, kv_heads=1, mask=False),
    CacheCase(page_size=16, causal=False, bias=False, num_splits=3),
    CacheCase(cached=(200, 7, 511), capacity=512, page_size=64, head_dim=64, num_splits=4),
]
CASES += [replace(case, listed=True) for case in CASES if case.mask]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kvcache_matches_reference(case, dtype):
    inputs = make_cache_inputs(case, dtype)
    actual = run(case, inputs, "triton")
    expected = run(case, inputs, "reference")
    out, lse, *caches = actual
    assert out.shape == inputs["q"].shape and lse.shape == (case.batch, case.heads, case.seqlen_q)
    assert not torch.isnan(out).any()
    # The reference computes in fp32 and rounds once; the kernels round P to the input dtype too.
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert max_error(out, expected[0]) <= tolerance * max(1.0, expected[0].abs().max().item())
    assert max_error(lse, expected[1]) <= 1e-4
    for name, cache, reference_cache in zip(("k_cache", "v_cache", "bias_cache"), caches, expected[2:]):
        if cache is not None:
            assert torch.equal(cache, reference_cache), name


@pytest.mark.parametrize(
    "case",
    [
        CacheCase(page_size=16),  # tiles shrink to the page and copy whole
        CacheCase(cached=(200, 7, 511), capacity=512, page_size=64, head_dim=64, num_splits=4),
        CacheCase(page_size=24, seqlen_q=3, new=3, window=(7, 0)),  # not a power of two: row by row
        CacheCase(page_size=16, listed=True),  # a key list is gathered row by row whatever the pages
    ],
    ids=str,
)
def test_paged_tiles_through_the_copy_engine(case, monkeypatch):
    """With TMA on (small problems too), a paged cache's tiles are copied from its pool of pages;
    the slots past each sequence and the spare pages hold NaN, which must not reach the output."""
    from flash_dma.backends.triton import layout

    monkeypatch.setattr(layout, "TMA_MIN_KEYS", 0)
    monkeypatch.setattr(layout, "TMA_MIN_BLOCK_D", 0)
    dtype = KERNEL_DTYPES[0]
    inputs = make_cache_inputs(case, dtype)
    poison_unwritten(case, inputs)
    actual = run(case, inputs, "triton")
    expected = run(case, inputs, "reference")
    assert not torch.isnan(actual[0]).any()
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert max_error(actual[0], expected[0]) <= tolerance * max(1.0, expected[0].abs().max().item())
    assert max_error(actual[1], expected[1]) <= 1e-4
