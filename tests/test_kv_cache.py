"""KV-cache semantics on every backend: what is written, what is read, and input errors."""

from __future__ import annotations

import pytest
import torch

from flash_dma import flash_dma_func, flash_dma_with_kvcache, get_available_backends
from tests.helpers import DEVICE

# Flex serves neither packed sequences nor caches (tests/backends/test_flex.py checks that it says so).
BACKENDS = [name for name in get_available_backends(DEVICE) if name != "flex"]
B, HKV, D, CAPACITY, PAGE = 2, 1, 8, 32, 8


def caches(seed=0, slots=(B, CAPACITY)):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(*slots, HKV, D, generator=gen).to(DEVICE) for _ in range(2))
    return k_cache, v_cache, torch.randn(*slots, HKV, generator=gen).to(DEVICE)


def new_tokens(count=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, count, 2, D, generator=gen).to(DEVICE)
    k, v = (torch.randn(B, count, HKV, D, generator=gen).to(DEVICE) for _ in range(2))
    return q, k, v, torch.randn(B, count, HKV, generator=gen).to(DEVICE)


def paged_copy(k_cache, v_cache, bias_cache):
    """The same logical contents in a shuffled pool of pages: ``(k_pool, v_pool, bias_pool, block_table)``."""
    per_entry = CAPACITY // PAGE
    order = torch.randperm(B * per_entry + 2, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    table = order[: B * per_entry].view(B, per_entry).int()
    pools = []
    for t in (k_cache, v_cache, bias_cache):
        pool = torch.zeros(B * per_entry + 2, PAGE, *t.shape[2:], device=DEVICE)
        pool[table.flatten().long()] = t.reshape(B * per_entry, PAGE, *t.shape[2:])
        pools.append(pool)
    return (*pools, table)


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_writes_only_the_new_slots_and_attends_like_flash_dma_func(backend):
    k_cache, v_cache, bias_cache = caches()
    before = [t.clone() for t in (k_cache, v_cache, bias_cache)]
    q, k, v, bias = new_tokens()
    lengths = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    out = flash_dma_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, bias_cache=bias_cache, bias=bias, is_causal=True, backend=backend
    )
    for b, n in enumerate(lengths.tolist()):
        written = slice(n, n + 2)
        for cache, old, new in zip((k_cache, v_cache, bias_cache), before, (k, v, bias)):
            assert torch.equal(cache[b, written], new[b])
            assert torch.equal(cache[b, :n], old[b, :n]) and torch.equal(cache[b, n + 2 :], old[b, n + 2 :])
        keys = slice(0, n + 2)
        expected = flash_dma_func(
            q[b : b + 1], k_cache[b : b + 1, keys], v_cache[b : b + 1, keys],
            attn_bias=bias_cache[b : b + 1, keys].permute(0, 2, 1)[:, :, None], is_causal=True, backend="reference",
        )
        torch.testing.assert_close(out[b : b + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_cache_equals_contiguous_cache(backend):
    k_cache, v_cache, bias_cache = caches()
    q, k, v, bias = new_tokens()
    k_pool, v_pool, bias_pool, table = paged_copy(k_cache, v_cache, bias_cache)
    spare = [t[-2:].clone() for t in (k_pool, v_pool, bias_pool)]
    mask = torch.rand(B, HKV, 1, CAPACITY, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.2
    common = dict(cache_seqlens=13, attn_mask=mask, is_causal=True, backend=backend)
    out = flash_dma_with_kvcache(q, k_cache, v_cache, k, v, bias_cache=bias_cache, bias=bias, **common)
    paged = flash_dma_with_kvcache(q, k_pool, v_pool, k, v, bias_cache=bias_pool, bias=bias, block_table=table, **common)
    torch.testing.assert_close(paged, out, atol=1e-6, rtol=1e-6)
    for pool, contiguous, unused in zip((k_pool, v_pool, bias_pool), (k_cache, v_cache, bias_cache), spare):
        assert torch.equal(pool[table.flatten().long()].reshape(contiguous.shape), contiguous)
        assert torch.equal(pool[-2:], unused)  # pages no entry lists are never touched


def test_cache_batch_idx_picks_rows_and_none_means_full():
    k_cache, v_cache, _ = caches(slots=(3, CAPACITY))
    q, *_ = new_tokens(1)
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    out = flash_dma_with_kvcache(q, k_cache, v_cache, cache_batch_idx=rows)
    expected = flash_dma_func(q, k_cache[rows.long()], v_cache[rows.long()], backend="reference")
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def _bad_calls():
    k_cache, v_cache, bias_cache = caches()
    q, k, v, bias = new_tokens()
    base = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=4)
    table = torch.arange(B * 4, dtype=torch.int32, device=DEVICE).view(B, 4)
    pool = k_cache.view(B * 4, PAGE, HKV, D)
    return [
        ("overflow", dict(base, cache_seqlens=31), "cache_seqlens: .* 2 new ones do not fit in its 32 slots"),
        ("negative", dict(base, cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)), "values >= 0"),
        ("seqlens-batch", dict(base, cache_seqlens=torch.zeros(3, dtype=torch.int32, device=DEVICE)), "expected 2 entries"),
        ("page-out-of-range", dict(base, k_cache=pool, v_cache=pool, block_table=table + 4), r"block_table: entry 1 uses pages .* not in \[0, 8\)"),
        ("row-out-of-range", dict(base, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)), r"cache_batch_idx: expected rows in \[0, 2\)"),
        ("paged-with-rows", dict(base, k_cache=pool, v_cache=pool, block_table=table, cache_batch_idx=table[:, 0]), "cache_batch_idx: a paged cache"),
        ("bias-length", dict(base, bias_cache=bias_cache[:, :31]), r"bias_cache: expected shape \[2, 32, 1\|Hkv\|H\]"),
        ("bias-without-cache", dict(base, bias=bias), "bias: new bias values are appended to bias_cache"),
        ("bias-dtype", dict(base, bias_cache=bias_cache.half()), r"bias_cache: expected dtype torch.float32, got torch.float16"),
        ("k-dtype", dict(base, k=k.half()), "k: expected dtype torch.float32"),
        ("k-without-v", dict(base, v=None), "k, v: pass both"),
        ("mask-length", dict(base, attn_mask=torch.ones(B, 1, 1, 31, dtype=torch.bool, device=DEVICE)), "attn_mask: dimension 3"),
    ]


