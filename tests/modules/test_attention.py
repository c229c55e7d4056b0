"""DynamicMaskAttention: its selection (per key, per block, per query by its indexer), its output
against an SDPA oracle, gradients, padding, options."""

import pytest
import torch
import torch.nn.functional as F

from flash_dma.block_mask import EMPTY
from flash_dma.modules import DynamicMaskAttention, KVCache, RotaryEmbedding
from tests.helpers import DEVICE, ON_GPU
from tests.test_masks import brute_force_topk

HIDDEN, HEADS, KV_HEADS = 32, 4, 2


def make_layer(seed: int = 0, **kwargs) -> DynamicMaskAttention:
    torch.manual_seed(seed)
    layer = DynamicMaskAttention(HIDDEN, HEADS, KV_HEADS, **kwargs).to(DEVICE)
    if layer.indexer is None:
        with torch.no_grad():
            layer.A.copy_(torch.linspace(0.5, 1.5, KV_HEADS))  # a trained-looking A: keys are no longer tied
    return layer


def make_inputs(batch: int = 2, seqlen: int = 40, seed: int = 1, padded: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seqlen, HIDDEN, generator=gen).to(DEVICE)
    padding = torch.ones(batch, seqlen, dtype=torch.bool, device=DEVICE)
    padding[-1, :padded] = False  # left padding of the last sequence
    return x, (padding if padded else None)


def sdpa_oracle(layer: DynamicMaskAttention, x: torch.Tensor, keep: torch.Tensor, bias=None, causal=True) -> torch.Tensor:
    """The layer's output computed with PyTorch SDPA: the bias (by default the layer's per key) as an
    additive float mask over the kept keys [B, Hkv, 1|S, S], causal; a query that sees no key
    outputs 0 (the flash_dma contract)."""
    batch, seqlen, _ = x.shape
    group = HEADS // KV_HEADS
    q = layer.q_proj(x).view(batch, seqlen, HEADS, -1)
    k = layer.k_proj(x).view(batch, seqlen, KV_HEADS, -1)
    v = layer.v_proj(x).view(batch, seqlen, KV_HEADS, -1)
    positions = torch.arange(seqlen, device=x.device)[None]
    q, k = layer.rotary(q, positions), layer.rotary(k, positions)
    bias = layer.key_importance(v) if bias is None else bias
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril(0 if causal else seqlen)
    visible = (keep & causal).repeat_interleave(group, dim=1)
    additive = bias.repeat_interleave(group, dim=1).expand(-1, -1, seqlen, -1).masked_fill(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(group, dim=2).transpose(1, 2),
        v.repeat_interleave(group, dim=2).transpose(1, 2),
        attn_mask=additive,
    )
    out = torch.where(visible.any(-1, keepdim=True), out, 0.0)
    return layer.o_proj(out.transpose(1, 2).reshape(batch, seqlen, -1))


