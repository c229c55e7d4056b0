"""CUDA graphs: a training step and a decode step that call flash-dma, with the mask's key list or
block summary built inside the call, and a top-k training step (each way it runs), capture once
and replay like eager on new input values."""

import pytest
import torch

from flash_dma import flash_dma_func, flash_dma_topk_func
from flash_dma.benchmark.measure import capture_graph
from tests.helpers import DEVICE

pytestmark = pytest.mark.gpu_only


def _fill(tensors, gen):
    """New values, written in place (a graph replays on the same memory)."""
    for t in tensors:
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=gen) < 0.3)
        else:
            t.copy_(torch.randn(t.shape, generator=gen))


@pytest.mark.parametrize("mask_shape", ["1,Hkv,1,S", "1,H,S,S", None], ids=str)
def test_training_step_replays_like_eager(mask_shape):
    gen = torch.Generator().manual_seed(0)
    batch, seqlen, heads, kv_heads, head_dim = 1, 300, 4, 2, 64
    sizes = {"1": 1, "H": heads, "Hkv": kv_heads, "S": seqlen}
    dtype = torch.bfloat16
    q = torch.empty(batch, seqlen, heads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.empty(batch, seqlen, kv_heads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    bias = torch.empty(1, kv_heads, 1, seqlen, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.empty(batch, seqlen, heads, head_dim, device=DEVICE, dtype=dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.empty([sizes[s] for s in mask_shape.split(",")], device=DEVICE, dtype=torch.bool)
    inputs = [t for t in (q, k, v, bias, dout, mask) if t is not None]

    def step():
        out = flash_dma_func(q, k, v, mask, bias, is_causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v, bias), dout))

    with torch.no_grad():
        _fill(inputs, gen)
    graph, captured = capture_graph(step)
    for _ in range(2):
        with torch.no_grad():
            _fill(inputs, gen)
        graph.replay()
        expected = step()
        for name, got, want in zip(("out", "dq", "dk", "dv", "dbias"), captured, expected):
            if name in ("out", "dq"):
                assert torch.equal(got, want), name
            else:  # added up by atomics, in whatever order they land: a rounding apart
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=name)


def test_decode_step_replays_like_eager():
    gen = torch.Generator().manual_seed(1)
    seqlen_k, heads, kv_heads, head_dim = 4096, 8, 2, 128
    dtype = torch.bfloat16
    q = torch.empty(1, 1, heads, head_dim, device=DEVICE, dtype=dtype)
    k, v = (torch.empty(1, seqlen_k, kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
    bias = torch.empty(1, kv_heads, 1, seqlen_k, device=DEVICE, dtype=torch.float32)

    def step():
        keep = bias >= bias.topk(512, dim=-1).values[..., -1:]  # the top 512 keys per head
        return (flash_dma_func(q, k, v, keep, bias, is_causal=True),)

    _fill((q, k, v, bias), gen)
    graph, captured = capture_graph(step)
    for _ in range(2):
        _fill((q, k, v, bias), gen)
        graph.replay()
        assert torch.equal(captured[0], step()[0])


def test_topk_training_step_replays_like_eager(topk_walk):
    gen = torch.Generator().manual_seed(2)
    batch, seqlen, heads, kv_heads, head_dim, width = 1, 300, 4, 2, 64, 32
    dtype = torch.bfloat16
    q = torch.empty(batch, seqlen, heads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.empty(batch, seqlen, kv_heads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    bias = torch.empty(batch, seqlen, kv_heads, width, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.empty(batch, seqlen, heads, head_dim, device=DEVICE, dtype=dtype)
    indices = torch.empty(batch, seqlen, kv_heads, width, device=DEVICE, dtype=torch.int32)

    def step():
        out = flash_dma_topk_func(q, k, v, indices, bias, is_causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v, bias), dout))

    def fill():
        with torch.no_grad():
            _fill((q, k, v, bias, dout), gen)
            indices.copy_(torch.randint(-1, seqlen, indices.shape, generator=gen))  # -1, repeats, past the diagonal

    fill()
    graph, captured = capture_graph(step)
    for _ in range(2):
        fill()
        graph.replay()
        expected = step()
        for name, got, want in zip(("out", "dq", "dk", "dv", "dbias"), captured, expected):
            if name in ("out", "dq"):
                assert torch.equal(got, want), name
            else:  # added up by atomics, in whatever order they land: a rounding apart
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=name)
