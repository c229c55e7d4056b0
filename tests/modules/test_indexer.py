"""LightningIndexer: its scores, its selection against a brute force, the scores of the selected
pairs and their gradients, chunked or not, and its argument errors."""

import pytest
import torch

from flash_dma.modules import LightningIndexer
from flash_dma.modules import indexer as indexer_module
from flash_dma.modules.indexer import IndexerStates
from tests.helpers import DEVICE
from tests.test_masks import brute_force_topk

HIDDEN, KV_HEADS, HEADS, DIM = 24, 2, 3, 8


def make_indexer(seed: int = 0, **kwargs) -> LightningIndexer:
    torch.manual_seed(seed)
    indexer = LightningIndexer(HIDDEN, KV_HEADS, HEADS, DIM, **kwargs).to(DEVICE)
    with torch.no_grad():
        indexer.w_proj.weight.normal_()  # trained-looking weights: scores are no longer all 0
    return indexer


def make_states(indexer: LightningIndexer, batch: int = 2, seqlen: int = 19, seed: int = 1) -> IndexerStates:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seqlen, HIDDEN, generator=gen).to(DEVICE)
    return indexer(x, torch.arange(seqlen, device=DEVICE)[None])


def brute_force_scores(states: IndexerStates) -> torch.Tensor:
    """``[B, Hkv, Sq, Sk]``: sum over heads e of w[b, i, g, e] * relu(q[b, i, g, e] . k[b, j, g]), pair by pair."""
    query, key, weight = states
    batch, seqlen_q, heads, per_kv, _ = query.shape
    scores = torch.zeros(batch, heads, seqlen_q, key.shape[1], dtype=torch.float64)
    for b, i, g, j in torch.nonzero(torch.ones(batch, seqlen_q, heads, key.shape[1])).tolist():
        dots = query[b, i, g].double() @ key[b, j, g].double()  # [I]
        scores[b, g, i, j] = (weight[b, i, g].double() * dots.relu()).sum()
    return scores


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_selection_is_each_querys_top_keys_among_the_real_visible_ones(causal):
    indexer = make_indexer()
    states = make_states(indexer)
    padding = torch.ones(2, 19, dtype=torch.bool, device=DEVICE)
    padding[1, :4] = False
    indices = indexer.select(states, 5, is_causal=causal, padding=padding)
    assert indices.shape == (2, 19, KV_HEADS, 5) and indices.dtype == torch.int32
    allowed = padding.cpu()[:, None, None, :] & (torch.ones(19, 19, dtype=torch.bool).tril() if causal else True)
    keep = brute_force_topk(brute_force_scores(states).float(), allowed, 5)
    for b, i, g in torch.nonzero(torch.ones(2, 19, KV_HEADS)).tolist():
        chosen = torch.nonzero(keep[b, g, i]).flatten().tolist()
        assert indices[b, i, g].tolist() == chosen + [-1] * (5 - len(chosen))


def dense_pair_scores(states: IndexerStates, keys: torch.Tensor) -> torch.Tensor:
    """The scores of every pair, then those of ``keys`` ``[B, Sq, Hkv, W]`` (``Sk`` for an empty slot: 0)."""
    query, key, weight = states
    dots = torch.einsum("bihed,bjhd->bheij", query, key)
    rows = torch.nn.functional.pad(torch.einsum("bihe,bheij->bhij", weight, dots.relu()), (0, 1))
    return rows.gather(-1, keys.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("chunk_rows", [None, 3], ids=["whole", "chunks-of-3"])
def test_pair_scores_and_their_gradients_match_the_dense_scores(chunk_rows, monkeypatch):
    indexer = make_indexer(rope_base=100.0)
    states = make_states(indexer)
    if chunk_rows:
        monkeypatch.setattr(indexer_module, "PAIR_CHUNK_ELEMENTS", chunk_rows * 2 * KV_HEADS * HEADS * 20)
    indices = indexer.select(states, 6, is_causal=True)
    pairs = indexer.pair_scores(states, indices)
    assert pairs.shape == (2, 19, KV_HEADS, 6) and pairs.dtype == torch.float32
    keys = torch.where(indices < 0, 19, indices.long())
    expected = torch.nn.functional.pad(brute_force_scores(states), (0, 1)).gather(-1, keys.cpu().transpose(1, 2))
    torch.testing.assert_close(pairs.double().cpu(), expected.transpose(1, 2), atol=1e-5, rtol=1e-5)

    parameters = list(indexer.parameters())
    upstream = torch.randn(pairs.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    grads = torch.autograd.grad(pairs, parameters, upstream)
    again = torch.autograd.grad(indexer.pair_scores(make_states(indexer), indices), parameters, upstream)
    dense = torch.autograd.grad(dense_pair_scores(make_states(indexer), keys), parameters, upstream)
    for grad, repeat, expected_grad in zip(grads, again, dense):
        assert torch.equal(grad, repeat)  # each pair's score gradient is written once: no atomic adds
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-4)


def test_an_empty_sequence_keeps_every_parameter_in_the_graph():
    indexer = make_indexer()
    states = make_states(indexer, seqlen=0)
    indices = indexer.select(states, 4, is_causal=True)
    pairs = indexer.pair_scores(states, indices)
    assert indices.shape == pairs.shape == (2, 0, KV_HEADS, 4)
    pairs.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in indexer.parameters())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_heads=0), r"indexer_heads: expected an int >= 1, got 0"),
        (dict(head_dim=0), r"indexer_dim: expected an int >= 1, got 0"),
        (dict(head_dim=7, rope_base=1e4), r"indexer_dim: the rotary embedding needs an even indexer head dimension, got 7"),
    ],
    ids=["heads", "dim", "rotary"],
)
def test_bad_arguments_are_named(kwargs, message):
    arguments = dict(hidden_size=HIDDEN, num_kv_heads=KV_HEADS, num_heads=HEADS, head_dim=DIM)
    with pytest.raises(ValueError, match=message):
        LightningIndexer(**{**arguments, **kwargs})
