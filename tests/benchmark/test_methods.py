"""The methods compute the same attention from the same tensors (checked on the CPU in float32).

flash-dma runs on its reference backend here, SDPA on its CPU kernels, and Flex's mask_mod and
score_mod through eager ``flex_attention`` (compiled Flex and cuDNN need the GPU).
"""

import warnings
from dataclasses import replace

import pytest
import torch

from flash_dma import flash_dma_func
from flash_dma.benchmark.inputs import Inputs, TokenInputs, make_inputs, pad_documents, unpad_documents
from flash_dma.benchmark import layers, llama
from flash_dma.benchmark.methods import (
    METHODS,
    MethodOptions,
    SdpaAdditive,
    additive_float_mask,
    flex_mask_mod,
    flex_mods,
    flex_score_mod,
    float_mask_gib,
    padded_document_inputs,
    quantized_fp8,
)
from flash_dma.benchmark.suites import Case
from flash_dma.inputs import dequantize
from tests.helpers import DEVICE

CASES = {
    "gqa-prefill": dict(heads=4, kv_heads=2, seqlen_q=300, seqlen_k=300, keep=1 / 2),
    "mqa-prefill": dict(heads=2, kv_heads=1, seqlen_q=256, seqlen_k=256, keep=1 / 2),
    "decode": dict(heads=4, kv_heads=2, seqlen_q=1, seqlen_k=700, keep=1 / 3, modes=("fwd",)),
    "full-bias": dict(heads=4, kv_heads=2, seqlen_q=256, seqlen_k=256, keep=1 / 2, bias="full"),
}


@pytest.fixture(autouse=True)
def sdpa_math_on_cpu(monkeypatch):
    """The CPU has none of the fused SDPA kernels sdpa-additive is limited to; let it use the math one."""
    monkeypatch.setattr(SdpaAdditive, "backends", ("MATH",))


def _case(name: str) -> Case:
    fields = dict(suite="llm", kind="prefill", batch=2, head_dim=16, methods=tuple(METHODS), modes=("fwd", "fwdbwd"))
    return Case(**{**fields, **CASES[name]})


def _float32_inputs(case: Case) -> Inputs:
    inputs = make_inputs(case, "cpu")
    leaves = [t.detach().float().requires_grad_(case.needs_grad) for t in inputs.leaves]
    query, key, value, bias = leaves if len(leaves) == 4 else (*leaves, None)
    return replace(inputs, query=query, key=key, value=value, bias=bias)


def _bshd(out: torch.Tensor, case: Case) -> torch.Tensor:
    """Any method's output in flash-dma's ``[B, Sq, H, D]`` layout."""
    return out if out.shape[1] == case.seqlen_q and out.shape[2] == case.heads else out.transpose(1, 2)


@pytest.mark.parametrize("name", CASES)
def test_masked_methods_agree_in_the_forward(name):
    case = _case(name)
    inputs = _float32_inputs(case)
    outputs = {
        method: _bshd(METHODS[method].prepare(case, inputs).forward(), case)
        for method in ("flash-dma", "flash-dma-percall", "sdpa-additive")
    }
    assert outputs["flash-dma"].shape == (case.batch, case.seqlen_q, case.heads, case.head_dim)
    for method, out in outputs.items():
        torch.testing.assert_close(out, outputs["flash-dma"], atol=2e-5, rtol=1e-4, msg=lambda m: f"{method}: {m}")


