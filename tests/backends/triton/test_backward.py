"""Triton gradients of q, k, v and the bias against float64 autograd of the reference."""

import pytest
import torch

from flash_dma import build_block_mask
from tests.helpers import (
    KERNEL_DTYPES,
    REPEATS_ON_GPU,
    Case,
    assert_close,
    assert_gradients_close,
    broadcast_cases,
    case_dtypes,
    kernel_call,
    listed_variants,
    make_inputs,
    packed_variants,
    reference_outputs,
    triton_call,
)

BLOCKS = (16, 16)
BACKWARD_CASES = [
    # Every mask and bias broadcast shape; the bias gradient comes back in the bias's shape.
    *broadcast_cases(Case(seqlen_q=17, seqlen_k=63, mask_kind="blocks", block_size=BLOCKS)),
    # Causal with Sq > Sk and fully masked rows, MQA.
    Case(seqlen_q=70, seqlen_k=40, heads=3, kv_heads=1, mask="B,H,Sq,Sk", mask_kind="rows", bias="B,Hkv,Sq,Sk", causal=True, block_size=BLOCKS),
    Case(seqlen_q=40, seqlen_k=70, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="1,1,1,Sk", causal=True, block_size=(16, 32)),
    # Head dims.
    *(
        Case(seqlen_q=33, seqlen_k=63, head_dim=d, mask="B,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True, block_size=(32, 32))
        for d in (40, 128, 256)
    ),
    # Windows, softcap, no mask/bias, ragged single rows.
    Case(seqlen_q=63, seqlen_k=90, mask="B,H,Sq,Sk", mask_kind="blocks", bias="B,H,Sq,Sk", window=(20, 3), block_size=BLOCKS),
    Case(seqlen_q=63, seqlen_k=63, bias="1,H,Sq,Sk", softcap=3.0, causal=True),
    Case(seqlen_q=90, seqlen_k=90, heads=8, kv_heads=2, causal=True),
    Case(seqlen_q=1, seqlen_k=130, mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True),
    Case(seqlen_q=130, seqlen_k=1, bias="1,Hkv,1,Sk"),
]
# BitMasks: every broadcast shape, fully masked rows, a window.
BACKWARD_CASES += packed_variants(BACKWARD_CASES[:19]) + packed_variants([BACKWARD_CASES[23]])
BACKWARD_CASES += listed_variants(BACKWARD_CASES)


def _gradients(case, inputs, **kwargs):
    out = triton_call(case, inputs, **kwargs)
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    out.backward(dout)
    return out, dout


@pytest.mark.parametrize("case, dtype", case_dtypes(BACKWARD_CASES))
def test_gradients_match_reference(case, dtype, poison_outputs):
    inputs = make_inputs(case, dtype, requires_grad=True)
    _, dout = _gradients(case, inputs)
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    _, _, baseline = reference_outputs(case, inputs, dout, dtype)
    assert_gradients_close(inputs, oracle, baseline)


@pytest.mark.parametrize(
    "case",
    [
        Case(seqlen_q=40, seqlen_k=50, mask="B,Hkv,1,Sk", bias="1,1,1,Sk", block_size=BLOCKS),
        Case(seqlen_q=40, seqlen_k=50, mask="1,1,Sq,Sk", bias="1,Hkv,Sq,Sk", causal=True, block_size=BLOCKS),
        Case(seqlen_q=40, seqlen_k=50, bias="1,1,Sq,Sk", mask_kind="rows"),
    ],
    ids=str,
)
@REPEATS_ON_GPU
def test_deterministic_gradients_are_bitwise_reproducible(case):
    # These biases are shared across batch and kv heads: the default path sums them with atomics.
    runs = []
    for _ in range(3):
        inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
        _gradients(case, inputs, deterministic=True)
        runs.append({n: inputs[n].grad for n in ("query", "key", "value", "attn_bias")})
    for run in runs[1:]:
        for name, grad in run.items():
            assert torch.equal(grad, runs[0][name]), name


def test_masked_positions_and_empty_rows_get_zero_gradients():
    case = Case(seqlen_q=70, seqlen_k=40, mask="B,H,Sq,Sk", mask_kind="rows", bias="B,H,Sq,Sk", causal=True, block_size=BLOCKS)
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    _gradients(case, inputs)
    mask = inputs["attn_mask"]
    dbias = inputs["attn_bias"].grad
    assert not dbias.isnan().any()
    assert torch.equal(dbias[~mask], torch.zeros_like(dbias[~mask]))
    causal_hidden = torch.ones(70, 40, dtype=torch.bool, device=mask.device).triu(1 + 40 - 70)
    assert torch.equal(dbias[..., causal_hidden], torch.zeros_like(dbias[..., causal_hidden]))
    empty_rows = ~(mask & ~causal_hidden).any(-1)  # [B, H, Sq]
    dq = inputs["query"].grad.transpose(1, 2)  # [B, H, Sq, D]
    assert empty_rows.any() and torch.equal(dq[empty_rows], torch.zeros_like(dq[empty_rows]))


def test_the_eager_backward_is_handed_no_lse_gradient(monkeypatch):
    """The LSE takes no gradient: autograd hands the backward None for it, not zeros it would
    allocate and fill on every call."""
    from flash_dma.backends.triton import ops

    handed = []
    backward = ops._EagerAttention.backward

    def recording(ctx, dout, dlse):
        handed.append(dlse)
        return backward(ctx, dout, dlse)

    monkeypatch.setattr(ops._EagerAttention, "backward", staticmethod(recording))
    case = BACKWARD_CASES[0]
    triton_call(case, make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)).sum().backward()
    assert handed == [None]


