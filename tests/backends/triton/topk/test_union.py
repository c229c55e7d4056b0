"""The union of a query block's listed keys (``union.union_lists``), and a call whose blocks
split between the union and the per-query kernels (``UNION_SHARE``)."""

from __future__ import annotations

import pytest
import torch

from flash_dma.backends.triton.topk import union
from flash_dma.backends.triton.layout import TopkCall
from flash_dma.inputs import UNBOUNDED
from tests.backends.triton.topk.test_forward_backward import TopkCase, check_against_reference
from tests.helpers import DEVICE, KERNEL_DTYPES


def _call(indices: torch.Tensor, seqlen_k: int, window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> TopkCall:
    batch, seqlen_q, kv_heads, _ = indices.shape
    q = torch.randn(batch, seqlen_q, kv_heads, 16, device=DEVICE)
    k = torch.randn(batch, seqlen_k, kv_heads, 16, device=DEVICE)
    return TopkCall(q, k, k, indices.to(DEVICE, torch.int32), None, 1.0, window[0], window[1], 0.0, False)


def _entries(keys, words, lengths, row: int) -> list[tuple[int, int]]:
    """Row ``row``'s union as sorted ``(key, word)`` pairs, front and back."""
    distinct, repeats = lengths[row].tolist()
    capacity = keys.shape[1]
    at = list(range(distinct)) + list(range(capacity - repeats, capacity))
    return sorted(zip(keys[row, at].tolist(), words[row, at].tolist()))


def test_each_key_once_with_the_bits_of_its_queries_and_repeats_apart():
    # Queries 0..2 of one block: -1 and keys past Sk = 4 count as none; query 2 lists key 0 three times.
    indices = torch.tensor([[[[3, 1, 3, -1]], [[1, 2, 0, 9]], [[0, 0, 0, 1]]]])
    keys, words, lengths = union.union_lists(_call(indices, 4), queries=4)
    assert lengths.tolist() == [[4, 3]]
    # Key 0: queries 1 and 2, then query 2's two repeats; key 3: query 0 and its repeat.
    assert _entries(keys, words, lengths, 0) == [(0, 0b100), (0, 0b100), (0, 0b110), (1, 0b111), (2, 0b010), (3, 0b001), (3, 0b001)]


def test_rows_are_batch_head_major_and_the_last_block_is_padded():
    gen = torch.Generator().manual_seed(0)
    indices = torch.randint(0, 50, (2, 5, 3, 4), generator=gen)  # 5 queries: blocks of 4, the second holds 1
    keys, words, lengths = union.union_lists(_call(indices, 50), queries=4)
    assert keys.shape == (2 * 3 * 2, 16) and lengths.shape == (12, 2)
    for b in range(2):
        for h in range(3):
            for block in range(2):
                listed = indices[b, 4 * block : 4 * block + 4, h]  # [queries of the block, W]
                expected = {}
                for t, row in enumerate(listed.tolist()):
                    for key in row:
                        expected.setdefault(key, []).append(t)
                row = (b * 3 + h) * 2 + block
                got = _entries(keys, words, lengths, row)
                want = []
                for key, members in expected.items():
                    counts = {t: members.count(t) for t in set(members)}
                    want.append((key, sum(1 << t for t in counts)))
                    want += [(key, 1 << t) for t, n in counts.items() for _ in range(n - 1)]
                assert got == sorted(want)


def test_passes_over_ranges_of_keys_build_the_same_lists(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    indices = torch.randint(-2, 70, (1, 9, 2, 6), generator=gen)
    indices[..., 1] = indices[..., 0]  # repeats
    whole = union.union_lists(_call(indices, 64), queries=8)
    monkeypatch.setattr(union, "_BUILD_KEY_RANGE", 10)  # 7 passes, the last over 4 keys
    ranged = union.union_lists(_call(indices, 64), queries=8)
    assert torch.equal(whole[2], ranged[2])
    for row in range(whole[2].shape[0]):
        assert _entries(*whole, row) == _entries(*ranged, row)


def test_causal_and_window_rules_hold_on_the_entries():
    # Bottom-right causal with a window of 1 to the left: query i (Sq = Sk = 3) sees keys i - 1 .. i.
    indices = torch.tensor([[[[0, 1, 2]], [[0, 1, 2]], [[0, 1, 2]]]])
    keys, words, lengths = union.union_lists(_call(indices, 3, window=(1, 0)), queries=4)
    assert _entries(keys, words, lengths, 0) == [(0, 0b011), (1, 0b110), (2, 0b100)]


@pytest.mark.parametrize("groups", ["one-group", "a-group-per-block"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_a_call_whose_blocks_split_between_the_union_and_per_query_kernels(dtype, groups, monkeypatch, poison_outputs):
    if groups == "a-group-per-block":  # the lists built and walked a block at a time
        monkeypatch.setattr(union, "_GROUP_ENTRIES", 1)
    case = TopkCase(batch=1, seqlen_q=64, seqlen_k=200, heads=4, kv_heads=2, width=3, bias="keys:1,H", causal=True)
    queries = union.union_queries(case.heads // case.kv_heads)
    gen = torch.Generator().manual_seed(1)
    # Blocks 0 and 2 list the same 3 keys in every query (their union: 3 entries), blocks 1 and 3
    # distinct random ones (a union of up to queries x 3).
    shared = torch.tensor([0, 5, 9]).expand(case.batch, queries, case.kv_heads, 3)
    spread = torch.rand(case.batch, queries, case.kv_heads, case.seqlen_k, generator=gen).argsort(-1)[..., :3]
    indices = torch.cat([shared, spread, shared, spread], dim=1)
    limit = int(union.UNION_SHARE * queries * case.width)
    sizes = union.union_lists(_call(indices, case.seqlen_k), queries)[2].sum(-1)
    assert (sizes <= limit).any() and (sizes > limit).any()
    monkeypatch.setattr("tests.backends.triton.topk.test_forward_backward.make_indices", lambda *_: indices.to(DEVICE, torch.int32))
    check_against_reference(case, dtype)