@pytest.mark.parametrize("name, arguments, error", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_cache_input_is_named_and_nothing_is_written(name, arguments, error):
    before = arguments["k_cache"].clone()
    with pytest.raises((ValueError, TypeError), match=error):
        flash_dma_with_kvcache(**arguments)
    assert torch.equal(arguments["k_cache"], before)


def test_cache_lengths_are_read_once_per_version_and_checked_again_when_changed(monkeypatch):
    """A decode loop passes the same lengths to every layer: the host reads them (a wait for the
    GPU) once, until they change in place."""
    import flash_dma.kv_cache as kv_cache

    reads = []
    check = kv_cache._check_values
    monkeypatch.setattr(kv_cache, "_check_values", lambda *args: reads.append(1) or check(*args))
    k_cache, v_cache, _ = caches()
    q, _, _, _ = new_tokens()
    lengths = torch.tensor([4, 9], dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend="reference")
    assert len(reads) == 1
    lengths[1] = CAPACITY + 1
    with pytest.raises(ValueError, match="cache_seqlens: an entry holds 33 keys"):
        flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend="reference")
    assert len(reads) == 2


def test_inference_tensors_as_lengths_are_checked_on_every_call():
    """Inference tensors have no version counter: a change in place can't be seen, so every call checks."""
    k_cache, v_cache, _ = caches()
    q, _, _, _ = new_tokens()
    with torch.inference_mode():
        lengths = torch.tensor([4, 9], dtype=torch.int32, device=DEVICE)
        flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend="reference")
        lengths[1] = CAPACITY + 1
        with pytest.raises(ValueError, match="cache_seqlens: an entry holds 33 keys"):
            flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend="reference")