@pytest.mark.parametrize("name", ["gqa-prefill", "full-bias"])
def test_sdpa_additive_gradients_match_flash_dma(name):
    case = _case(name)
    inputs = _float32_inputs(case)
    flash = METHODS["flash-dma"].prepare(case, inputs)
    dout = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim)
    flash.forward().backward(dout)
    expected = [t.grad.clone() for t in flash.leaves]
    for t in inputs.leaves:
        t.grad = None

    sdpa = METHODS["sdpa-additive"].prepare(case, inputs)
    sdpa.forward().backward(dout.transpose(1, 2))
    query, key_heads, value_heads, bias = sdpa.leaves
    assert bias is inputs.bias and query is inputs.query
    group = case.heads // case.kv_heads

    def per_kv_head(grad):  # the untimed part of the head repeat's backward: a sum over each group
        return grad.unflatten(1, (case.kv_heads, group)).sum(2).transpose(1, 2)

    actual = [query.grad, per_kv_head(key_heads.grad), per_kv_head(value_heads.grad), bias.grad]
    for grad_name, a, e in zip(("dq", "dk", "dv", "dbias"), actual, expected):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-3, msg=lambda m: f"{grad_name}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_flex_mask_and_score_mods_match_the_additive_mask(name):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    case = _case(name)
    inputs = make_inputs(case, "cpu")
    q, k, v = (t.detach().float().transpose(1, 2) for t in (inputs.query, inputs.key, inputs.value))
    bias = inputs.bias.detach().float()
    block_mask = create_block_mask(flex_mask_mod(inputs.mask, case.heads, case.seqlen_q), case.batch, case.heads,
                                   case.seqlen_q, case.seqlen_k, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": intended here
        score_mod = flex_score_mod(bias, case.heads)
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    float_mask = additive_float_mask(inputs.mask, bias, case.seqlen_q, case.heads)
    group = case.heads // case.kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=float_mask
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["gqa-prefill", "decode"])
def test_dense_sdpa_is_causal_attention_without_mask(name):
    case = _case(name)
    inputs = _float32_inputs(case)
    out = METHODS["sdpa-flash"].prepare(case, inputs).forward()  # SDPA's flash backend has a CPU kernel
    expected = flash_dma_func(inputs.query, inputs.key, inputs.value, is_causal=True)
    torch.testing.assert_close(_bshd(out, case), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["gqa-prefill", "full-bias"])
def test_flash_dma_nobias_is_the_dense_ceilings_attention(name):
    case = _case(name)
    inputs = _float32_inputs(case)
    out = METHODS["flash-dma-nobias"].prepare(case, inputs).forward()
    expected = METHODS["sdpa-flash"].prepare(case, inputs).forward()  # neither mask nor bias
    torch.testing.assert_close(out, _bshd(expected, case), atol=2e-5, rtol=1e-4)


def test_dense_sdpa_refuses_unaligned_causal_shapes():
    case = replace(_case("gqa-prefill"), seqlen_q=100)
    with pytest.raises(ValueError, match="Sq == Sk or Sq == 1"):
        METHODS["sdpa-cudnn"].prepare(case, make_inputs(case, "cpu"))


@pytest.mark.parametrize("name, heads", [("mqa-prefill", 1), ("gqa-prefill", 4), ("full-bias", 4)])
def test_float_mask_size_matches_the_tensor_built(name, heads):
    case = _case(name)
    inputs = make_inputs(case, "cpu")
    float_mask = additive_float_mask(inputs.mask, inputs.bias, case.seqlen_q, case.heads)
    assert float_mask.shape == (1, heads, case.seqlen_q, case.seqlen_k)
    assert float_mask.dtype == torch.bfloat16
    assert float_mask_gib(case) == float_mask.nbytes / 2**30


def test_skip_reasons():
    options = MethodOptions()
    llm_32k = Case("llm", "prefill", 1, 16, 4, 128, 32768, 32768, 1 / 8, ("sdpa-additive",), ("fwd", "fwdbwd"))
    llm_16k = Case("llm", "prefill", 1, 16, 4, 128, 16384, 16384, 1 / 8, ("sdpa-additive",), ("fwd", "fwdbwd"))
    assert "32 GiB" in METHODS["sdpa-additive"].skip_reason(llm_32k, "fwd", options)
    assert METHODS["sdpa-additive"].skip_reason(llm_16k, "fwd", options) is None  # exactly 8 GiB fits
    assert METHODS["sdpa-additive"].skip_reason(llm_16k, "fwd", MethodOptions(float_mask_budget_gib=4)) is not None

    decode = Case("seed", "decode", 1, 2, 1, 64, 1, 4096, 1.0, ("flex",), ("fwd",))
    assert "--flex-decode" in METHODS["flex"].skip_reason(decode, "fwd", options)
    assert METHODS["flex"].skip_reason(decode, "fwd", MethodOptions(flex_decode=True)) is None
    assert METHODS["flash-dma"].skip_reason(decode, "fwd", options) is None


