"""``hopper/transpose.py``: the FP8 forward's keys-contiguous copy of V, against torch's permute."""

import pytest
import torch

from flash_dma.backends.triton.hopper.transpose import KEY_ALIGNMENT, transposed_values
from flash_dma.inputs import FP8_DTYPE
from tests.helpers import DEVICE


@pytest.mark.parametrize(
    "shape", [(2, 100, 3, 64), (1, 16, 1, 128), (1, 1, 2, 32), (2, 130, 2, 96), (1, 70, 1, 256)], ids=str,
)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_transposed_values_are_v_with_its_keys_contiguous(shape, strided):
    batch, seqlen_k, heads, head_dim = shape
    gen = torch.Generator().manual_seed(seqlen_k)
    v = torch.randn(batch, seqlen_k, heads, head_dim + (8 if strided else 0), generator=gen)[..., :head_dim]
    v = v.to(FP8_DTYPE).to(DEVICE)
    before = v.clone()
    vt = transposed_values(v)
    padded = -(-seqlen_k // KEY_ALIGNMENT) * KEY_ALIGNMENT
    assert vt.shape == (batch, heads, head_dim, padded)
    # Within each group of 16, column 4 t + 2 j + e holds key 8 j + 2 t + e (the order of wgmma's
    # accumulator columns held by thread t of a quad); keys past Sk are zeros.
    keys_in_group = torch.arange(16).reshape(2, 4, 2).permute(1, 0, 2).reshape(16)
    key_at_column = (torch.arange(padded) // 16 * 16 + keys_in_group.repeat(padded // 16)).to(DEVICE)
    expected = torch.zeros(batch, heads, head_dim, padded, dtype=torch.uint8, device=DEVICE)
    real = key_at_column < seqlen_k
    expected[..., real] = v.permute(0, 2, 3, 1).view(torch.uint8)[..., key_at_column[real]]
    assert torch.equal(vt.view(torch.uint8), expected)
    assert torch.equal(v.view(torch.uint8), before.view(torch.uint8))