def indexer_scores(layer: DynamicMaskAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's indexer scores of every pair, [B, Hkv, S, S], computed densely."""
    query, key, weight = layer.indexer(x, torch.arange(x.shape[1], device=x.device)[None])
    dots = torch.einsum("bihed,bjhd->bheij", query, key)
    return torch.einsum("bihe,bheij->bhij", weight, dots.relu())


def make_per_query_layer(seed: int = 0, **kwargs) -> DynamicMaskAttention:
    torch.manual_seed(seed)
    layer = DynamicMaskAttention(HIDDEN, HEADS, KV_HEADS, indexer_heads=2, indexer_dim=8, **kwargs).to(DEVICE)
    with torch.no_grad():
        layer.indexer.w_proj.weight.normal_()  # a trained-looking indexer: its scores are no longer all 0
    return layer


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_per_query_selection_keeps_each_querys_top_keys_and_matches_sdpa(causal):
    layer = make_per_query_layer(window_size=7, is_causal=causal)
    x, padding = make_inputs(seqlen=30, padded=6)
    out, selection = layer(x, padding, return_selection=True)
    scores = indexer_scores(layer, x)
    visible = padding[:, None, None, :] & (torch.ones(30, 30, dtype=torch.bool, device=DEVICE).tril(0 if causal else 30))
    expected_keep = brute_force_topk(scores.detach(), visible, 7)
    assert selection["block_mask"] is None
    assert torch.equal(selection["attn_mask"].dense().cpu(), expected_keep)
    kept = expected_keep.sum(-1)
    if causal:  # the causal rule: query i chooses among keys 0..i, so it keeps min(7, real keys up to i)
        assert torch.equal(kept[0, 0], torch.arange(1, 31).clamp(max=7))
    else:
        assert (kept == 7).all()
    expected = sdpa_oracle(layer, x, expected_keep.to(DEVICE), bias=scores, causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_per_query_gradients_reach_the_indexer():
    torch.manual_seed(0)
    layer = DynamicMaskAttention(HIDDEN, HEADS, KV_HEADS, window_size=6, indexer_heads=2, indexer_dim=8).to(DEVICE)
    assert not hasattr(layer, "dt_proj") and not hasattr(layer, "A")
    x, padding = make_inputs(padded=3)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    # At initialisation the indexer's weights are 0: they get a gradient, its projections exactly 0.
    layer(x, padding).square().mean().backward()
    assert layer.indexer.w_proj.weight.grad.abs().sum() > 0
    assert not layer.indexer.q_proj.weight.grad.any() and not layer.indexer.k_proj.weight.grad.any()
    optimizer.step()
    optimizer.zero_grad()
    layer(x, padding).square().mean().backward()
    for name, parameter in layer.indexer.named_parameters():
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().sum() > 0, f"no gradient reached {name}"


def test_per_query_triton_backend_matches_reference_and_repeats_bitwise(topk_walk):
    x, padding = make_inputs(seqlen=33, padded=4)
    outputs, grads = [], []
    # The repeat on a GPU only (REPEATS_ON_GPU says why).
    for backend in ("reference", "triton", *(("triton",) if ON_GPU else ())):
        layer = make_per_query_layer(window_size=10, backend=backend, qk_norm=True)
        out = layer(x, padding)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append([p.grad for p in layer.indexer.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)
    for reference_grad, triton_grad in zip(*grads[:2]):
        torch.testing.assert_close(triton_grad, reference_grad, atol=1e-3, rtol=1e-3)
    if ON_GPU:
        assert torch.equal(outputs[2], outputs[1])
        for triton_grad, again in zip(*grads[1:]):
            assert torch.equal(again, triton_grad)


def test_token_selection_keeps_the_top_keys_and_matches_sdpa():
    layer = make_layer(window_size=9)
    x, padding = make_inputs(padded=5)
    out, selection = layer(x, padding, return_selection=True)
    bias = layer.key_importance(layer.v_proj(x).view(*x.shape[:2], KV_HEADS, -1))
    expected_keep = brute_force_topk(bias.detach(), padding[:, None, None, :], 9)
    assert selection["block_mask"] is None
    assert torch.equal(selection["attn_mask"].cpu(), expected_keep)
    torch.testing.assert_close(out, sdpa_oracle(layer, x, selection["attn_mask"]), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("local_blocks", [0, 1])
def test_block_selection_matches_sdpa_over_the_kept_blocks(local_blocks):
    layer = make_layer(window_size=16, block_size=16, sink_blocks=1, local_blocks=local_blocks)
    x, padding = make_inputs(seqlen=70, padded=20)
    out, selection = layer(x, padding, return_selection=True)
    summary = selection["block_mask"]
    assert summary.mask_shape == (2, KV_HEADS, 70 if local_blocks else 1, 70)
    rows = 70 if local_blocks else 1
    keep = (summary.dense_rows(0, rows, 70) != EMPTY) & padding[:, None, None, :]
    torch.testing.assert_close(out, sdpa_oracle(layer, x, keep), atol=1e-5, rtol=1e-4)


def test_window_covering_every_key_equals_dense():
    x, _ = make_inputs()
    dense = make_layer(window_size=None)(x)
    full_window = make_layer(window_size=40)(x)
    torch.testing.assert_close(full_window, dense)


@pytest.mark.parametrize(
    "kwargs",
    [dict(window_size=8), dict(window_size=16, block_size=16, local_blocks=1), dict(window_size=8, importance="exp")],
    ids=["token", "block", "exp"],
)
def test_gradients_reach_A_and_dt_proj(kwargs):
    torch.manual_seed(0)
    layer = DynamicMaskAttention(HIDDEN, HEADS, KV_HEADS, **kwargs).to(DEVICE)
    x, padding = make_inputs(padded=3)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    # At initialisation A = 0: A has a gradient, and dt_proj's is exactly 0 (it flows through A).
    layer(x, padding).square().mean().backward()
    assert layer.A.grad.abs().min() > 0
    assert not layer.dt_proj.weight.grad.any()
    optimizer.step()
    optimizer.zero_grad()
    layer(x, padding).square().mean().backward()
    for name, grad in (("A", layer.A.grad), ("dt_proj", layer.dt_proj.weight.grad)):
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, f"no gradient reached {name}"


@pytest.mark.parametrize("kwargs", [dict(window_size=6), dict(window_size=16, block_size=16, local_blocks=2)], ids=["token", "block"])
def test_padded_tokens_never_influence_real_ones(kwargs):
    layer = make_layer(**kwargs)
    x, padding = make_inputs(seqlen=50, padded=12)
    changed = x.clone()
    changed[-1, :12] = 100.0  # garbage in the padded positions
    real = padding[-1]
    out, out_changed = layer(x, padding), layer(changed, padding)
    torch.testing.assert_close(out_changed[-1, real], out[-1, real])


def test_triton_backend_matches_reference():
    x, padding = make_inputs(seqlen=33, padded=4)
    outputs, grads = [], []
    for backend in ("reference", "triton"):
        layer = make_layer(window_size=10, backend=backend, qk_norm=True)
        out = layer(x, padding)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append((layer.A.grad, layer.dt_proj.weight.grad))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)
    for triton_grad, reference_grad in zip(grads[1], grads[0]):
        torch.testing.assert_close(triton_grad, reference_grad, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu_only
def test_cuda_forward_and_backward_match_cpu():
    x, padding = make_inputs(seqlen=300, padded=7)
    results = []
    for device in ("cpu", "cuda"):
        layer = make_layer(window_size=64, block_size=64, sink_blocks=1).to(device)
        out = layer(x.to(device), padding.to(device))
        out.square().sum().backward()
        results.append((out.detach().cpu(), layer.A.grad.cpu(), layer.dt_proj.weight.grad.cpu()))
    for cuda_value, cpu_value in zip(results[1], results[0]):
        torch.testing.assert_close(cuda_value, cpu_value, atol=2e-3, rtol=2e-3)


def test_options_run_and_inputs_are_untouched():
    layer = make_layer(window_size=5, qk_norm=True, importance="exp", rope_base=None, is_causal=False, proj_bias=True)
    x, padding = make_inputs(padded=2)
    before = x.clone(), padding.clone()
    out, selection = layer(x, padding.int(), return_selection=True)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert selection["attn_mask"].sum(-1).max() == 5
    bias = layer.key_importance(layer.v_proj(x).view(*x.shape[:2], KV_HEADS, -1))
    assert bias.shape == (2, KV_HEADS, 1, 40) and (bias >= 1).all()  # exp(A * softplus(.)) with A > 0
    assert torch.equal(x, before[0]) and torch.equal(padding, before[1])


def test_rotary_depends_only_on_relative_position():
    rotary = RotaryEmbedding(16).to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 1, 1, 16, generator=gen).to(DEVICE) for _ in range(2))

    def score(i, j):
        positions = lambda p: torch.tensor([[p]], device=DEVICE)  # noqa: E731
        return (rotary(q, positions(i)) * rotary(k, positions(j))).sum()

    torch.testing.assert_close(score(7, 3), score(107, 103))
    torch.testing.assert_close(rotary(q, torch.tensor([[5]], device=DEVICE)).norm(), q.norm())
    assert not torch.allclose(score(7, 3), score(7, 4))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_kv_heads=3), ValueError, r"num_kv_heads: must divide num_heads = 4, got 3"),
        (dict(hidden_size=30), ValueError, r"head_dim: hidden_size = 30 is not a multiple of num_heads = 4"),
        (dict(block_size=48), ValueError, r"block_size: expected a pair of values"),
        (dict(local_blocks=1), ValueError, r"local_blocks: only block selection uses it; set block_size"),
        (dict(importance="sigmoid"), ValueError, r"importance: expected one of 'softplus', 'exp', got 'sigmoid'"),
        (dict(window_size=-2), ValueError, r"window_size: expected an int >= 1, got -2"),
        (dict(window_size=0), ValueError, r"window_size: expected an int >= 1, got 0"),
        (dict(window_size=0, block_size=16), ValueError, r"window_size: expected an int >= 1, got 0"),
        (dict(head_dim=7), ValueError, r"head_dim: rotary embedding needs an even head dimension, got 7"),
        (dict(indexer_heads=-1), ValueError, r"indexer_heads: expected an int >= 0, got -1"),
        (dict(indexer_heads=2, window_size=None), ValueError,
         r"indexer_heads: per-query selection keeps window_size single keys per query: .* got window_size=None"),
        (dict(indexer_heads=2, block_size=16), ValueError, r"indexer_heads: per-query selection .* block_size=16"),
        (dict(indexer_heads=2, indexer_dim=5), ValueError, r"indexer_dim: the rotary embedding needs an even"),
    ],
    ids=["kv-heads", "hidden", "block", "local", "importance", "window", "window-0", "window-0-blocks", "rotary",
         "indexer-heads", "indexer-dense", "indexer-blocks", "indexer-rotary"],
)
def test_bad_arguments_are_named(kwargs, error, message):
    arguments = dict(hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS)
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        DynamicMaskAttention(**arguments)


