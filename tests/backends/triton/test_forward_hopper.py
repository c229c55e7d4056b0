"""The Hopper forward (warp-specialised Gluon kernel, ``hopper/forward.py``) against the float64 reference.

It runs on sm90 only; elsewhere these tests skip, and ``test_compiles_for_gpu`` compiles it.
Cases reach the kernel directly (``hopper_forward``), whatever the dispatch would pick for them.
"""

import pytest
import torch

from flash_dma import build_block_mask, flash_dma_varlen_func, pack_mask
from flash_dma.backends.triton import forward as forward_module
from flash_dma.backends.triton.dispatch import HOPPER, form_of, route
from flash_dma.backends.triton.forward import attention_forward
from flash_dma.backends.triton.hopper.common import adds_key_bias_by_mma, stages_pair_bias
from flash_dma.backends.triton.hopper.forward import hopper_forward
from flash_dma.backends.triton.key_list import build_key_list
from flash_dma.backends.triton.launch import forget_choices
from flash_dma.backends.triton.layout import WALK_BLOCKS, WALK_DENSE, WALK_KEYS, call_signature, walk_kind
from tests.backends.triton.test_kvcache import CacheCase, make_cache_inputs, poison_unwritten
from tests.backends.triton.test_kvcache import run as run_cache
from tests.backends.triton.test_varlen import VarlenCase, make_varlen_inputs, reference_varlen
from tests.backends.triton.test_varlen import settings as varlen_settings
from tests.helpers import (
    DTYPE_IDS,
    HOPPER_ONLY,
    HOPPER_PAIR_CASES,
    KERNEL_DTYPES,
    SEED_FORM_CASE,
    Case,
    assert_close,
    assert_gradients_close,
    kernel_call,
    make_fp8_inputs,
    make_inputs,
    max_error,
    reference_outputs,
    hopper_passes,
)

pytestmark = HOPPER_ONLY

PER_KEY = "B,Hkv,1,Sk"
# FP8 inputs (e4m3, descales per (batch, key/value head)) run on the forms that change how the kernel
# reads them: summaries and per-key inputs, GQA, the dense walk, softcap, head dims of 32, 96 and 256,
# a per-pair bias staged by TMA (D = 64) and one read by the math warpgroups (``also_fp8``).
FP8_CASES = []


def also_fp8(case: Case) -> Case:
    """``case``, also run with FP8 inputs (``test_hopper_fp8_forward_matches_reference``)."""
    FP8_CASES.append(case)
    return case