class _NoGradient(torch.autograd.Function):
    """The identity, whose backward leaves its input's gradient undefined."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_an_undefined_output_gradient_gives_zero_gradients():
    # autograd still runs the backward, handing it None for the output (the LSE's too, above).
    case = BACKWARD_CASES[0]
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    out = triton_call(case, inputs)
    (_NoGradient.apply(out).sum() + inputs["query"].sum()).backward()
    assert torch.equal(inputs["query"].grad, torch.ones_like(inputs["query"]))
    assert inputs["key"].grad is None and inputs["value"].grad is None and inputs["attn_bias"].grad is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(batch=1, seqlen_q=16384, seqlen_k=16384, heads=4, kv_heads=1, head_dim=64, mask="B,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True),
        Case(batch=1, seqlen_q=4096, seqlen_k=4096, heads=4, kv_heads=2, head_dim=128, mask="B,H,Sq,Sk", mask_kind="blocks", bias="1,H,Sq,Sk", causal=True),
    ],
    ids=str,
)
def test_long_sequence_gradients(case, poison_outputs):
    dtype = KERNEL_DTYPES[0]
    inputs = make_inputs(case, dtype, requires_grad=True)
    _, dout = _gradients(case, inputs)
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    _, _, baseline = reference_outputs(case, inputs, dout, dtype)
    assert_gradients_close(inputs, oracle, baseline)


def test_forced_query_chunks_reach_the_plan_and_are_undone():
    """``forced_query_chunks`` (the fuzz trials' and ``tools/kernel_times.py``'s): inside, a backward
    splits each key tile's queries into the forced count, or into ``query_chunks``' own under a
    nested None; after, into ``query_chunks``' own again. A count below 1 is refused."""
    from flash_dma.backends.triton import backward

    case = Case(seqlen_q=70, seqlen_k=40, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="1,1,1,Sk", causal=True, block_size=BLOCKS)
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    call = kernel_call(inputs, build_block_mask(inputs["attn_mask"], block_size=BLOCKS), softmax_scale=0.25)
    dout = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim).to(inputs["query"])

    def planned() -> int:
        return backward._plan(call, dout, True, None).chunks

    assert planned() == 1  # a short sequence
    with backward.forced_query_chunks(3):
        assert planned() == 3
        with backward.forced_query_chunks(None):
            assert planned() == 1
        assert planned() == 3
    assert planned() == 1
    with pytest.raises(ValueError, match="chunks: expected None or a count >= 1, got 0"):
        with backward.forced_query_chunks(0):
            pass


@pytest.mark.parametrize("seqlen, cap", [(300, 1), (1024, 2), (2048, 4), (16384, 8), (131072, 8)])
def test_counted_query_chunks_are_capped_by_the_queries(seqlen, cap):
    """Where the Hopper dK/dV kernel counts its columns' work, the host gives only the most chunks
    it may take: one per 512 queries, at most 8, whatever the keys and the device."""
    from flash_dma.backends.triton.backward import query_chunks

    assert query_chunks(seqlen, 64, 4, False, torch.device("cpu"), True, True, counted=True) == cap


@pytest.mark.parametrize("deterministic", [True, False], ids=["in-order", "atomic"])
@pytest.mark.parametrize("chunks", [2, 3], ids=lambda c: f"chunks{c}")
@pytest.mark.parametrize(
    "case",
    [
        Case(seqlen_q=70, seqlen_k=40, mask="B,Hkv,1,Sk", mask_kind="blocks", bias="1,1,1,Sk", causal=True, block_size=BLOCKS),
        Case(seqlen_q=70, seqlen_k=40, mask="B,H,Sq,Sk", mask_kind="blocks", bias="B,Hkv,Sq,Sk", causal=True, block_size=BLOCKS),
    ],
    ids=str,
)
def test_query_chunks_of_a_key_tile_add_up(case, chunks, deterministic, poison_outputs):
    """Long sequences split each key tile's queries across programs (``query_chunks``). The parts
    add up to the oracle's gradients: in a fixed order when deterministic (then reproducible
    bit for bit), else through atomics, the last chunk to arrive writing the sum."""
    from flash_dma.backends.triton.backward import attention_backward
    from flash_dma.backends.triton.forward import attention_forward

    dtype = KERNEL_DTYPES[0]
    inputs = make_inputs(case, dtype, requires_grad=True)
    summary = build_block_mask(inputs["attn_mask"], block_size=BLOCKS)
    call = kernel_call(inputs, summary, softmax_scale=0.25, window=(-1, 0), deterministic=deterministic)
    out, lse = attention_forward(call)
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64, softmax_scale=0.25)
    _, _, baseline = reference_outputs(case, inputs, dout, dtype, softmax_scale=0.25)
    runs = [
        attention_backward(dout, call, out, lse, True, num_query_chunks=chunks)
        for _ in range(2)
    ]
    for name, grad, again in zip(("query", "key", "value", "attn_bias"), *runs):
        assert_close(name, grad, oracle[name], baseline[name])
        assert not deterministic or torch.equal(grad, again), name