def test_bad_inputs_are_named():
    layer = make_layer()
    with pytest.raises(ValueError, match=r"hidden_states: expected \[B, S, 32\], got shape \(2, 5, 16\)"):
        layer(torch.zeros(2, 5, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 5\) \[B, S\], got \(2, 6\)"):
        layer(torch.zeros(2, 5, HIDDEN, device=DEVICE), torch.ones(2, 6, dtype=torch.bool, device=DEVICE))
    expected = r"hidden_states: expected dtype torch.float32 \(the dtype of this layer's parameters\), got torch.float16"
    with pytest.raises(TypeError, match=expected):
        layer(torch.zeros(2, 5, HIDDEN, dtype=torch.float16, device=DEVICE))


def test_per_query_selection_refuses_a_cache_and_context_parallel():
    layer = make_per_query_layer(window_size=4)
    x, _ = make_inputs(seqlen=6)
    cache = KVCache(2, 8, KV_HEADS, HIDDEN // HEADS, device=DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache: per-query selection \(indexer_heads > 0\) runs without one"):
        layer(x, cache=cache)
    with pytest.raises(ValueError, match=r"context_parallel: per-query selection \(indexer_heads > 0\) runs without one"):
        layer(x, context_parallel=object())
    assert cache.length == 0


def test_autocast_takes_inputs_of_its_own_dtype():
    layer = make_layer(window_size=8)
    x, _ = make_inputs()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = layer(x.bfloat16())
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


EMPTY_SEQUENCE_SELECTIONS = {
    "token": dict(window_size=8),
    "dense": dict(window_size=None),
    "block-local": dict(window_size=16, block_size=16, local_blocks=1),
}


@pytest.mark.parametrize(
    "kwargs", [*EMPTY_SEQUENCE_SELECTIONS.values(), dict(window_size=8, indexer_heads=2)],
    ids=[*EMPTY_SEQUENCE_SELECTIONS.keys(), "per-query"],
)
def test_empty_sequence_gives_an_empty_output_with_gradients(kwargs):
    layer = make_layer(qk_norm=True, **kwargs)
    x = torch.zeros(2, 0, HIDDEN, device=DEVICE, requires_grad=True)
    out, selection = layer(x, torch.ones(2, 0, dtype=torch.bool, device=DEVICE), return_selection=True)
    assert out.shape == (2, 0, HIDDEN) and selection == {"attn_mask": None, "block_mask": None}
    out.sum().backward()
    assert x.grad.shape == x.shape
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None and not parameter.grad.any(), name


@pytest.mark.parametrize("kwargs", EMPTY_SEQUENCE_SELECTIONS.values(), ids=EMPTY_SEQUENCE_SELECTIONS.keys())
def test_empty_sequence_leaves_a_cache_as_it_is(kwargs):
    layer = make_layer(**kwargs)
    x, _ = make_inputs(seqlen=6)
    cache = KVCache(2, 8, KV_HEADS, HIDDEN // HEADS, device=DEVICE)
    with torch.no_grad():
        layer(x[:, :5], cache=cache)
        empty = layer(x[:, :0], cache=cache)
        after = layer(x[:, 5:], cache=cache)
        expected = layer(x)[:, 5:]
    assert empty.shape == (2, 0, HIDDEN) and cache.length == 6
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-4)