CASES = [
    # A per-key mask in 16-key runs: 128-key tiles are PARTIAL, some FULL or EMPTY.
    Case(seqlen_q=130, seqlen_k=239, head_dim=64, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    also_fp8(Case(seqlen_q=1023, seqlen_k=1023, head_dim=128, mask=PER_KEY, bias="1,H,1,Sk", mask_kind="blocks", causal=True, block_size=(128, 128))),
    also_fp8(Case(seqlen_q=239, seqlen_k=1023, heads=6, kv_heads=2, head_dim=128, mask="1,1,1,Sk", bias="B,1,1,Sk", mask_kind="blocks", block_size=(128, 128))),
    # Summary blocks of two tiles, and summary rows of two row blocks.
    Case(seqlen_q=600, seqlen_k=777, head_dim=64, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(256, 256)),
    # Causal with Sq > Sk: the top rows see nothing (out 0, lse -inf).
    Case(seqlen_q=300, seqlen_k=63, heads=3, kv_heads=1, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True, block_size=(128, 128)),
    # Ragged lengths, no summary: the dense walk, with and without a bias, and a per-key mask read on every tile.
    also_fp8(Case(seqlen_q=1, seqlen_k=1, head_dim=64, bias=PER_KEY)),
    Case(seqlen_q=17, seqlen_k=1023, head_dim=128, bias="1,H,1,Sk", bias_fp32=True, causal=True),
    also_fp8(Case(seqlen_q=1023, seqlen_k=17, head_dim=64, causal=True)),
    Case(seqlen_q=113, seqlen_k=113, heads=8, kv_heads=8, head_dim=128),
    Case(seqlen_q=200, seqlen_k=300, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True),
    # Windows: narrow, both sides, and wider than the keys.
    Case(seqlen_q=500, seqlen_k=700, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", window=(100, 3), block_size=(128, 128)),
    Case(seqlen_q=130, seqlen_k=130, head_dim=64, bias=PER_KEY, window=(0, 0)),
    Case(seqlen_q=63, seqlen_k=90, head_dim=128, bias=PER_KEY, window=(5000, 5000), causal=True),
    # Many work items per program (the persistent grid wraps around several times).
    Case(batch=3, seqlen_q=2048, seqlen_k=2048, heads=16, kv_heads=4, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    # Softcap (Gemma's form): the cap before the bias, on a summary walk and on the dense one.
    also_fp8(Case(seqlen_q=600, seqlen_k=777, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128), softcap=5.0)),
    Case(seqlen_q=130, seqlen_k=239, heads=6, kv_heads=2, head_dim=64, bias="B,H,Sq,Sk", window=(40, 40), softcap=2.0),
    # Head dims of 32, and of 96 in tiles of 128 columns (the copies fill the last 32 with zeros).
    also_fp8(Case(seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=32, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128))),
    also_fp8(Case(seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=96, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128))),
    Case(seqlen_q=200, seqlen_k=300, head_dim=96, bias="B,H,Sq,Sk", window=(40, 40), softcap=2.0),
    # Head dims of 256 (tiles of 64 keys, one Q slot) and 192 in them: the forward alone is Hopper's.
    also_fp8(Case(seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=256, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128))),
    Case(batch=2, seqlen_q=1000, seqlen_k=1000, heads=4, kv_heads=2, head_dim=192, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    also_fp8(Case(seqlen_q=200, seqlen_k=300, head_dim=256, bias="B,H,Sq,Sk", window=(40, 40), softcap=2.0)),
    # A per-key bias the tensor cores add (``adds_key_bias_by_mma``): a last tile past the keys'
    # end, a per-key mask on the dense walk (the loader writes -inf for the keys it drops); and a
    # float32 bias, which the loader stages as key scores.
    Case(batch=2, seqlen_q=1000, seqlen_k=1000, heads=4, kv_heads=2, head_dim=128, bias=PER_KEY, causal=True),
    Case(seqlen_q=300, seqlen_k=260, head_dim=64, bias="1,H,1,Sk", bias_fp32=True),
    Case(batch=2, seqlen_q=777, seqlen_k=1000, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True),
]

PAIR_CASES = HOPPER_PAIR_CASES


def _call(case: Case, inputs: dict, key_list=None):
    mask = inputs["attn_mask"]
    summary = None
    if case.packed:
        mask = pack_mask(mask, block_size=case.block_size)
    elif mask is not None and case.block_size is not None:
        summary = build_block_mask(mask, block_size=case.block_size)
    window = (case.window[0], 0) if case.causal else case.window
    return kernel_call(
        inputs, summary, key_list, softmax_scale=case.head_dim**-0.5, window=window, softcap=case.softcap, mask=mask
    )


def _check(case: Case, inputs: dict, call, dtype) -> None:
    q = inputs["query"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    hopper_forward(call, out, lse, call_signature(call))
    oracle_out, oracle_lse, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, inputs, None, dtype)
    assert_close("out", out, oracle_out, baseline_out)
    assert_close("lse", lse, oracle_lse, baseline_lse)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES + PAIR_CASES, ids=str)
def test_hopper_forward_matches_reference(case, dtype):
    inputs = make_inputs(case, dtype)
    call = _call(case, inputs)
    assert route("forward", form_of("forward", call)) == HOPPER
    before = [t.clone() for t in inputs.values() if t is not None]
    _check(case, inputs, call, dtype)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in inputs.values() if t is not None]))


