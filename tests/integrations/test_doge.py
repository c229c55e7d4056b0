"""transformers' Doge under attn_implementation="flash_dma" (``flash_dma/integrations/doge.py``) against "eager".

The reference is Doge under "eager", which gets its causal mask materialised in every transformers
5.x. Under "sdpa", transformers before 5.23 hands Doge no mask for an unpadded batch, and Doge then
ranks every key, later ones included: a model that sees the future.
"""

import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, DogeConfig, DynamicCache
from transformers.models.doge import modeling_doge

from flash_dma import BitMask, KeyIntervals
from flash_dma.integrations import doge
from flash_dma.integrations import transformers as integration
from flash_dma.integrations.transformers import ATTENTION_NAME, register
from tests.helpers import DEVICE

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    keep_window_size=8, is_moe=False,
)


def doge_models(dtype=torch.float32, device="cpu", **overrides):
    """``(eager, flash_dma)`` Doge models with the same random weights, ``A`` drawn away from 0 so that
    the keys' dynamic scores differ (at Doge's A = 0 every key ties)."""
    register()
    config = DogeConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    for layer in reference.model.layers:
        torch.nn.init.normal_(layer.self_attn.A)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ATTENTION_NAME)
    ours.load_state_dict(reference.state_dict())
    return reference.to(device, dtype), ours.to(device, dtype)


def _asking(build, skippable: bool, **kwargs):
    """Doge's call of transformers' mask builder ``build``, asking for the mask materialised or not."""
    return build(**{**kwargs, "allow_is_causal_skip": skippable})


@pytest.fixture(params=["materialised", "skippable"])
def doge_asks(request):
    """How Doge asks transformers for its causal mask, whatever transformers is installed:
    materialised (``allow_is_causal_skip=False``, as from 5.23), or letting the mask function skip
    it (earlier 5.x), where flash_dma_mask hands Doge ``[B, Sk]`` padding, or None."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
            build = functools.partial(_asking, getattr(modeling_doge, name), request.param == "skippable")
            patch.setattr(modeling_doge, name, build)
        yield request.param


def tokens(batch: int = 2, seqlen: int = 40, device="cpu") -> torch.Tensor:
    """Distinct tokens in each row: a repeated token has the same value vector in the first layer,
    hence the same dt, a tie that flash-dma gives to the earlier key and Doge's torch.topk to either."""
    gen = torch.Generator().manual_seed(1)
    return torch.stack([torch.randperm(96, generator=gen)[:seqlen] + 1 for _ in range(batch)]).to(device)


def _assert_loss_and_gradients_match(reference, ours, expected_loss, loss) -> dict:
    """The losses match and so, after their backward, does every parameter's gradient; returns
    ``ours``'s parameters by name."""
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-5)
    expected_loss.backward()
    loss.backward()
    grads = dict(ours.named_parameters())
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, parameter.grad, atol=2e-5, rtol=1e-4, msg=name)
    return grads


def test_loss_logits_and_gradients_match_eager(doge_asks):
    reference, ours = doge_models()
    input_ids = tokens()
    expected, actual = reference(input_ids, labels=input_ids), ours(input_ids, labels=input_ids)
    torch.testing.assert_close(actual.logits, expected.logits, atol=2e-5, rtol=1e-4)
    grads = _assert_loss_and_gradients_match(reference, ours, expected.loss, actual.loss)
    assert grads["model.layers.0.self_attn.A"].grad.abs().sum() > 0 and grads["model.layers.1.self_attn.dt_proj.weight"].grad.abs().sum() > 0


def _own_selection(layer, hidden_states, dt_states, keep_window_size, visible) -> torch.Tensor:
    """What Doge's own ``prepare_dynamic_mask`` keeps (bool ``[B, Hkv, Sq, Sk]``) over ``visible``,
    the materialised mask (bool ``[B|1, 1, Sq, Sk]``) it reads as intended."""
    own = modeling_doge.DogeAttention.prepare_dynamic_mask.__wrapped__
    doge_mask = own(layer, hidden_states, dt_states, keep_window_size, visible)
    return doge_mask > torch.finfo(doge_mask.dtype).min


