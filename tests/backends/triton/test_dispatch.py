"""The routing table: which kernel serves which form, and the table of docs/api.md."""

from pathlib import Path

import pytest
import torch

from flash_dma.backends.triton.dispatch import HOPPER, TOPK, TOPK_ATOMIC, TOPK_UNION, TRITON, Form, route, routing_table
from flash_dma.backends.triton.hopper.common import (
    BIAS_KEYS,
    BIAS_NONE,
    BIAS_PAIRS,
    BIAS_ROWS,
    MASK_BITS,
    MASK_INTERVALS,
    MASK_KEYS,
    MASK_NONE,
    hopper_arguments,
)
from flash_dma.backends.triton.layout import WALK_DENSE, Call, input_form

API = Path(__file__).resolve().parents[3] / "docs" / "api.md"
PLAIN = Form(
    device="hopper", dtype="bf16", head_dim=128, wide_group=False, mask="keys", bias="keys", walk="blocks", sequences="fixed", split=False,
    deterministic=False, softcap=False, aligned=True,
)


def test_docs_show_the_table_the_code_routes_by():
    assert routing_table() in API.read_text()


@pytest.mark.parametrize(
    "changes, forward, dq, dkdv",
    [
        ({}, HOPPER, HOPPER, HOPPER),
        (dict(mask="bits", bias="pairs"), HOPPER, HOPPER, HOPPER),
        (dict(mask="rows", bias="rows", walk="dense"), HOPPER, HOPPER, HOPPER),
        (dict(mask="pairs"), TRITON, TRITON, TRITON),  # a bool per pair: bits only on Hopper
        (dict(walk="keys", mask="none"), HOPPER, HOPPER, HOPPER),  # kept keys gathered, dK/dV scattered back
        (dict(deterministic=True), HOPPER, HOPPER, HOPPER),  # query chunks add up in order
        (dict(deterministic=True, walk="keys", mask="none"), HOPPER, HOPPER, HOPPER),
        (dict(softcap=True), HOPPER, HOPPER, HOPPER),
        (dict(dtype="fp32"), TRITON, TRITON, TRITON),
        # FP8 has a forward only; the Hopper forward reads it, every other form is dequantized for the Triton kernel.
        (dict(dtype="fp8"), HOPPER, TRITON, TRITON),
        (dict(dtype="fp8", sequences="packed"), TRITON, TRITON, TRITON),
        (dict(head_dim=96), HOPPER, HOPPER, HOPPER),  # tiles of 128 columns, 32 of them zeros
        # Tiles of 256 columns: one Q slot; dK/dV in items of 64 keys, dK and dV in a warpgroup each.
        (dict(head_dim=256), HOPPER, HOPPER, HOPPER),
        (dict(head_dim=192), HOPPER, HOPPER, HOPPER),
        (dict(head_dim=256, mask="bits", bias="pairs"), HOPPER, TRITON, TRITON),  # words staged for 128-key tiles
        (dict(head_dim=48), TRITON, TRITON, TRITON),
        (dict(sequences="packed"), HOPPER, HOPPER, HOPPER),
        (dict(sequences="packed", walk="keys", mask="none"), TRITON, TRITON, TRITON),
        (dict(sequences="packed", mask="bits", bias="pairs"), TRITON, TRITON, TRITON),
        (dict(sequences="cache"), HOPPER, TRITON, TRITON),
        (dict(sequences="cache-indexed"), HOPPER, TRITON, TRITON),  # rows or pages of whole tiles
        (dict(sequences="cache-indexed", walk="keys", mask="none"), TRITON, TRITON, TRITON),  # gathered from batch rows
        (dict(sequences="cache", split=True), TRITON, TRITON, TRITON),  # decode: split-KV
        (dict(split=True), TRITON, TRITON, TRITON),
        (dict(aligned=False), TRITON, TRITON, TRITON),
        (dict(device="cuda"), TRITON, TRITON, TRITON),
        (dict(device="interpreter"), TRITON, TRITON, TRITON),
        # flash_dma_topk_func: its own kernels on every device, whatever else the form holds; the
        # backward split between the union and per-query walks, or with a per-pair bias or a group
        # of 16 heads dK/dV by atomics in the per-query dQ walk, unless deterministic.
        (dict(walk="indices", mask="none"), TOPK, TOPK_UNION, TOPK_UNION),
        (dict(walk="indices", mask="none", bias="none", device="interpreter"), TOPK, TOPK_UNION, TOPK_UNION),
        (dict(walk="indices", mask="none", wide_group=True), TOPK, TOPK, TOPK_ATOMIC),
        (dict(walk="indices", mask="none", bias="pairs"), TOPK, TOPK, TOPK_ATOMIC),
        (dict(walk="indices", mask="none", device="interpreter", deterministic=True), TOPK, TOPK, TOPK),
    ],
    ids=str,
)
def test_routes(changes, forward, dq, dkdv):
    form = PLAIN._replace(**changes)
    assert (route("forward", form), route("dq", form), route("dkdv", form)) == (forward, dq, dkdv)