# Per-key masks walked as key lists: kept keys scattered one by one, so every tile gathers them.
KEY_LIST_CASES = [
    Case(seqlen_q=130, seqlen_k=239, head_dim=64, mask=PER_KEY, bias=PER_KEY, causal=True),
    Case(seqlen_q=1023, seqlen_k=1023, heads=6, kv_heads=2, head_dim=128, mask="1,1,1,Sk", bias="1,H,1,Sk", causal=True),
    Case(seqlen_q=300, seqlen_k=777, head_dim=128, mask=PER_KEY, bias="B,1,1,Sk", bias_fp32=True),
    Case(seqlen_q=500, seqlen_k=700, head_dim=64, mask=PER_KEY, window=(100, 3)),
    # Causal with Sq > Sk: the top rows see nothing; windows wider than the keys.
    Case(seqlen_q=300, seqlen_k=63, heads=3, kv_heads=1, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True),
    Case(seqlen_q=63, seqlen_k=90, head_dim=128, mask=PER_KEY, bias=PER_KEY, window=(5000, 5000), causal=True),
    Case(batch=3, seqlen_q=2048, seqlen_k=2048, heads=16, kv_heads=4, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True),
    # A bias per pair, gathered at the kept keys' positions.
    Case(seqlen_q=400, seqlen_k=500, head_dim=64, mask=PER_KEY, bias="B,H,Sq,Sk", causal=True),
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", KEY_LIST_CASES, ids=str)
def test_hopper_forward_gathers_kept_keys(case, dtype, poison_outputs):
    """A key list: K and V of the kept keys gathered (into NaN-poisoned buffers: a slot read but
    not written shows up), positions checked against the band on edge tiles."""
    inputs = make_inputs(case, dtype)
    mask = inputs["attn_mask"]
    if mask.shape[0] * mask.shape[1] > 1:
        mask[0, 0] = False  # a (batch, kv head) that keeps no key: its rows are empty (out 0, lse -inf)
    call = _call(case, inputs, build_key_list(mask, case.seqlen_k))
    assert route("forward", form_of("forward", call)) == HOPPER
    _check(case, inputs, call, dtype)


def test_the_seed_form_stages_its_bias_with_tma():
    """A 16-bit, contiguous per-pair bias of 16-byte rows at D = 64 is copied by the loader."""
    case = SEED_FORM_CASE
    call = _call(case, make_inputs(case, KERNEL_DTYPES[0]))
    assert stages_pair_bias(call, 0)
    assert not stages_pair_bias(call._replace(bias=call.bias[..., :-1]), 0)  # rows of 999 keys: not 16-byte rows
    assert not stages_pair_bias(call._replace(bias=call.bias.float()), 0)


def test_the_tensor_cores_add_a_16_bit_per_key_bias():
    """A per-key bias of Q's 16-bit dtype, through any strides, goes to S by a product of its own
    on the dense walk and a key list's; the per-key-block walk, a float32 bias, softcap, a scale
    whose inverse the dtype does not hold and a KV cache keep the loader's key scores."""
    case = Case(batch=2, seqlen_q=64, seqlen_k=999, heads=4, kv_heads=2, head_dim=64, bias=PER_KEY)
    call = _call(case, make_inputs(case, torch.bfloat16))
    bias = call.bias
    assert adds_key_bias_by_mma(call, WALK_DENSE, False) and adds_key_bias_by_mma(call, WALK_KEYS, False)
    assert adds_key_bias_by_mma(call._replace(q=call.q.half(), bias=bias.half()), WALK_DENSE, False)
    assert adds_key_bias_by_mma(call._replace(bias=bias.transpose(0, 1).contiguous().transpose(0, 1)), WALK_DENSE, False)
    assert not adds_key_bias_by_mma(call, WALK_BLOCKS, False)
    assert not adds_key_bias_by_mma(call, WALK_DENSE, True)
    assert not adds_key_bias_by_mma(call._replace(bias=bias.float()), WALK_DENSE, False)
    assert not adds_key_bias_by_mma(call._replace(softcap=5.0), WALK_DENSE, False)
    assert not adds_key_bias_by_mma(call._replace(softmax_scale=0.0), WALK_DENSE, False)
    assert not adds_key_bias_by_mma(call._replace(softmax_scale=1e39), WALK_DENSE, False)  # 1 / scale is no normal bfloat16
    assert not adds_key_bias_by_mma(call._replace(bias=None), WALK_DENSE, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [96, 128, 192])
@pytest.mark.parametrize("walk", ["dense", "key-list"])
def test_infinite_key_biases_drop_their_keys(walk, head_dim, dtype):
    """The tensor cores add the bias by weights ``hi + lo`` of one sign, so a -inf bias drops its
    key (at D = 96 and 192 ``1 / scale`` rounds up to nearest: inf - inf would be NaN); a masked
    key's +inf bias is dropped with it (the loader writes -inf in its place in the operand)."""
    case = Case(batch=2, seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=head_dim, mask=PER_KEY, bias=PER_KEY, causal=True)
    inputs = make_inputs(case, dtype)
    bias = inputs["attn_bias"].detach().clone()
    bias[..., ::7] = float("-inf")
    bias = torch.where(inputs["attn_mask"], bias, float("inf"))
    inputs["attn_bias"] = bias
    key_list = build_key_list(inputs["attn_mask"], case.seqlen_k) if walk == "key-list" else None
    call = _call(case, inputs, key_list)
    assert adds_key_bias_by_mma(call, walk_kind(call.kv_lists, call.key_list), False)
    _check(case, inputs, call, dtype)


def test_packed_query_view_is_read_through_its_strides():
    """q sliced out of a packed [B, S, 3, H, D] projection: heads and rows are strided."""
    case = Case(seqlen_q=300, seqlen_k=300, heads=4, kv_heads=4, head_dim=128, bias=PER_KEY, causal=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    packed = torch.stack([inputs["query"], inputs["key"], inputs["value"]], dim=2)  # [B, S, 3, H, D]
    inputs = dict(inputs, **dict(zip(("query", "key", "value"), packed.unbind(2))))
    _check(case, inputs, _call(case, inputs), KERNEL_DTYPES[0])


def test_forward_dispatch(monkeypatch):
    """Large plain forwards take the Hopper kernel, with a key list, a BitMask and softcap too;
    FLASH_DMA_HOPPER=0 and a bool per-pair mask (bits only) do not."""
    case = Case(batch=1, seqlen_q=4096, seqlen_k=4096, heads=16, kv_heads=4, head_dim=128, bias=PER_KEY, causal=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    calls = []
    monkeypatch.setattr(forward_module, "hopper_forward", lambda call, *_: calls.append(call))
    call = _call(case, inputs)
    attention_forward(call)
    keys = build_key_list(torch.rand(1, 4, 1, 4096, device=inputs["query"].device) < 0.1, 4096)
    attention_forward(call._replace(key_list=keys))
    pairs = torch.rand(1, 4, 4096, 4096, device=inputs["query"].device) < 0.1
    attention_forward(call._replace(mask=pack_mask(pairs).words, mask_kind="bits", **_walk(pack_mask(pairs).summary)))
    assert len(calls) == 3 and calls[1].key_list is keys and calls[2].mask_kind == "bits"
    attention_forward(call._replace(softcap=5.0))
    assert len(calls) == 4 and calls[3].softcap == 5.0
    attention_forward(call._replace(mask=pairs))
    monkeypatch.setenv("FLASH_DMA_HOPPER", "0")
    attention_forward(call)
    assert len(calls) == 4


def _walk(summary) -> dict:
    return dict(kv_lists=summary.kv_lists, q_lists=summary.q_lists, list_block_q=summary.block_size[0], list_block_k=summary.block_size[1])


also_fp8(SEED_FORM_CASE)
also_fp8(next(case for case in PAIR_CASES if case.head_dim == 128 and case.bias == "B,H,Sq,Sk"))  # read by the math warpgroups


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
def test_hopper_fp8_forward_matches_reference(case):
    """Against the float64 reference on the dequantized inputs; the baseline is the float32 reference
    with the kernel's FP8 tensor-core products modelled (``fp8_tensor_cores``: P in e4m3, scores to
    the accumulator's precision), and its output rounded to bfloat16."""
    quantized, exact, descale = make_fp8_inputs(case)
    call = _call(case, quantized)._replace(descale=descale)
    q = quantized["query"]
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    hopper_forward(call, out, lse, call_signature(call))
    oracle_out, oracle_lse, _ = reference_outputs(case, exact, None, torch.float64)
    baseline_out, baseline_lse, _ = reference_outputs(case, exact, None, torch.float32, fp8_tensor_cores=True)
    assert_close("out", out, oracle_out, baseline_out.to(torch.bfloat16))
    assert_close("lse", lse, oracle_lse, baseline_lse)


# Packed sequences (varlen): each work item a row block of one sequence, its keys and band its own.
# Lengths off the tiles, an empty sequence, Sq != Sk per sequence (the band on each one's diagonal),
# a sequence's last rows followed by the next's (stored from registers, not by TMA).
VARLEN_CASES = [
    VarlenCase(lens_q=(300, 0, 129, 1000), lens_k=(300, 5, 129, 1000), head_dim=128, mask="sequence", bias="packed", causal=True, walk="summary"),
    VarlenCase(lens_q=(200, 77, 640), lens_k=(450, 77, 700), heads=4, kv_heads=1, head_dim=64, bias="sequence", causal=True),
    VarlenCase(lens_q=(513, 128), lens_k=(513, 128), heads=2, kv_heads=2, head_dim=128, mask="packed", bias="packed", window=(100, 20), walk="summary"),
]


@pytest.fixture
def hopper_taken(monkeypatch):
    """The passes that the Hopper kernels took (``hopper_passes``), with fresh launch choices."""
    forget_choices()
    yield hopper_passes(monkeypatch)
    forget_choices()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_hopper_kernels_of_packed_sequences_match_reference(case, dtype, hopper_taken, poison_outputs):
    """The forward, dQ and dK/dV (with the per-key bias gradient) of packed sequences on the Hopper kernels."""
    inputs = make_varlen_inputs(case, dtype)
    block_mask = None
    if case.walk == "summary":
        block_mask = build_block_mask(
            inputs["attn_mask"], cu_seqlens_k=inputs["cu_seqlens_k"], max_seqlen_k=inputs["max_seqlen_k"], block_size=(128, 128),
        )
    out, lse = flash_dma_varlen_func(**inputs, **varlen_settings(case), block_mask=block_mask, return_lse=True, backend="triton")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    out.backward(dout)
    assert sorted(hopper_taken) == ["dkdv", "dq", "forward"]
    oracle_out, oracle_lse, oracle = reference_varlen(case, inputs, block_mask, dout, torch.float64)
    base_out, base_lse, baseline = reference_varlen(case, inputs, block_mask, dout, dtype)
    assert_close("out", out, oracle_out, base_out)
    assert_close("lse", lse, oracle_lse, base_lse)
    assert_gradients_close(inputs, oracle, baseline)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_hopper_dkdv_of_long_packed_sequences_adds_query_chunks(deterministic, hopper_taken, poison_outputs):
    """A sequence long enough that dK/dV splits its queries into chunks: added by atomics into
    zeroed scratch, or written to slices of their own and summed in order (bit-identical runs)."""
    case = VarlenCase(lens_q=(2048, 300), lens_k=(2048, 300), head_dim=64, mask="sequence", bias="sequence", causal=True)
    dtype = KERNEL_DTYPES[0]
    inputs = make_varlen_inputs(case, dtype)
    block_mask = build_block_mask(
        inputs["attn_mask"], cu_seqlens_k=inputs["cu_seqlens_k"], max_seqlen_k=inputs["max_seqlen_k"], block_size=(128, 128),
    )
    grads = []
    for _ in range(2):
        out = flash_dma_varlen_func(**inputs, is_causal=True, block_mask=block_mask, deterministic=deterministic, backend="triton")
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
        leaves = [inputs[name] for name in ("q", "k", "v", "attn_bias")]
        grads.append(torch.autograd.grad(out, leaves, dout))
    assert "dkdv" in hopper_taken
    oracle_out, _, oracle = reference_varlen(case, inputs, block_mask, dout, torch.float64)
    base_out, _, baseline = reference_varlen(case, inputs, block_mask, dout, dtype)
    assert_close("out", out, oracle_out, base_out)
    for name, grad in zip(("q", "k", "v", "attn_bias"), grads[0]):
        assert_close(name, grad, oracle[name], baseline[name])
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(*grads))



# Chunks of prefill over a KV cache (``flash_dma_with_kvcache`` with Sq > 1): each entry's keys are
# as many as its cache length says (0 included), in its own row, a row cache_batch_idx names or
# pages of whole key tiles, its band on its own diagonal; a per-key mask read by the loader or
# walked as a key list, the bias stored with the keys. num_splits=1: calls this small would
# otherwise be split over their keys, a form the Triton kernel serves.
CACHE_CASES = [
    CacheCase(seqlen_q=130, new=130, cached=(300, 0, 900), capacity=1100, head_dim=64, listed=True, num_splits=1),
    CacheCase(seqlen_q=257, new=0, cached=(1000, 513, 129), capacity=1024, head_dim=128, window=(200, 0), num_splits=1),
    CacheCase(seqlen_q=200, new=200, cached=(700, 100, 0), capacity=1000, heads=8, kv_heads=2, head_dim=128, mask=False, num_splits=1),
    CacheCase(seqlen_q=130, new=130, cached=(300, 0, 900), capacity=1100, head_dim=64, rows=True, num_splits=1),
    CacheCase(seqlen_q=257, new=0, cached=(1000, 513, 129), capacity=1024, head_dim=128, page_size=256, window=(200, 0), num_splits=1),
    CacheCase(seqlen_q=200, new=200, cached=(700, 100, 0), capacity=1000, heads=8, kv_heads=2, head_dim=128, page_size=128,
              mask=False, num_splits=1),
    CacheCase(seqlen_q=100, new=100, cached=(300, 50, 0), capacity=512, head_dim=256, page_size=128, causal=False, num_splits=1),
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CACHE_CASES, ids=str)
def test_hopper_forward_of_a_cache_prefill_matches_reference(case, dtype, hopper_taken):
    """The slots no entry's keys fill hold NaN: the copy engine reads whole tiles, and they must
    not reach the output."""
    inputs = make_cache_inputs(case, dtype)
    poison_unwritten(case, inputs)
    out, lse, *caches = run_cache(case, inputs, "triton")
    assert hopper_taken == ["forward"]
    expected = run_cache(case, inputs, "reference")
    # The reference computes in fp32 and rounds once; the kernels round P to the input dtype too
    # (``test_kvcache.test_kvcache_matches_reference``'s tolerance).
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert max_error(out, expected[0]) <= tolerance * max(1.0, expected[0].abs().max().item())
    assert max_error(lse, expected[1]) <= 1e-4
    for cache, reference_cache in zip(caches, expected[2:]):  # the NaN slots left alone too
        assert cache is None or torch.allclose(cache, reference_cache, rtol=0, atol=0, equal_nan=True)
