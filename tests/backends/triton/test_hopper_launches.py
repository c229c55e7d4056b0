"""The Hopper kernels' launches, checked on the CPU: routed as on an H100, every launch's arguments
bind to its kernel's parameters, one value each, with the tile configuration's as the trailing ones
(``launch.Launcher`` passes them by position on a GPU).

The Gluon kernels do not run under the interpreter, and ``tools/compile_report.py`` compiles them
with their flags named: a positional argument out of place shows up only here, or on the GPU.
"""

import inspect

import pytest
import torch

from flash_dma import build_block_mask, flash_dma_func, flash_dma_varlen_func, pack_mask
from flash_dma.backends.triton import backward, configs, dispatch, launch
from flash_dma.backends.triton.hopper.forward import hopper_forward
from flash_dma.backends.triton.layout import call_signature
from tests.backends.triton.test_kvcache import CacheCase, make_cache_inputs
from tests.backends.triton.test_kvcache import run as run_cache
from tests.backends.triton.test_varlen import VarlenCase, make_varlen_inputs
from tests.helpers import Case, kernel_call, make_fp8_inputs, make_inputs

PER_KEY = "B,Hkv,1,Sk"
H100_SMS = 132


@pytest.fixture
def bound_launches(monkeypatch):
    """Route as on a Hopper and replace every launch by a check of its arguments; yields the names
    of the kernels launched."""
    launched = []

    def check(prepared, tensors, addresses):
        args = prepared.template.copy()
        for slot, tensor in zip(prepared.slots, tensors):
            args[slot] = tensor
        fn = prepared.kernel.fn
        parameters = list(inspect.signature(fn).parameters)
        config = {name: value for name, value in prepared.options.items() if name in parameters}
        inspect.signature(fn).bind(*args, **config)  # one value per parameter, none missing
        assert parameters[len(args):] == list(config), f"{fn.__name__}: the configuration's parameters are not the last ones"
        launched.append(fn.__name__)

    monkeypatch.setattr(launch.Prepared, "run", check)
    monkeypatch.setattr(dispatch, "device_kind", lambda device: "hopper")
    # An H100's 132 SMs, so that split-KV is chosen as it would be there (the interpreter pretends 8).
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: H100_SMS)
    dispatch.route.cache_clear()
    launch.forget_choices()
    yield launched
    dispatch.route.cache_clear()
    launch.forget_choices()


CASES = [
    Case(seqlen_q=256, seqlen_k=256, heads=4, kv_heads=2, head_dim=64, mask=PER_KEY, bias=PER_KEY, causal=True, block_size=(128, 128)),
    Case(seqlen_q=256, seqlen_k=256, heads=4, kv_heads=2, head_dim=128, mask="B,Hkv,Sq,Sk", bias="B,H,Sq,Sk", causal=True,
         packed=True, block_size=(128, 128)),
    Case(seqlen_q=256, seqlen_k=256, heads=2, kv_heads=1, head_dim=256, bias="1,H,1,Sk", softcap=5.0),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_hopper_launches_bind_to_their_kernels(case, deterministic, bound_launches):
    inputs = make_inputs(case, torch.float16, requires_grad=True)
    mask, block_mask = inputs.pop("attn_mask"), None
    if case.packed:
        mask = pack_mask(mask, block_size=case.block_size)
    elif case.block_size is not None:
        block_mask = build_block_mask(mask, block_size=case.block_size)
    out = flash_dma_func(
        **inputs, attn_mask=mask, block_mask=block_mask, is_causal=case.causal, softcap=case.softcap,
        deterministic=deterministic, backend="triton",
    )
    out.sum().backward()
    assert {"_attn_fwd_hopper_kernel", "_dq_hopper_kernel", "_dkdv_hopper_kernel"} <= set(bound_launches), bound_launches
    # dQ starts beside the kernel launched before it (``hopper.dq.hopper_dq``): that must be dK/dV.
    assert bound_launches[bound_launches.index("_dq_hopper_kernel") - 1] == "_dkdv_hopper_kernel", bound_launches


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32], ids=str)
def test_a_per_key_bias_gradient_is_summed_in_the_zeroed_workspace(bias_dtype, bound_launches):
    """dQ beside dK/dV keeps the backward's workspace to its end: the bias gradient's float32
    buffer lies in it, zeroed by the preprocess, with no allocation and fill of its own; but not
    for a float32 bias, whose gradient would be that buffer itself and hold the workspace."""
    case = CASES[0]
    inputs = make_inputs(case, torch.float16)
    inputs["attn_bias"] = inputs["attn_bias"].to(bias_dtype)
    call = kernel_call(inputs, build_block_mask(inputs["attn_mask"], block_size=case.block_size), softmax_scale=0.125)
    plan = backward._plan(call, torch.empty_like(call.q), True, None)
    assert plan.hopper_dq and plan.bias_gradient.dtype == torch.float32
    assert (plan.workspace.first_word("dbias") is not None) == (bias_dtype != torch.float32)


def test_the_fp8_forward_launch_binds_to_its_kernel(bound_launches):
    case = CASES[0]
    quantized, _, descale = make_fp8_inputs(case)
    call = kernel_call(quantized, build_block_mask(quantized["attn_mask"], block_size=case.block_size), softmax_scale=0.125)
    call = call._replace(descale=descale)
    q = quantized["query"]
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
    before = len(bound_launches)  # on a GPU, build_block_mask's own kernels
    hopper_forward(call, out, lse, call_signature(call))
    assert bound_launches[before:] == ["_transpose_values_kernel", "_attn_fwd_hopper_kernel"]


def test_the_packed_launches_bind_to_their_kernels(bound_launches):
    """Packed sequences (varlen) with a per-key mask and bias, walked by summaries: all three Hopper kernels."""
    case = VarlenCase(lens_q=(300, 0, 129), lens_k=(300, 5, 129), head_dim=64, mask="sequence", bias="packed", causal=True)
    inputs = make_varlen_inputs(case, torch.float16)
    block_mask = build_block_mask(
        inputs["attn_mask"], cu_seqlens_k=inputs["cu_seqlens_k"], max_seqlen_k=inputs["max_seqlen_k"], block_size=(128, 128),
    )
    out = flash_dma_varlen_func(**inputs, is_causal=True, block_mask=block_mask, backend="triton")
    out.sum().backward()
    assert {"_attn_fwd_hopper_kernel", "_dq_hopper_kernel", "_dkdv_hopper_kernel"} <= set(bound_launches), bound_launches


@pytest.mark.parametrize(
    "layout", [dict(listed=True), dict(rows=True), dict(page_size=128)], ids=["contiguous-listed", "rows", "pages"],
)
def test_the_cache_prefill_launch_binds_to_its_kernel(layout, bound_launches):
    """A chunk of prefill over a KV cache (its own rows, rows cache_batch_idx names, or pages of
    whole key tiles), not split over its keys: the Hopper forward."""
    case = CacheCase(seqlen_q=130, new=130, cached=(300, 0, 900), capacity=1100, head_dim=64, num_splits=1, **layout)
    run_cache(case, make_cache_inputs(case, torch.float16), "triton")
    assert bound_launches[-1] == "_attn_fwd_hopper_kernel"