@pytest.mark.parametrize(
    "shape, kind, form",
    [
        (None, "elements", "none"),
        ((1, 2, 1, 64), "elements", "keys"),
        ((1, 2, 1, 1), "elements", "keys"),
        ((1, 2, 32, 1), "elements", "rows"),
        ((1, 2, 32, 64), "elements", "pairs"),
        ((1, 2, 32, 4), "bits", "bits"),
        ((1, 2, 1, 128), "intervals", "intervals"),
    ],
    ids=str,
)
def test_input_forms(shape, kind, form):
    assert input_form(None if shape is None else torch.zeros(shape), kind) == form


def test_hopper_kernels_are_told_the_forms_the_table_routed():
    """The flags ``hopper_arguments`` passes are the kernels' codes of ``input_form``'s forms."""
    q = torch.zeros(1, 32, 2, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    words = torch.zeros(1, 2, 32, 4, dtype=torch.int32)
    rows = torch.zeros(1, 2, 1, 128, dtype=torch.int32)
    for mask, kind, bias, codes in (
        (words, "bits", torch.zeros(1, 2, 32, 64, dtype=torch.bfloat16), (MASK_BITS.value, BIAS_PAIRS.value)),
        (rows, "intervals", torch.zeros(1, 2, 1, 64), (MASK_INTERVALS.value, BIAS_KEYS.value)),
        (torch.ones(1, 2, 1, 64, dtype=torch.bool), "elements", torch.zeros(1, 2, 32, 1), (MASK_KEYS.value, BIAS_ROWS.value)),
        (None, "elements", None, (MASK_NONE.value, BIAS_NONE.value)),
    ):
        call = Call(q, k, v, mask, bias, None, None, None, None, None, None, 0, 0, 0.125, -1, 0, 0.0, False, 0, 0, kind)
        _, flags = hopper_arguments(call, k, v, None, WALK_DENSE)
        assert tuple(flags[:2]) == codes


def test_a_shared_mask_is_summarised_once_per_version(monkeypatch):
    """Layers that share a dense mask read it once per step; a mask changed in place is read again."""
    import flash_dma.backends.triton as triton_backend
    from flash_dma import flash_dma_func
    from flash_dma.memo import dry_running
    from tests.helpers import Case, assert_close, make_inputs, reference_outputs

    summarised = []
    for name in ("summary_state", "packed_bits"):  # the Triton kernels' summary, or the Hopper kernels' bits
        real = getattr(triton_backend, name)
        # A call's dry run (compiling ahead) derives them again but launches nothing: no read of the mask.
        monkeypatch.setattr(triton_backend, name, lambda *a, real=real: (dry_running() or summarised.append(1), real(*a))[1])
    monkeypatch.setattr(triton_backend, "SMALL_PROBLEM", 0)
    case = Case(batch=1, seqlen_q=70, seqlen_k=90, heads=2, kv_heads=1, mask="1,1,Sq,Sk", causal=True)
    inputs = make_inputs(case, torch.float32)
    mask = inputs["attn_mask"]
    for _ in range(3):
        out = flash_dma_func(**inputs, is_causal=True, backend="triton")
    assert len(summarised) == 1
    mask[:, :, 30:] = ~mask[:, :, 30:]  # in place: the next call must see the new mask
    out = flash_dma_func(**inputs, is_causal=True, backend="triton")
    assert len(summarised) == 2
    oracle = reference_outputs(case, inputs, None, torch.float64)[0]
    baseline = reference_outputs(case, inputs, None, torch.float32)[0]
    assert_close("out", out, oracle, baseline)
