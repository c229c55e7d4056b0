"""v1's ``create_mask`` signatures, answered by flash-dma's mask builder."""

import pytest
import torch

from flash_dma.masks import create_mask as native_create_mask
from flash_dma.v1.utils.mask import create_mask


def _bias(shape=(2, 2, 1, 40)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def test_last_v1_signature_positionally():
    bias = _bias()
    padding = torch.arange(40)[None, :] < torch.tensor([[40], [25]])
    assert torch.equal(create_mask(bias, 7, "topk", padding, 10), native_create_mask(bias, padding, 2, 7, 40, 10))


def test_earlier_v1_keywords():
    bias = _bias((1, 2, 1, 40))
    padding = torch.ones(3, 40, dtype=torch.bool)
    mask = create_mask(attention_bias=bias, attention_mask=padding, batch_size=3, query_len=5, key_len=40, window_size=8)
    assert mask.shape == (3, 2, 1, 40) and torch.equal(mask.sum(-1), torch.full((3, 2, 1), 8))


def test_batch_size_comes_from_the_padding_mask():
    bias = _bias((1, 2, 1, 40))
    padding = torch.ones(3, 40, dtype=torch.bool)
    assert torch.equal(create_mask(bias, 5, attention_mask=padding, window_size=8), native_create_mask(bias, padding, 3, 5, 40, 8))


def test_relu_type_and_block_smoothing():
    bias = _bias()
    expected = native_create_mask(bias, None, 2, 1, 40, 0, block_size=4, kind="relu")
    assert torch.equal(create_mask(bias, 1, type="relu", block_size=4), expected)


def test_errors_name_v1_arguments():
    with pytest.raises(ValueError, match="type: expected one of"):
        create_mask(_bias(), 1, type="softmax", window_size=4)
    with pytest.raises(TypeError, match="attention_bias"):
        create_mask([1.0, 2.0], 1, window_size=1)
