"""torch.compile traces models that call flash-dma: no graph breaks, no recompile per length."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from flash_dma import build_block_mask, flash_dma_func
from tests.helpers import DEVICE, KERNEL_DTYPES, Case, make_inputs


class TinyAttention(torch.nn.Module):
    """Projects a per-key bias from the values, keeps its top keys, attends causally."""

    def __init__(self, heads=4, kv_heads=2, head_dim=16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.importance = torch.nn.Linear(head_dim, 1)

    def forward(self, q, k, v):
        bias = self.importance(v).squeeze(-1).transpose(1, 2).unsqueeze(2)  # [B, Hkv, 1, Sk]
        keep = bias.detach() >= bias.detach().median(dim=-1, keepdim=True).values
        return flash_dma_func(q, k, v, keep, bias, is_causal=True, backend="triton")


def _compiled(model):
    counter = CompileCounterWithBackend("aot_eager")
    return torch.compile(model, backend=counter, fullgraph=True), counter


def test_fullgraph_forward_and_backward_match_eager():
    torch._dynamo.reset()
    model = TinyAttention().to(DEVICE, KERNEL_DTYPES[0])
    compiled, counter = _compiled(model)
    inputs = make_inputs(Case(seqlen_q=40, seqlen_k=40), KERNEL_DTYPES[0], requires_grad=True)
    q, k, v = inputs["query"], inputs["key"], inputs["value"]
    eager = model(q, k, v)
    eager.sum().backward()
    eager_grads = [t.grad.clone() for t in (q, k, v, model.importance.weight)]
    for t in (q, k, v, model.importance.weight):
        t.grad = None
    out = compiled(q, k, v)
    out.sum().backward()
    assert counter.frame_count == 1
    assert torch.equal(out, eager)
    for grad, expected in zip((q.grad, k.grad, v.grad, model.importance.weight.grad), eager_grads):
        torch.testing.assert_close(grad, expected)


def test_new_sequence_lengths_do_not_recompile_each_time():
    torch._dynamo.reset()
    compiled, counter = _compiled(TinyAttention().to(DEVICE, KERNEL_DTYPES[0]))
    for seqlen in (33, 47, 61, 75):
        inputs = make_inputs(Case(seqlen_q=seqlen, seqlen_k=seqlen), KERNEL_DTYPES[0])
        compiled(inputs["query"], inputs["key"], inputs["value"])
    # The first length compiles static, the second marks the length dynamic; no more after that.
    assert counter.frame_count <= 2


def test_block_mask_inside_the_graph():
    torch._dynamo.reset()

    def attend(q, k, v, mask, bias):
        return flash_dma_func(q, k, v, mask, bias, block_mask=build_block_mask(mask, block_size=(16, 16)), backend="triton")

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    case = Case(seqlen_q=30, seqlen_k=50, mask="B,Hkv,1,Sk", bias="1,H,1,Sk", mask_kind="blocks")
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    expected = attend(*inputs.values())
    assert torch.equal(compiled(*inputs.values()), expected)
    assert counter.frame_count == 1


def test_three_lengths_compile_once_when_dynamic():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(TinyAttention().to(DEVICE, KERNEL_DTYPES[0]), backend=counter, fullgraph=True, dynamic=True)
    for seqlen in (33, 61, 130):
        inputs = make_inputs(Case(seqlen_q=seqlen, seqlen_k=seqlen), KERNEL_DTYPES[0])
        compiled(inputs["query"], inputs["key"], inputs["value"])
    assert counter.frame_count == 1


@pytest.mark.gpu_only
def test_reduce_overhead_mode_replays_like_eager():
    """``mode="reduce-overhead"`` captures the training step (key list included) in CUDA graphs."""
    torch._dynamo.reset()
    model = TinyAttention(heads=8, kv_heads=2, head_dim=64).to(DEVICE, torch.bfloat16)

    def step(q, k, v):
        out = model(q, k, v)
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v, model.importance.weight)))

    compiled = torch.compile(step, mode="reduce-overhead")
    for seed in range(4):  # new values each call: replays must not return a stale result
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 256, 8, 64, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
        k, v = (torch.randn(1, 256, 2, 64, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(2))
        got = [t.clone() for t in compiled(q, k, v)]
        expected = step(q, k, v)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_topk_fullgraph_forward_and_backward_match_eager(topk_walk):
    from flash_dma import flash_dma_topk_func
    from tests.backends.triton.topk.test_forward_backward import SPLIT_WALKS, TopkCase, make_topk_inputs

    torch._dynamo.reset()
    # Unique lists for the walks that split the passes (their custom ops), repeats for the others.
    case = TopkCase(seqlen_q=20, seqlen_k=30, width=8, bias="keys:B,Hkv", causal=True, unique=topk_walk in SPLIT_WALKS)
    inputs = make_topk_inputs(case, KERNEL_DTYPES[0])
    leaves = [inputs[n] for n in ("query", "key", "value", "attn_bias")]

    def attend(q, k, v, bias, indices):
        return flash_dma_topk_func(q, k, v, indices, bias, is_causal=True, unique_indices=case.unique, backend="triton")

    eager = attend(*leaves, inputs["indices"])
    eager_grads = torch.autograd.grad(eager.sum(), leaves)
    compiled, counter = _compiled(attend)
    out = compiled(*leaves, inputs["indices"])
    grads = torch.autograd.grad(out.sum(), leaves)
    assert counter.frame_count == 1
    assert torch.equal(out, eager)
    for grad, expected in zip(grads, eager_grads):
        assert torch.equal(grad, expected)