def _causal_rule(query_len: int, key_len: int, padding: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1, Sq, Sk]``: the bottom-right causal rule over the keys ``padding`` ``[B, Sk]`` keeps."""
    return torch.ones(query_len, key_len, dtype=torch.bool).tril(key_len - query_len) & padding.bool()[:, None, None, :]


def _selections(monkeypatch, model, *args, **kwargs) -> list:
    """Run ``model(*args, **kwargs)`` and return, per layer, ``(handed, mask, bias, expected)``: the
    mask Doge's layer was handed, the mask and bias the attention function got, and what Doge's own
    ``prepare_dynamic_mask`` keeps under the causal rule and the key padding
    (``kwargs["attention_mask"]``, 2-D; or a 4-D one, taken as it is)."""
    seen, selections = [], []
    real_call, real_prepare = integration.flash_dma_func, doge._prepare_dynamic_mask
    given = kwargs.get("attention_mask")

    def prepare(original, layer, hidden_states, dt_states, keep_window_size, attention_mask):
        query_len, key_len = hidden_states.shape[1], dt_states.shape[-1]
        if given is not None and given.dim() == 4:
            visible = given
        else:
            padding = torch.ones(dt_states.shape[0], key_len) if given is None else given[:, -key_len:]
            visible = _causal_rule(query_len, key_len, padding)
        selections.append((attention_mask, _own_selection(layer, hidden_states, dt_states, keep_window_size, visible)))
        return real_prepare(original, layer, hidden_states, dt_states, keep_window_size, attention_mask)

    monkeypatch.setattr(doge, "_prepare_dynamic_mask", prepare)
    monkeypatch.setattr(integration, "flash_dma_func", lambda *args, **kwargs: (seen.append(args[3:5]), real_call(*args, **kwargs))[1])
    model(*args, **kwargs)
    assert len(seen) == len(selections) == TINY["num_hidden_layers"]
    assert all(not hasattr(layer.self_attn, doge._SELECTION) for layer in model.model.layers)
    return [(handed, mask, bias, expected) for (mask, bias), (handed, expected) in zip(seen, selections)]


def test_the_kernels_get_a_bias_per_key_and_key_intervals(monkeypatch, doge_asks):
    """No [B, H, S, S] float mask: the bias per key, and Doge's selection under the causal rule
    (the mask "flash_dma" made it, or none) as one run of queries per key, made from dt by one
    kernel launch."""
    _, ours = doge_models()
    for handed, mask, bias, expected in _selections(monkeypatch, ours, tokens(seqlen=30)):
        assert (handed is None) == (doge_asks == "skippable")
        assert isinstance(mask, KeyIntervals) and mask.shape == (2, TINY["num_key_value_heads"], 30, 30)
        assert bias.shape == (2, TINY["num_attention_heads"], 1, 30)
        kept = mask.dense()
        assert torch.equal(kept, expected)
        # Each query keeps keep_window_size of its visible keys (or all of them).
        assert torch.equal(kept.sum(-1), torch.clamp(torch.arange(1, 31), max=TINY["keep_window_size"]).expand(2, 2, 30))
        assert not (kept & torch.ones(30, 30, dtype=torch.bool).triu(1)).any()


def test_padded_batches_select_from_the_key_padding(monkeypatch, doge_asks):
    """Left padding: the intervals skip the padded keys, whether Doge got the padding as a causal
    mask or as itself ([B, Sk]), and every real token matches "eager" (a padded query, which sees
    no key, gets 0 where eager attention averages every key)."""
    reference, ours = doge_models()
    input_ids = tokens(seqlen=30)
    padding = torch.ones(2, 30, dtype=torch.long)
    padding[1, :9] = 0
    labels = input_ids.masked_fill(padding == 0, -100)
    labels[1, 9] = -100  # predicted from the last padded position
    for handed, mask, _, expected in _selections(monkeypatch, ours, input_ids, attention_mask=padding):
        assert handed.dim() == (2 if doge_asks == "skippable" else 4)
        assert isinstance(mask, KeyIntervals) and torch.equal(mask.dense(), expected)
    monkeypatch.undo()
    expected, actual = reference(input_ids, attention_mask=padding, labels=labels), ours(input_ids, attention_mask=padding, labels=labels)
    real = padding.bool()
    torch.testing.assert_close(actual.logits[real], expected.logits[real], atol=2e-5, rtol=1e-4)
    _assert_loss_and_gradients_match(reference, ours, expected.loss, actual.loss)


@pytest.mark.parametrize("compiling", [False, True], ids=["not-compiling", "compiling"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("skip", [False, True], ids=["materialised", "skippable"])
@pytest.mark.parametrize("query_len", [30, 6, 1], ids=lambda n: f"Sq{n}")
def test_each_causal_mask_flash_dma_mask_hands_doge_is_the_causal_rule(monkeypatch, query_len, skip, padded, compiling):
    """flash_dma_mask's answer for a plain causal mask, queries after cached keys or not: a 4-D mask
    it recorded (Doge asks for it materialised, transformers 5.23 on), or, where Doge lets it skip
    (earlier 5.x), [B, Sk] padding or None. Each is the causal rule over the unpadded keys: Doge's
    own top-k over that mask materialised, as key intervals, or, under torch.compile (the layer is
    run as if compiling), as a BitMask from Doge's own torch.topk."""
    key_len, keep = 30, TINY["keep_window_size"]
    layer = doge_models()[1].model.layers[0].self_attn
    gen = torch.Generator().manual_seed(2)
    dt_states = torch.rand(2, TINY["num_key_value_heads"], key_len, generator=gen)
    hidden_states = torch.randn(2, query_len, TINY["hidden_size"], generator=gen)
    padding = torch.ones(2, key_len, dtype=torch.bool)
    if padded:
        padding[1, :9] = False
    handed = integration.flash_dma_mask(
        2, query_len, key_len, q_offset=key_len - query_len, attention_mask=padding if padded else None,
        allow_is_causal_skip=skip,
    )
    assert (handed is None) == (skip and not padded) and (handed is None or handed.dim() == (2 if skip else 4))
    expected = _own_selection(layer, hidden_states, dt_states, keep, _causal_rule(query_len, key_len, padding))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    bias = doge._prepare_dynamic_mask(None, layer, hidden_states, dt_states, keep, handed)
    selection = doge.take_selection(layer)
    assert torch.equal(bias, dt_states[:, :, None, :])
    assert isinstance(selection, BitMask if compiling else KeyIntervals)
    assert selection.shape == (2, TINY["num_key_value_heads"], query_len, key_len)
    assert torch.equal(selection.dense(), expected)