# Cases of the masks the new suites use, at CPU sizes: 128-blocks, so 300 keys make ragged blocks.
MASK_CASES = {
    "block": dict(mask="block", keep=1 / 2),
    "query-block": dict(mask="query-block", keep=2 / 3),
    "token": dict(mask="token", keep=50 / 300, window=50),
    "bias-only": dict(mask="none"),
    "bare": dict(mask="none", bias="none"),
}


def _mask_case(name: str, **changes) -> Case:
    fields = dict(suite="llm", kind="prefill", batch=1, heads=4, kv_heads=2, head_dim=16, seqlen_q=300, seqlen_k=300,
                  keep=1.0, methods=("flash-dma", "flex"), modes=("fwd", "fwdbwd"))
    return Case(**{**fields, **MASK_CASES[name], **changes})


def _eager_flex(case: Case, inputs: Inputs) -> torch.Tensor:
    """What the flex method computes, through eager ``flex_attention`` (compiling needs the GPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod, score_mod = flex_mods(case, inputs)
    block_mask = create_block_mask(mask_mod, case.batch, case.heads, case.seqlen_q, case.seqlen_k, device="cpu")
    q, k, v = (t.transpose(1, 2) for t in (inputs.query, inputs.key, inputs.value))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": intended here
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("name", MASK_CASES)
def test_flex_gets_the_selection_and_bias_flash_dma_gets(name):
    """Forward only: Flex has no backward on the CPU."""
    case = _mask_case(name, modes=("fwd",))
    inputs = _float32_inputs(case)
    expected = METHODS["flash-dma"].prepare(case, inputs).forward()
    torch.testing.assert_close(_eager_flex(case, inputs), expected, atol=2e-5, rtol=1e-4)


def test_flash_dma_passes_each_mask_as_the_library_takes_it(monkeypatch):
    calls = []
    monkeypatch.setattr("flash_dma.benchmark.methods.flash_dma_func", lambda *args, **kwargs: calls.append(kwargs))
    for name in ("block", "query-block", "token", "bare"):
        case = _mask_case(name)
        inputs = make_inputs(case, "cpu")
        METHODS["flash-dma"].prepare(case, inputs).forward()
        METHODS["flash-dma-percall"].prepare(case, inputs).forward()
    (block, block_percall, query_block, _, token, token_percall, bare, _) = calls
    assert block["attn_mask"] is not None and block["block_mask"] is not None and block_percall["block_mask"] is None
    assert query_block["attn_mask"] is None and query_block["block_mask"].state.shape == (1, 2, 3, 3)
    # A token-level mask goes in alone: flash-dma works out its kept keys itself.
    assert token["attn_mask"].shape == (1, 2, 1, 300) and token["block_mask"] is None
    assert token_percall == token
    assert bare["attn_mask"] is None and bare["attn_bias"] is None and bare["block_mask"] is None
    assert all(kwargs["is_causal"] for kwargs in calls)


@pytest.mark.parametrize("name", ["token", "bare"])
def test_plain_sdpa_matches_flash_dma(name):
    # The host suite's token mask keeps every key (the seeds' window exceeds S): no row is left empty.
    case = _mask_case(name, window=300, keep=1.0, methods=("sdpa",))
    inputs = _float32_inputs(case)
    expected = METHODS["flash-dma"].prepare(case, inputs).forward()
    prepared = METHODS["sdpa"].prepare(case, inputs)
    torch.testing.assert_close(prepared.forward().transpose(1, 2), expected, atol=2e-5, rtol=1e-4)
    assert len(prepared.leaves) == len(inputs.leaves)


@pytest.fixture
def tiny_llama(monkeypatch):
    """The benchmark's Llama at CPU size, in float32."""
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=97, max_position_embeddings=64)
    monkeypatch.setattr(llama, "LLAMA_CONFIG", tiny)
    monkeypatch.setattr(llama, "MODEL_DTYPE", torch.float32)


