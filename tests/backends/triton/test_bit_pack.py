"""The dense-mask packer: one kernel writes a BitMask's words and block states (``bit_pack.py``)."""

import pytest
import torch

from flash_dma.backends.triton.bit_pack import WALKS, _bytes_as_words, copy_engine_reads, pack_bits, pack_bits_walking
from flash_dma.bit_mask import block_states, pack_mask_words
from tests.helpers import DEVICE, seeded_generator

# The last shape's rows are 16-byte multiples in every dtype: the TMA walk copies them (rows of the
# next block and head included, which the kernel must ignore).
SHAPES = [(2, 3, 70, 100), (1, 2, 130, 47), (1, 1, 1, 45), (2, 1, 33, 1), (2, 3, 70, 96)]
BLOCKS = [(32, 32), (64, 256), (128, 128)]


def _mask(shape, kind: str, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept bool, the mask as given)``: random pairs, full and empty stretches, in ``kind``'s dtype.

    The first head's rows from 64 on are empty: a block whose rows stop before the next head's
    (which a TMA box copies) is EMPTY."""
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


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize(
    "shape,kind,block_size", PACKINGS, ids=lambda p: "x".join(map(str, p)) if isinstance(p, tuple) else str(p)
)
def test_words_and_states_match_the_torch_packing(shape, kind, block_size, walk):
    kept, mask = _mask(shape, kind, f"{shape}{kind}")
    words, state = pack_bits_walking(mask.to(DEVICE), *block_size, WALKS[walk])
    expected = pack_mask_words(kept)
    assert torch.equal(words.cpu(), expected)
    assert torch.equal(state.cpu(), block_states(expected, shape, block_size))


@pytest.mark.parametrize("walk", WALKS)
def test_strided_and_broadcast_masks_pack_as_their_values(walk):
    kept, _ = _mask((1, 2, 90, 77), "bool", "strided")
    keys_outer = kept.transpose(2, 3).contiguous().transpose(2, 3).to(DEVICE)  # stride 1 on queries
    broadcast = kept[:, :1].expand(2, 3, 90, 77).to(DEVICE)  # stride 0 on batch and heads
    assert torch.equal(pack_bits_walking(keys_outer, 32, 32, WALKS[walk])[0].cpu(), pack_mask_words(kept))
    words, state = pack_bits_walking(broadcast, 64, 64, WALKS[walk])
    assert torch.equal(words.cpu(), pack_mask_words(kept[:, :1].expand(2, 3, 90, 77)))
    assert torch.equal(state.cpu(), block_states(words.cpu(), (2, 3, 90, 77), (64, 64)))


def test_pack_bits_takes_the_shipped_walk():
    kept, mask = _mask((1, 2, 130, 47), "bool", "shipped")
    words, state = pack_bits(mask.to(DEVICE), 64, 64)
    assert torch.equal(words.cpu(), pack_mask_words(kept))
    assert torch.equal(state.cpu(), block_states(words.cpu(), (1, 2, 130, 47), (64, 64)))


def test_tma_copies_rows_that_form_one_aligned_matrix():
    walk = next(w for w in WALKS.values() if w.tma)
    mask = _mask(SHAPES[-1], "bool", "tma")[1].to(DEVICE)
    rows = mask.to(torch.float16)
    assert copy_engine_reads(walk, _bytes_as_words(mask), 16, 64)
    assert copy_engine_reads(walk, rows, 64, 32)
    assert not copy_engine_reads(walk._replace(tma=False), rows, 64, 32)
    unaligned = torch.zeros(2, 3, 70, 100, dtype=torch.float16, device=DEVICE)
    assert not copy_engine_reads(walk, unaligned, 64, 32)  # rows 200 bytes apart
    assert not copy_engine_reads(walk, rows[:, :, 1:], 64, 32)  # a row missing between heads
    assert not copy_engine_reads(walk, rows[:, :1].expand(2, 3, 70, 96), 64, 32)  # heads broadcast
    assert not copy_engine_reads(walk, rows.transpose(2, 3), 64, 32)  # keys not consecutive
    assert not copy_engine_reads(walk, rows, 512, 32)  # wider than a TMA box
