"""The layer suite's stack of DynamicMaskAttention layers, at CPU size in float32."""

import pytest
import torch

from flash_dma.benchmark import layers
from flash_dma.block_mask import FULL
from tests.helpers import DEVICE

SEQLEN = 128


@pytest.fixture
def tiny_layers(monkeypatch):
    """Hidden 64, 4/2 heads, 32 keys kept in blocks of 16 plus the first block, float32."""
    tiny = dict(hidden_size=64, num_heads=4, num_kv_heads=2, window_size=32, block_size=16, sink_blocks=1)
    monkeypatch.setattr(layers, "LAYER_CONFIG", tiny)
    monkeypatch.setattr(layers, "MODEL_DTYPE", torch.float32)
    return torch.randint(1, 97, (1, SEQLEN), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def test_the_sparse_and_dense_stacks_share_weights_and_train(tiny_layers):
    sparse, dense = layers.build_layers(False, DEVICE), layers.build_layers(True, DEVICE)
    assert [layer.window_size for layer in dense.layers] == [None] * layers.LAYER_COUNT
    for a, b in zip(sparse.parameters(), dense.parameters(), strict=True):
        assert torch.equal(a, b)
    for stack in (sparse, dense):
        loss = stack(tiny_layers)
        loss.backward()
        assert loss.dim() == 0 and all(p.grad is not None for p in stack.parameters())
    # 32 of 128 keys (and the first block) per query: the sparse step is not the dense one.
    assert not torch.allclose(sparse(tiny_layers), dense(tiny_layers))


def test_a_window_over_every_key_gives_the_dense_stack(tiny_layers, monkeypatch):
    monkeypatch.setitem(layers.LAYER_CONFIG, "window_size", SEQLEN)
    sparse, dense = layers.build_layers(False, DEVICE), layers.build_layers(True, DEVICE)
    torch.testing.assert_close(sparse(tiny_layers), dense(tiny_layers))


def test_the_selection_step_keeps_the_window_and_the_sink_block(tiny_layers):
    stack = layers.build_layers(False, DEVICE)
    state = layers.selection_step(stack, tiny_layers)()  # [1, Hkv, 1, S / block]
    assert state.shape == (1, 2, 1, SEQLEN // 16)
    assert ((state == FULL).sum(-1) == 32 // 16 + 1).all() and (state[..., 0] == FULL).all()