def test_llama_methods_share_weights_and_run_a_step_and_generate(tiny_llama):
    train = Case("llama", "train", 1, 4, 2, 16, 32, 32, 1.0, ("llama-flash-dma", "llama-sdpa"), ("fwdbwd",),
                 bias="none", mask="none")
    ids = TokenInputs(torch.randint(1, 97, (1, 32), generator=torch.Generator().manual_seed(0)))
    losses = []
    for name in ("llama-flash-dma", "llama-sdpa"):
        prepared = METHODS[name].prepare(train, ids)
        loss = prepared.forward()
        loss.backward()
        assert loss.dim() == 0 and all(p.grad is not None for p in prepared.leaves)
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])

    generate = replace(train, kind="generate", modes=("fwd",))
    prepared = METHODS["llama-flash-dma"].prepare(generate, ids)
    assert prepared.leaves == ()
    tokens = prepared.forward()
    assert tokens.shape == (1, 32 + llama.GENERATE_NEW_TOKENS) and torch.equal(tokens[:, :32], ids.input_ids)


def test_batching_methods_serve_every_request_the_same_tokens(tiny_llama, monkeypatch):
    # Continuous batching of a tiny Llama: flash-dma and SDPA generate the same greedy tokens.
    monkeypatch.setattr(llama, "BATCH_PROMPT_LENGTHS", (5, 17, 2))
    monkeypatch.setattr(llama, "BATCH_NEW_TOKENS", 4)
    # On the CPU transformers' default cache takes a share of the machine's memory (GBs to fill).
    monkeypatch.setattr(llama, "BATCH_CACHE_BLOCKS", 16)
    serve = Case("batching", "serve", 3, 4, 2, 16, 17, 17, 1.0, ("batch-flash-dma", "batch-sdpa"), ("fwd",),
                 bias="none", mask="none")
    # On the test device: where CUDA is present, continuous batching serves only a model on it.
    ids = TokenInputs(torch.randint(1, 97, (3, 17), generator=torch.Generator().manual_seed(0)).to(DEVICE))
    served = []
    for name in ("batch-flash-dma", "batch-sdpa"):
        prepared = METHODS[name].prepare(serve, ids)
        assert prepared.leaves == ()
        results = prepared.forward()
        served.append([results[key].generated_tokens for key in sorted(results)])
    assert [len(tokens) for tokens in served[0]] == [4, 4, 4] and served[0] == served[1]


# Packed documents at CPU sizes: 100, 300 and 156 keys, ragged 128-key blocks, each keeping half of its own.
DOCUMENTS = (100, 300, 156)


def _varlen_case(**changes) -> Case:
    total = sum(DOCUMENTS)
    fields = dict(suite="varlen", kind="prefill", batch=1, heads=4, kv_heads=2, head_dim=16, seqlen_q=total,
                  seqlen_k=total, keep=1 / 2, methods=("flash-dma-varlen", "flex", "flash-dma-padded"),
                  modes=("fwd", "fwdbwd"), documents=DOCUMENTS)
    return Case(**{**fields, **changes})


def _per_document_reference(case: Case, inputs: Inputs) -> torch.Tensor:
    """Each document on its own through ``flash_dma_func``, its own slice of the mask and bias: ``[1, total, H, D]``."""
    outs, start = [], 0
    for n in case.documents:
        keys = slice(start, start + n)
        outs.append(flash_dma_func(
            inputs.query[:, keys], inputs.key[:, keys], inputs.value[:, keys], attn_mask=inputs.mask[..., keys],
            attn_bias=inputs.bias[..., keys], is_causal=True,
        ))
        start += n
    return torch.cat(outs, dim=1)


