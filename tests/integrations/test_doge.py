"""transformers' Doge under attn_implementation="flash_dma" (``flash_dma/integrations/doge.py``) against "sdpa"."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DogeConfig
from transformers.models.doge import modeling_doge

from flash_dma import BitMask
from flash_dma.integrations import doge
from flash_dma.integrations import transformers as integration
from flash_dma.integrations.transformers import ATTENTION_NAME, register
from tests.helpers import DEVICE

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    keep_window_size=8, is_moe=False,
)


def doge_models(dtype=torch.float32, device="cpu", **overrides):
    """``(sdpa, flash_dma)`` Doge models with the same random weights, ``A`` drawn away from 0 so that
    the keys' dynamic scores differ (at Doge's A = 0 every key ties)."""
    register()
    config = DogeConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    for layer in reference.model.layers:
        torch.nn.init.normal_(layer.self_attn.A)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ATTENTION_NAME)
    ours.load_state_dict(reference.state_dict())
    return reference.to(device, dtype), ours.to(device, dtype)


def tokens(batch: int = 2, seqlen: int = 40, device="cpu") -> torch.Tensor:
    return torch.randint(1, 97, (batch, seqlen), generator=torch.Generator().manual_seed(1)).to(device)


def test_loss_logits_and_gradients_match_sdpa():
    reference, ours = doge_models()
    input_ids = tokens()
    expected, actual = reference(input_ids, labels=input_ids), ours(input_ids, labels=input_ids)
    torch.testing.assert_close(actual.logits, expected.logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-6, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    grads = dict(ours.named_parameters())
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, parameter.grad, atol=2e-5, rtol=1e-4, msg=name)
    assert grads["model.layers.0.self_attn.A"].grad.abs().sum() > 0 and grads["model.layers.1.self_attn.dt_proj.weight"].grad.abs().sum() > 0


def test_the_kernels_get_a_bias_per_key_and_a_bit_mask(monkeypatch):
    """No [B, H, S, S] float mask: the bias per key, and Doge's own selection packed one bit per pair."""
    _, ours = doge_models()
    seen, selections = [], []
    real_call, real_prepare = integration.flash_dma_func, doge._prepare_dynamic_mask

    def prepare(original, layer, hidden_states, dt_states, keep_window_size, attention_mask):
        # What Doge itself keeps, from the causal mask this transformers hands it (5.23 a bool
        # [B, 1, S, S]; earlier versions None, and Doge then ranks every key).
        doge_mask = original(layer, hidden_states, dt_states, keep_window_size, attention_mask)
        selections.append((doge_mask > torch.finfo(doge_mask.dtype).min, attention_mask))
        return real_prepare(original, layer, hidden_states, dt_states, keep_window_size, attention_mask)

    monkeypatch.setattr(doge, "_prepare_dynamic_mask", prepare)
    monkeypatch.setattr(integration, "flash_dma_func", lambda *args, **kwargs: (seen.append(args[3:5]), real_call(*args, **kwargs))[1])
    ours(tokens(seqlen=30))
    assert len(seen) == len(selections) == TINY["num_hidden_layers"]
    for (mask, bias), (expected, causal_mask) in zip(seen, selections):
        assert isinstance(mask, BitMask) and mask.shape == (2, TINY["num_key_value_heads"], 30, 30)
        assert bias.shape == (2, TINY["num_attention_heads"], 1, 30)
        kept = mask.dense()
        assert torch.equal(kept, expected)
        if causal_mask is not None:  # each query keeps keep_window_size of its visible keys (or all)
            assert torch.equal(kept.sum(-1), torch.clamp(torch.arange(1, 31), max=TINY["keep_window_size"]).expand(2, 2, 30))
            assert not (kept & torch.ones(30, 30, dtype=torch.bool).triu(1)).any()
    assert all(not hasattr(layer.self_attn, doge._SELECTION) for layer in ours.model.layers)


def test_generation_with_a_cache_matches_sdpa():
    reference, ours = doge_models()
    input_ids = tokens(batch=1, seqlen=12)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(input_ids, **settings), reference.generate(input_ids, **settings))


def test_a_doge_that_does_not_fit_is_refused(monkeypatch):
    def prepare_dynamic_mask(self, hidden_states, dt_states, window):  # another signature
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_doge.DogeAttention, "prepare_dynamic_mask", prepare_dynamic_mask)
    with pytest.raises(RuntimeError, match="DogeAttention does not fit"):
        doge.install()


@pytest.mark.gpu_only
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_bf16_matches_sdpa_within_its_own_error():
    """On the GPU in bf16 (the Triton kernels; Hopper ones on sm90): loss and gradients within
    twice SDPA's own bf16 error against the float32 model, plus a small floor."""
    config = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, keep_window_size=128, num_hidden_layers=2)
    reference32, _ = doge_models(torch.float32, "cuda", **config)
    reference16, ours16 = doge_models(torch.bfloat16, "cuda", **config)
    input_ids = tokens(batch=2, seqlen=1024, device="cuda")
    runs = {}
    for name, model in (("fp32", reference32), ("sdpa", reference16), ("ours", ours16)):
        out = model(input_ids, labels=input_ids)
        out.loss.backward()
        runs[name] = (out.loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if "self_attn" in n})
    truth, sdpa, ours = runs["fp32"], runs["sdpa"], runs["ours"]
    assert (ours[0] - truth[0]).abs() <= 2 * (sdpa[0] - truth[0]).abs() + 1e-2
    for name, grad in truth[1].items():
        allowed = 2 * (sdpa[1][name] - grad).abs().max() + 1e-2 * grad.abs().max()
        assert (ours[1][name] - grad).abs().max() <= allowed, name
