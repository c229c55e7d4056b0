"""BitMask: packing, its summary, its builders, and its use wherever a mask is taken."""

import pytest
import torch

from flash_dma import BitMask, create_mask, flash_dma_func, flash_dma_varlen_func, flash_dma_with_kvcache, indices_to_mask, pack_mask
from flash_dma.bit_mask import block_states, pack_rows, unpack_rows, words_per_row
from flash_dma.block_mask import summarize_mask
from tests.helpers import DEVICE, Case, make_inputs, make_mask, reference_outputs


@pytest.mark.parametrize("key_len", [1, 31, 32, 33, 128, 129, 239])
def test_rows_pack_and_unpack(key_len):
    mask = torch.rand(3, 5, key_len, generator=torch.Generator().manual_seed(key_len)) < 0.4
    words = pack_rows(mask)
    assert words.dtype == torch.int32 and words.shape[-1] == words_per_row(key_len) and words.shape[-1] % 4 == 0
    assert torch.equal(unpack_rows(words, key_len), mask)
    # Key j is bit j % 32 of word j // 32; nothing past the last key is set.
    j = key_len - 1
    bit = (words[..., j // 32] >> (j % 32)) & 1
    assert torch.equal(bit.bool(), mask[..., j])
    assert torch.equal(unpack_rows(words, words.shape[-1] * 32)[..., key_len:], torch.zeros(3, 5, words.shape[-1] * 32 - key_len, dtype=torch.bool))


@pytest.mark.parametrize("block_size", [(16, 32), (64, 64), (128, 128), (256, 256), (32, 256)], ids=str)
@pytest.mark.parametrize(
    "case",
    [
        Case(seqlen_q=130, seqlen_k=239, mask="B,H,Sq,Sk", mask_kind="blocks"),
        Case(seqlen_q=300, seqlen_k=257, mask="1,Hkv,Sq,Sk", mask_kind="tiles"),
        Case(seqlen_q=63, seqlen_k=130, mask="B,Hkv,1,Sk", mask_kind="blocks"),
        Case(seqlen_q=17, seqlen_k=63, mask="B,1,Sq,1", mask_kind="rows"),
        Case(seqlen_q=1, seqlen_k=1, mask="1,1,1,1"),
    ],
    ids=str,
)
def test_the_summary_of_the_bits_is_the_summary_of_the_mask(case, block_size):
    mask = make_mask(case, case.generator(), "cpu")
    packed = pack_mask(mask, block_size=block_size)
    assert packed.shape == tuple(mask.shape) and torch.equal(packed.dense(), mask)
    assert torch.equal(packed.summary.state, summarize_mask(mask, *block_size))
    assert torch.equal(block_states(packed.words, packed.shape, block_size), packed.summary.state)
    assert packed.summary.needs_mask


def test_full_and_empty_blocks_with_ragged_edges():
    mask = torch.zeros(1, 1, 200, 300, dtype=torch.bool)
    mask[:, :, :128, :128] = True  # a whole block
    mask[:, :, 128:, 256:] = True  # the corner block, cut by both ends: FULL
    state = pack_mask(mask).summary.state[0, 0]
    assert state.tolist() == [[2, 0, 0], [0, 0, 2]]


def test_bad_arguments_are_refused():
    mask = torch.ones(1, 1, 4, 40, dtype=torch.bool)
    with pytest.raises(ValueError, match="block_size"):
        pack_mask(mask, block_size=(16, 16))  # key blocks of whole words only
    with pytest.raises(TypeError, match="attn_mask: expected a bool, 0/1 integer or additive float tensor"):
        pack_mask(mask.to(torch.complex64))


def test_additive_float_masks_pack_the_pairs_they_keep():
    kept = torch.rand(2, 1, 9, 70, generator=torch.Generator().manual_seed(7)) < 0.5
    for dtype in (torch.float32, torch.float16):
        additive = torch.where(kept, torch.randn(kept.shape).to(dtype), torch.finfo(dtype).min)
        additive[0, 0, 0, :3] = float("-inf")
        expected = kept.clone()
        expected[0, 0, 0, :3] = False
        assert torch.equal(pack_mask(additive.to(DEVICE)).dense().cpu(), expected)
    with pytest.raises(ValueError, match="indices"):
        indices_to_mask(torch.tensor([[[[0, 40]]]]), 40)
    with pytest.raises(TypeError, match="indices"):
        indices_to_mask(torch.zeros(1, 1, 1, 2), 40)
    with pytest.raises(ValueError, match="indices"):
        indices_to_mask(torch.zeros(1, 2, dtype=torch.int64), 40)


def test_indices_with_padding_and_repeats():
    indices = torch.tensor([[[[3, 3, -1, 0], [-1, -1, -1, -1], [39, 1, 2, 39]]]])
    expected = torch.zeros(1, 1, 3, 40, dtype=torch.bool)
    expected[0, 0, 0, [0, 3]] = True
    expected[0, 0, 2, [1, 2, 39]] = True
    mask = indices_to_mask(indices, 40)
    assert isinstance(mask, BitMask) and torch.equal(mask.dense(), expected)
    assert mask.summary.state.shape == (1, 1, 1, 1)


@pytest.mark.parametrize("bias_rows", ["Sq", "1"])
def test_create_mask_packed_is_create_mask(bias_rows):
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(2, 3, 70 if bias_rows == "Sq" else 1, 150, generator=gen)
    allowed = torch.rand(2, 1, 70, 150, generator=gen) < 0.8
    for kwargs in (dict(window_size=20), dict(window_size=20, block_size=16), dict(window_size=0, kind="relu")):
        plain = create_mask(bias, allowed, 2, 70, 150, **kwargs)
        packed = create_mask(bias, allowed, 2, 70, 150, packed=True, **kwargs)
        assert isinstance(packed, BitMask) and torch.equal(packed.dense(), plain)


@pytest.mark.parametrize(
    "case",
    [
        Case(seqlen_q=70, seqlen_k=90, mask="B,Hkv,Sq,Sk", bias="1,H,Sq,Sk", causal=True),
        Case(seqlen_q=33, seqlen_k=40, mask="1,1,Sq,Sk", mask_kind="rows", bias="B,Hkv,1,Sk", window=(5, 3)),
        Case(seqlen_q=20, seqlen_k=50, mask="B,H,1,Sk", bias="B,H,Sq,Sk"),
    ],
    ids=str,
)
def test_a_bit_mask_attends_as_its_bool_mask(case):
    """On the reference backend (the kernels' packed cases are in tests/backends/triton)."""
    inputs = make_inputs(case, torch.float32)
    packed = pack_mask(inputs["attn_mask"], block_size=(16, 32))
    out = flash_dma_func(**{**inputs, "attn_mask": packed}, is_causal=case.causal, window_size=case.window, backend="reference")
    expected, _, _ = reference_outputs(case, inputs, None, torch.float64)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_bit_mask_carries_its_own_summary():
    case = Case(seqlen_q=40, seqlen_k=40, mask="B,H,Sq,Sk")
    inputs = make_inputs(case, torch.float32)
    packed = pack_mask(inputs["attn_mask"])
    with pytest.raises(ValueError, match="block_mask"):
        flash_dma_func(**{**inputs, "attn_mask": packed}, block_mask=packed.summary, backend="reference")
    with pytest.raises(ValueError, match="attn_mask"):
        flash_dma_func(**{**inputs, "attn_mask": pack_mask(inputs["attn_mask"][:, :, :, :20])}, backend="reference")


def test_packed_sequences_take_per_key_masks_as_tensors():
    q = torch.randn(30, 2, 16)
    k = v = torch.randn(30, 2, 16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    with pytest.raises(TypeError, match="attn_mask"):
        flash_dma_varlen_func(q, k, v, cu, cu, 20, 20, attn_mask=pack_mask(torch.ones(1, 2, 1, 30, dtype=torch.bool)))


def test_a_kv_cache_takes_a_bit_mask():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    k_cache, v_cache = torch.randn(2, 50, 2, 16, generator=gen), torch.randn(2, 50, 2, 16, generator=gen)
    mask = torch.rand(2, 2, 1, 50, generator=gen) < 0.5
    lengths = torch.tensor([30, 50], dtype=torch.int32)
    expected = flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, attn_mask=mask, backend="reference")
    actual = flash_dma_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, attn_mask=pack_mask(mask), backend="reference")
    torch.testing.assert_close(actual, expected)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="packing on the GPU")
def test_packing_on_the_gpu_matches_the_cpu():
    mask = torch.rand(2, 3, 300, 500, generator=torch.Generator().manual_seed(0)) < 0.3
    on_gpu, on_cpu = pack_mask(mask.to(DEVICE)), pack_mask(mask)
    assert torch.equal(on_gpu.words.cpu(), on_cpu.words)
    assert torch.equal(on_gpu.summary.kv_lists.cpu(), on_cpu.summary.kv_lists)
