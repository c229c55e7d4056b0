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
    assert vt.shape == (batch, heads, head_dim, -(-seqlen_k // KEY_ALIGNMENT) * KEY_ALIGNMENT)
    assert torch.equal(vt[..., :seqlen_k].view(torch.uint8), v.permute(0, 2, 3, 1).view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), before.view(torch.uint8))