def test_varlen_methods_agree_in_the_forward():
    case = _varlen_case(modes=("fwd",))
    inputs = _float32_inputs(case)
    expected = _per_document_reference(case, inputs)
    varlen = METHODS["flash-dma-varlen"].prepare(case, inputs).forward()
    assert varlen.shape == (1, sum(DOCUMENTS), 4, 16)
    torch.testing.assert_close(varlen, expected, atol=2e-5, rtol=1e-4)
    padded = METHODS["flash-dma-padded"].prepare(case, inputs).forward()
    assert padded.shape == (3, 300, 4, 16)
    torch.testing.assert_close(unpad_documents(padded, DOCUMENTS)[None], expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(_eager_flex(case, inputs), expected, atol=2e-5, rtol=1e-4)


def test_varlen_and_padded_gradients_match():
    case = _varlen_case()
    inputs = _float32_inputs(case)
    dout = torch.randn(1, sum(DOCUMENTS), 4, 16, generator=torch.Generator().manual_seed(1))
    varlen = METHODS["flash-dma-varlen"].prepare(case, inputs)
    assert len(varlen.leaves) == 4 and varlen.leaves[0].shape == (sum(DOCUMENTS), 4, 16)  # the packed layout's own leaves
    varlen.forward().backward(dout)
    query, key, value, bias = varlen.leaves
    expected = [t.grad[None] for t in (query, key, value)] + [bias.grad[None, :, None]]
    assert bias.grad.shape == (2, sum(DOCUMENTS))

    padded = METHODS["flash-dma-padded"].prepare(case, inputs)
    assert all(leaf.grad is None for leaf in padded.leaves) and len(padded.leaves) == 4
    padded.forward().backward(pad_documents(dout[0], DOCUMENTS))
    query, key, value, bias = padded.leaves
    actual = [unpad_documents(t.grad, DOCUMENTS)[None] for t in (query, key, value)]
    actual.append(unpad_documents(bias.grad[:, :, 0].transpose(1, 2), DOCUMENTS).t()[None, :, None])
    for grad_name, a, e in zip(("dq", "dk", "dv", "dbias"), actual, expected):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-3, msg=lambda m: f"{grad_name}: {m}")


def test_padded_inputs_mask_the_padding():
    case = _varlen_case()
    padded = padded_document_inputs(case, make_inputs(case, "cpu"))
    assert padded.mask.shape == padded.bias.shape == (3, 2, 1, 300)
    assert not padded.mask[0, :, 0, 100:].any() and not padded.mask[2, :, 0, 156:].any()
    assert (padded.bias[0, :, 0, 100:] == 0).all()
    assert padded.block_mask.mask_shape == (3, 2, 1, 300)
    assert all(t.requires_grad and t.is_leaf for t in padded.leaves)


def test_varlen_passes_the_packed_layout(monkeypatch):
    calls = []
    monkeypatch.setattr("flash_dma.benchmark.methods.flash_dma_varlen_func",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or args[0])
    case = _varlen_case()
    inputs = make_inputs(case, "cpu")
    METHODS["flash-dma-varlen"].prepare(case, inputs).forward()
    ((q, k, v, cu_q, cu_k, max_q, max_k), kwargs), = calls
    assert q.shape == (556, 4, 16) and k.shape == v.shape == (556, 2, 16)
    assert cu_q is cu_k and cu_q.tolist() == [0, 100, 400, 556] and max_q == max_k == 300
    assert kwargs["attn_bias"].shape == (2, 556) and "attn_mask" not in kwargs
    assert kwargs["is_causal"] and kwargs["block_mask"] is inputs.block_mask