def test_a_padding_mask_not_over_the_keys_is_refused():
    layer = doge_models()[1].model.layers[0].self_attn
    dt_states, hidden_states = torch.rand(2, TINY["num_key_value_heads"], 30), torch.randn(2, 30, TINY["hidden_size"])
    with pytest.raises(ValueError, match=r"attention_mask: expected a padding mask \[B, Sk\] = \(2, 30\).*got shape \(2, 29\)"):
        doge._prepare_dynamic_mask(None, layer, hidden_states, dt_states, 8, torch.ones(2, 29, dtype=torch.bool))


def test_a_mask_of_the_callers_takes_dogess_own_top_k(monkeypatch):
    """A 4-D mask the caller made is not known to be causal: its selection is Doge's own
    torch.topk over it, packed one bit per pair, and the model still matches "eager"."""
    reference, ours = doge_models()
    input_ids = tokens(seqlen=30)
    visible = torch.ones(30, 30, dtype=torch.bool).tril()
    visible[20:, :5] = False  # later queries drop the first keys: not the causal rule alone
    mask = visible[None, None].expand(2, 1, 30, 30)
    for _, selection, _, expected in _selections(monkeypatch, ours, input_ids, attention_mask=mask):
        assert isinstance(selection, BitMask) and torch.equal(selection.dense(), expected)
    monkeypatch.undo()
    torch.testing.assert_close(ours(input_ids, attention_mask=mask).logits, reference(input_ids, attention_mask=mask).logits, atol=2e-5, rtol=1e-4)


def test_generation_with_a_cache_matches_eager(doge_asks):
    reference, ours = doge_models()
    input_ids = tokens(batch=1, seqlen=12)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(input_ids, **settings), reference.generate(input_ids, **settings))


def test_decoding_a_left_padded_batch_over_a_cache_matches_eager(doge_asks):
    """A DynamicCache, a prefill then one token at a time: each step selects from the key padding,
    its queries after the cached keys (bottom-right). The tokens are given rather than generated:
    a generated token may repeat an earlier one, a tie in the first layer (see tokens)."""
    reference, ours = doge_models()
    input_ids = tokens(seqlen=18)
    padding = torch.ones_like(input_ids)
    padding[1, :4] = 0
    caches = [DynamicCache(config=model.config) for model in (reference, ours)]
    for start, stop in ((0, 12), *((t, t + 1) for t in range(12, 18))):
        expected, actual = (
            model(input_ids[:, start:stop], attention_mask=padding[:, :stop], past_key_values=cache, use_cache=True).logits
            for model, cache in zip((reference, ours), caches)
        )
        real = padding[:, start:stop].bool()
        torch.testing.assert_close(actual[real], expected[real], atol=2e-5, rtol=1e-4)


def test_a_doge_that_does_not_fit_is_refused(monkeypatch):
    def prepare_dynamic_mask(self, hidden_states, dt_states, window):  # another signature
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_doge.DogeAttention, "prepare_dynamic_mask", prepare_dynamic_mask)
    with pytest.raises(RuntimeError, match="DogeAttention does not fit"):
        doge.install()


@pytest.mark.gpu_only
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_bf16_matches_eager_within_its_own_error():
    """On the GPU in bf16 (the Triton kernels; Hopper ones on sm90): loss and gradients within
    twice eager attention's own bf16 error against the float32 model, plus a small floor."""
    config = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, keep_window_size=128, num_hidden_layers=2)
    reference32, _ = doge_models(torch.float32, "cuda", **config)
    reference16, ours16 = doge_models(torch.bfloat16, "cuda", **config)
    # Repeats and bf16's rounding make ties in dt, which each implementation may break its own way.
    input_ids = torch.randint(1, 97, (2, 1024), generator=torch.Generator().manual_seed(1)).to("cuda")
    runs = {}
    for name, model in (("fp32", reference32), ("eager", reference16), ("ours", ours16)):
        out = model(input_ids, labels=input_ids)
        out.loss.backward()
        runs[name] = (out.loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if "self_attn" in n})
    truth, eager, ours = runs["fp32"], runs["eager"], runs["ours"]
    assert (ours[0] - truth[0]).abs() <= 2 * (eager[0] - truth[0]).abs() + 1e-2
    for name, grad in truth[1].items():
        allowed = 2 * (eager[1][name] - grad).abs().max() + 1e-2 * grad.abs().max()
        assert (ours[1][name] - grad).abs().max() <= allowed, name
