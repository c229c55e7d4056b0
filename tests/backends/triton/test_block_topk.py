"""The block top-k kernel selects exactly what the torch version of ``topk_block_mask`` selects.

``topk_block_mask`` takes the kernel on a CUDA device and under the Triton interpreter (``DEVICE``
here, whichever the suite runs on); the torch version runs on CPU tensors with the interpreter
off. Ties, NaN and infinite scores, padding, broadcast shapes and packed sequences all decide
which blocks are kept, so each is compared.
"""

import pytest
import torch

from flash_dma.masks import topk_block_mask
from tests.helpers import DEVICE


def _torch_version(monkeypatch, bias, mask, window_size, **kwargs):
    with monkeypatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return topk_block_mask(bias.cpu(), window_size, None if mask is None else mask.cpu(), **cpu)


def _assert_same_selection(monkeypatch, bias, mask, window_size, **kwargs):
    kernel = topk_block_mask(bias, window_size, mask, **kwargs)
    expected = _torch_version(monkeypatch, bias, mask, window_size, **kwargs)
    assert kernel.mask_shape == expected.mask_shape and kernel.needs_mask == expected.needs_mask
    assert torch.equal(kernel.state.cpu(), expected.state)
    assert torch.equal(kernel.kv_lists.cpu(), expected.kv_lists)
    assert torch.equal(kernel.q_lists.cpu(), expected.q_lists)


def _bias(shape, seed, kind="normal", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values: most blocks tie with others
        bias = torch.randint(0, 3, shape, generator=gen).float()
    else:
        bias = torch.randn(shape, generator=gen)
    return bias.to(DEVICE, dtype)


@pytest.mark.parametrize("reduce", ["max", "mean"])
@pytest.mark.parametrize(
    "block_k, key_len, window_size, sink_blocks",
    [(16, 200, 48, 0), (32, 1000, 256, 1), (64, 1000, 5000, 2), (128, 4096, 512, 1), (256, 700, 1, 0)],
    ids=lambda v: str(v),
)
def test_kernel_matches_the_torch_selection(monkeypatch, reduce, block_k, key_len, window_size, sink_blocks):
    bias = _bias((2, 3, 1, key_len), seed=key_len)
    _assert_same_selection(
        monkeypatch, bias, None, window_size, block_size=(64, block_k), reduce=reduce, sink_blocks=sink_blocks
    )


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_ties_go_to_the_lower_block(monkeypatch, reduce):
    bias = _bias((1, 4, 1, 777), seed=1, kind="ties")
    _assert_same_selection(monkeypatch, bias, None, 100, block_size=(16, 16), reduce=reduce, sink_blocks=1)


def test_nan_and_infinite_scores(monkeypatch):
    bias = _bias((2, 2, 1, 1000), seed=2)
    bias[0, 0, 0, 5] = float("nan")  # its block is never kept
    bias[1, 1, 0, 100:300] = float("-inf")  # blocks of -inf still rank among themselves, lower index first
    bias[1, 0, 0, 900] = float("inf")
    for reduce in ("max", "mean"):
        _assert_same_selection(monkeypatch, bias, None, 300, block_size=(32, 32), reduce=reduce)
        _assert_same_selection(monkeypatch, bias, None, 5000, block_size=(32, 32), reduce=reduce)


@pytest.mark.parametrize("mask_kind", ["2d", "4d-heads", "integer"])
def test_padding_masks_make_kept_blocks_partial(monkeypatch, mask_kind):
    gen = torch.Generator().manual_seed(4)
    bias = _bias((2, 3, 1, 1000), seed=4)
    if mask_kind == "2d":
        mask = torch.rand(2, 1000, generator=gen) > 0.3
        mask[1, :640] = False  # whole blocks without a real key are never kept
    elif mask_kind == "4d-heads":
        mask = torch.rand(1, 3, 1, 1000, generator=gen) > 0.5
    else:
        mask = (torch.rand(2, 1, 1, 1000, generator=gen) > 0.5).to(torch.int32)
    _assert_same_selection(monkeypatch, bias, mask.to(DEVICE), 256, block_size=(64, 64), sink_blocks=1)


def test_broadcast_bias_and_low_precision(monkeypatch):
    bias = _bias((1, 2, 1, 900), seed=5, dtype=torch.bfloat16)
    mask = (torch.rand(3, 900, generator=torch.Generator().manual_seed(5)) > 0.2).to(DEVICE)
    _assert_same_selection(monkeypatch, bias, mask, 128, block_size=(32, 32))
    _assert_same_selection(monkeypatch, bias.expand(3, 2, 1, 900), None, 128, block_size=(32, 32))


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_packed_sequences(monkeypatch, masked):
    cu = torch.tensor([0, 300, 700, 1000], dtype=torch.int32, device=DEVICE)
    bias = _bias((3, 1000), seed=6)
    mask = (torch.rand(3, 1000, generator=torch.Generator().manual_seed(6)) > 0.2).to(DEVICE) if masked else None
    _assert_same_selection(
        monkeypatch, bias, mask, 128, block_size=(64, 64), sink_blocks=1, cu_seqlens_k=cu, max_seqlen_k=400
    )


def test_the_inputs_are_not_modified():
    bias = _bias((2, 2, 1, 500), seed=7)
    mask = (torch.rand(2, 500, generator=torch.Generator().manual_seed(7)) > 0.5).to(DEVICE)
    before = bias.clone(), mask.clone()
    topk_block_mask(bias, 100, mask, block_size=(32, 32))
    assert torch.equal(bias, before[0]) and torch.equal(mask, before[1])
