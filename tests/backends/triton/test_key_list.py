"""Key lists: the kept keys of a per-key mask, compacted for the kernels to gather."""

import pytest
import torch

from flash_dma.backends.triton.key_list import GATHER_BLOCK, build_key_list, gather_kept_keys
from tests.helpers import DEVICE


def _check(key_list: torch.Tensor, keep: torch.Tensor) -> None:
    """``keep`` ``[Bm, Hm, Sk]`` bool: what the key list must hold."""
    seqlen_k = keep.shape[-1]
    order, rank = key_list[:, :, 0, :seqlen_k].long(), key_list[:, :, 1].long()
    kept = keep.sum(-1)
    assert torch.equal(rank[..., seqlen_k], kept)
    assert torch.equal(rank[..., :seqlen_k], keep.long().cumsum(-1) - keep.long())
    positions = torch.arange(seqlen_k, device=keep.device)
    assert torch.equal(order.sort(-1).values, positions.expand_as(order)), "the order is a permutation"
    for row in range(keep.shape[0] * keep.shape[1]):
        b, h = divmod(row, keep.shape[1])
        count = int(kept[b, h])
        assert torch.equal(order[b, h, :count], positions[keep[b, h]]), "kept keys first, ascending"


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 1), (2, 3, 1, 17), (1, 2, 1, 1024), (2, 1, 1, 2500)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0], ids=lambda d: f"keep{d:g}")
def test_key_list_of_a_mask(shape, density):
    gen = torch.Generator().manual_seed(sum(shape) + int(density * 10))
    mask = (torch.rand(shape, generator=gen) < density).to(DEVICE)
    _check(build_key_list(mask, shape[-1]), mask[:, :, 0])


def test_integer_masks_and_broadcast_views():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(1, 2, 1, 300, generator=gen) < 0.3).to(DEVICE)
    view = mask.to(torch.int32).expand(3, 2, 1, 300)  # a batch broadcast through a zero stride
    _check(build_key_list(view, 300), view[:, :, 0] != 0)


@pytest.mark.parametrize(
    "shape",
    [(1, 130, 1, 16), (2, 300, 3, 40), (1, 257, 2, 128)],
    ids=lambda s: "B{}xSk{}xHkv{}xD{}".format(*s),
)
@pytest.mark.parametrize("lengths", [False, True], ids=["all-keys", "entry-lengths"])
@pytest.mark.parametrize("list_heads", ["1", "Hkv"])
def test_gathered_kept_keys(shape, list_heads, lengths):
    """Slot j of every (batch, kv head) holds K and V at the list's order[j] up to the kept count,
    and zeros in the rest of its tile of ``GATHER_BLOCK`` slots, through strided views. With
    entry lengths (a KV cache's), kept keys past an entry's length are zeros too."""
    batch, seqlen_k, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(seqlen_k)
    packed = torch.randn(batch, seqlen_k, 2, kv_heads, head_dim, generator=gen).to(DEVICE)
    k, v = packed.unbind(2)  # strided views of a packed K/V projection
    mask = (torch.rand(batch, kv_heads if list_heads == "Hkv" else 1, 1, seqlen_k, generator=gen) < 0.3).to(DEVICE)
    mask[0, 0, 0, :] = False  # a row with no kept key: nothing of it is read
    key_list = build_key_list(mask, seqlen_k)
    before = (k.clone(), v.clone())
    lengths = torch.randint(0, seqlen_k + 1, (batch,), generator=gen, dtype=torch.int32).to(DEVICE) if lengths else None
    kept_k, kept_v = gather_kept_keys(k, v, key_list, lengths)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])
    order = key_list[:, :, 0, :seqlen_k].long().expand(batch, kv_heads, seqlen_k)
    count = key_list[:, :, 1, seqlen_k].expand(batch, kv_heads)
    for b in range(batch):
        for h in range(kv_heads):
            kept = int(count[b, h])
            written = min(-(-kept // GATHER_BLOCK) * GATHER_BLOCK, seqlen_k)
            rows = order[b, h, :kept]
            inside = (rows < (seqlen_k if lengths is None else int(lengths[b])))[:, None]
            assert torch.equal(kept_k[b, :kept, h], torch.where(inside, k[b, rows, h], 0))
            assert torch.equal(kept_v[b, :kept, h], torch.where(inside, v[b, rows, h], 0))
            assert not kept_k[b, kept:written, h].any() and not kept_v[b, kept:written, h].any()
