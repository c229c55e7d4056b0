"""The dense-mask packer: one kernel writes a BitMask's words and block states (``bit_pack.py``)."""

import pytest
import torch

from flash_dma.backends.triton.bit_pack import pack_bits
from flash_dma.bit_mask import block_states, pack_mask_words
from tests.helpers import DEVICE, seeded_generator

# The last shape's rows are 16-byte multiples in every dtype, so the kernel's loads are vectors.
SHAPES = [(2, 3, 70, 100), (1, 2, 130, 47), (1, 1, 1, 45), (2, 1, 33, 1), (2, 3, 70, 96)]
BLOCKS = [(32, 32), (64, 256), (128, 128)]


def _mask(shape, kind: str, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept bool, the mask as given)``: random pairs, full and empty stretches, in ``kind``'s dtype.

    The first head's rows from 64 on are empty: its ragged last query blocks are EMPTY."""
    gen = seeded_generator(label)
    kept = torch.rand(shape, generator=gen) < 0.6
    if shape[2] > 40 and shape[3] > 40:
        kept[0, 0, :40] = True
        kept[0, 0, 64:] = False
        kept[-1, -1, :, :40] = False
    if kind == "int":
        return kept, kept.to(torch.int32)
    if kind == "float":
        # An additive mask: the dtype's minimum, -inf or NaN drop a pair; any other value is a bias.
        values = torch.randn(shape, generator=gen, dtype=torch.float16) * 100
        dropped = torch.tensor([torch.finfo(torch.float16).min, float("-inf"), float("nan")], dtype=torch.float16)
        choice = dropped[torch.randint(0, 3, shape, generator=gen)]
        return kept, torch.where(kept, values, choice)
    return kept, kept


# Every dtype kind on every shape in one block size, and every block size on one shape.
PACKINGS = [(shape, kind, (64, 64)) for shape in SHAPES for kind in ("bool", "int", "float")] + [
    (SHAPES[0], "bool", block_size) for block_size in BLOCKS
]


@pytest.mark.parametrize(
    "shape,kind,block_size", PACKINGS, ids=lambda p: "x".join(map(str, p)) if isinstance(p, tuple) else str(p)
)
def test_words_and_states_match_the_torch_packing(shape, kind, block_size):
    kept, mask = _mask(shape, kind, f"{shape}{kind}")
    words, state = pack_bits(mask.to(DEVICE), *block_size)
    expected = pack_mask_words(kept)
    assert torch.equal(words.cpu(), expected)
    assert torch.equal(state.cpu(), block_states(expected, shape, block_size))


def test_strided_and_broadcast_masks_pack_as_their_values():
    kept, _ = _mask((1, 2, 90, 77), "bool", "strided")
    keys_outer = kept.transpose(2, 3).contiguous().transpose(2, 3).to(DEVICE)  # stride 1 on queries
    broadcast = kept[:, :1].expand(2, 3, 90, 77).to(DEVICE)  # stride 0 on batch and heads
    assert torch.equal(pack_bits(keys_outer, 32, 32)[0].cpu(), pack_mask_words(kept))
    words, state = pack_bits(broadcast, 64, 64)
    assert torch.equal(words.cpu(), pack_mask_words(kept[:, :1].expand(2, 3, 90, 77)))
    assert torch.equal(state.cpu(), block_states(words.cpu(), (2, 3, 90, 77), (64, 64)))



def test_masks_of_one_layout_at_other_offsets_pack_as_their_values():
    # Same shape, strides and misalignment to 16 bytes: only the offset says whether four bytes read as an int32.
    kept, _ = _mask((1, 2, 40, 64), "bool", "offsets")
    storage = torch.zeros(kept.numel() + 8, dtype=torch.bool, device=DEVICE)
    for offset in (4, 1):
        mask = storage[offset:offset + kept.numel()].view(kept.shape)
        mask.copy_(kept)
        words, state = pack_bits(mask, 64, 64)
        assert torch.equal(words.cpu(), pack_mask_words(kept))
        assert torch.equal(state.cpu(), block_states(words.cpu(), kept.shape, (64, 64)))