def _kvcache_case(layout: str, **changes) -> Case:
    fields = dict(suite="kvcache", kind="decode", batch=2, heads=4, kv_heads=2, head_dim=16, seqlen_q=1,
                  seqlen_k=768, keep=1 / 8, methods=("flash-dma-kvcache",), modes=("fwd",), mask="random",
                  kv_layout=layout)
    return Case(**{**fields, **changes})


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("keep", [1.0, 1 / 8])
def test_kvcache_matches_attention_over_the_same_keys(layout, keep):
    case = _kvcache_case(layout, keep=keep)
    inputs = make_inputs(case, "cpu")
    out = METHODS["flash-dma-kvcache"].prepare(case, inputs).forward()
    contiguous = make_inputs(replace(case, kv_layout="contiguous"), "cpu")  # same keys, values, bias and mask
    expected = flash_dma_func(
        contiguous.query.float(), contiguous.k_cache.float(), contiguous.v_cache.float(), attn_mask=contiguous.mask,
        attn_bias=contiguous.bias_cache.float().permute(0, 2, 1)[:, :, None], is_causal=True,
    )
    assert out.shape == (2, 1, 4, 16)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_layer_methods_run_the_stack_and_its_selection(monkeypatch):
    # The layer suite's methods at CPU size: a train step's leaves are the stack's parameters; the selection has none.
    monkeypatch.setattr(layers, "LAYER_CONFIG", dict(hidden_size=64, num_heads=4, num_kv_heads=2, window_size=32,
                                                     block_size=16, sink_blocks=1))
    monkeypatch.setattr(layers, "MODEL_DTYPE", torch.float32)
    case = Case("layer", "train", 1, 4, 2, 16, 128, 128, 1 / 4, ("layer-flash-dma", "layer-dense-bias"), ("fwdbwd",),
                bias="none", mask="none")
    ids = TokenInputs(torch.randint(1, 97, (1, 128), generator=torch.Generator().manual_seed(0)).to(DEVICE))
    for name in case.methods:
        prepared = METHODS[name].prepare(case, ids)
        prepared.forward().backward()
        assert prepared.leaves and all(p.grad is not None for p in prepared.leaves)
    selection = METHODS["layer-select"].prepare(replace(case, kind="select", modes=("fwd",)), ids)
    assert selection.leaves == () and selection.forward().shape == (1, 2, 1, 128 // 16)


def test_fp8_method_quantizes_to_e4m3_range_and_matches_the_bf16_call():
    """flash-dma-fp8: per (batch, key/value head) scaled to e4m3's largest magnitude; close to flash-dma."""
    t = torch.randn(2, 9, 4, 16)
    t8, descale = quantized_fp8(t, 2)
    assert t8.dtype == torch.float8_e4m3fn and descale.shape == (2, 2)
    grouped = t8.float().view(2, 9, 2, 2, 16).abs().amax(dim=(1, 3, 4))
    assert torch.equal(grouped, torch.full((2, 2), 448.0))
    torch.testing.assert_close(dequantize(t8, descale), t, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits
    case = _case("gqa-prefill")
    inputs = make_inputs(case, "cpu")
    assert METHODS["flash-dma-fp8"].skip_reason(case, "fwdbwd", MethodOptions()) is not None
    fp8 = METHODS["flash-dma-fp8"].prepare(case, inputs)
    assert fp8.leaves == ()
    out, reference = fp8.forward(), METHODS["flash-dma"].prepare(case, inputs).forward()
    assert out.dtype == torch.bfloat16
    assert (out.float() - reference.float()).norm() <= 0.06 * reference.float().norm()  # e4m3: 3 mantissa bits


def test_kvcache_prefill_matches_the_same_call_without_a_cache():
    """The forms suite's chunked prefill: new queries over a full cache, against flash-dma-nocache."""
    case = _kvcache_case("contiguous", suite="forms", kind="prefill", seqlen_q=5,
                         methods=("flash-dma-kvcache", "flash-dma-nocache"))
    inputs = make_inputs(case, "cpu")
    cached = METHODS["flash-dma-kvcache"].prepare(case, inputs).forward()
    uncached = METHODS["flash-dma-nocache"].prepare(case, inputs).forward()
    assert cached.shape == uncached.shape == (2, 5, 4, 16)
    torch.testing.assert_close(cached, uncached, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="kv_layout='paged'"):
        METHODS["flash-dma-nocache"].prepare(replace(case, kv_layout="paged"), make_inputs(replace(case, kv_layout="paged"), "cpu"))
