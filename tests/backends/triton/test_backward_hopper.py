"""The Hopper backward kernels (warp-specialised Gluon dK/dV and dQ) against float64 autograd of the reference.

They run on sm90 only; elsewhere these tests skip, and ``test_compiles_for_gpu`` compiles them.
Cases run the whole backward through ``flash_dma_func`` and check which kernels it took.
"""

import pytest
import torch

from flash_dma import memo
from flash_dma.backends.triton import backward as backward_module
from flash_dma.backends.triton.backward import attention_backward, forced_query_chunks
from flash_dma.backends.triton.forward import attention_forward
from flash_dma.backends.triton.hopper import common as hopper_common
from flash_dma.backends.triton.hopper.dq import hopper_dq_launcher
from flash_dma.block_mask import FULL
from flash_dma.masks import topk_block_mask
from tests.helpers import (
    DTYPE_IDS,
    HOPPER_ONLY,
    HOPPER_PAIR_CASES,
    KERNEL_DTYPES,
    Case,
    assert_close,
    assert_gradients_close,
    hopper_passes,
    kernel_call,
    make_inputs,
    reference_outputs,
    triton_call,
)

pytestmark = HOPPER_ONLY

PER_KEY = "B,Hkv,1,Sk"
CASES = [
    # A per-key mask in 16-key runs: key tiles PARTIAL, some FULL or EMPTY; a bias per kv head.
    Case(seqlen_q=130, seqlen_k=239, head_dim=64, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    # A bias per query head (its gradient is flushed head by head), GQA groups of 2.
    Case(seqlen_q=1023, seqlen_k=1023, head_dim=128, mask=PER_KEY, bias="1,H,1,Sk", mask_kind="blocks", causal=True, block_size=(128, 128)),
    # Bias shared by the batch (its gradient added by atomics), mask shared by every head.
    Case(seqlen_q=239, seqlen_k=1023, heads=6, kv_heads=2, head_dim=128, mask="1,1,1,Sk", bias="1,1,1,Sk", mask_kind="blocks", block_size=(128, 128)),
    # Summary blocks of 2 x 4 query tiles and 2 key tiles.
    Case(seqlen_q=600, seqlen_k=777, head_dim=64, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(256, 256)),
    # Causal with Sq > Sk: the top rows see nothing (LSE -inf), their gradients are 0.
    Case(seqlen_q=300, seqlen_k=63, heads=3, kv_heads=1, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True, block_size=(128, 128)),
    # No summary: the dense walk, a mask read per key on every tile, ragged lengths.
    Case(seqlen_q=1, seqlen_k=1, head_dim=64, bias=PER_KEY),
    Case(seqlen_q=17, seqlen_k=1023, head_dim=128, bias="1,H,1,Sk", bias_fp32=True, causal=True),
    Case(seqlen_q=1023, seqlen_k=17, head_dim=64, causal=True),
    Case(seqlen_q=113, seqlen_k=200, heads=8, kv_heads=8, head_dim=128, mask=PER_KEY, mask_kind="blocks"),
    # Windows: narrow, both sides, and wider than the keys.
    Case(seqlen_q=500, seqlen_k=700, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", window=(100, 3), block_size=(128, 128)),
    Case(seqlen_q=130, seqlen_k=130, head_dim=64, bias=PER_KEY, window=(0, 0)),
    Case(seqlen_q=63, seqlen_k=90, head_dim=128, bias=PER_KEY, window=(5000, 5000), causal=True),
    # Many work items per program: the queue wraps around several times.
    Case(batch=3, seqlen_q=2048, seqlen_k=2048, heads=16, kv_heads=4, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    # Key lists (token-level per-key masks): dQ and dK/dV gather the kept keys as the forward does,
    # dK/dV writes them back at their positions and zeros for the dropped keys.
    Case(seqlen_q=300, seqlen_k=777, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True, listed=True),
    Case(seqlen_q=500, seqlen_k=700, heads=6, kv_heads=2, head_dim=64, mask="1,1,1,Sk", bias="1,H,1,Sk", window=(100, 3), listed=True),
    # Softcap: dK and dQ through the cap's slope, the bias gradient without it.
    Case(seqlen_q=600, seqlen_k=777, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128), softcap=5.0),
    Case(seqlen_q=130, seqlen_k=239, heads=6, kv_heads=2, head_dim=64, bias="B,H,Sq,Sk", window=(40, 40), softcap=2.0),
    # Head dims of 32, and of 96 in tiles of 128 columns (the copies fill the last 32 with zeros).
    Case(seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=32, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    Case(seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=96, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128)),
    Case(seqlen_q=200, seqlen_k=300, head_dim=96, bias="B,H,Sq,Sk", window=(40, 40), softcap=2.0),
    # Head dims of 256 and 192 (tiles of 256 columns): dQ with one Q/dO slot and K/V tiles of 32
    # keys, dK/dV in items of 64 keys, one warpgroup keeping dV and the other dK.
    Case(seqlen_q=300, seqlen_k=400, heads=4, kv_heads=2, head_dim=256, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True,
         block_size=(128, 128)),
    Case(seqlen_q=200, seqlen_k=300, head_dim=192, bias="B,H,Sq,Sk", window=(40, 40), softcap=2.0),
    Case(seqlen_q=300, seqlen_k=777, heads=4, kv_heads=1, head_dim=256, mask=PER_KEY, bias="1,H,1,Sk", causal=True, listed=True),
]


PAIR_CASES = [
    *HOPPER_PAIR_CASES,
    # A bool per-pair mask on a problem walked as large ones are: packed into bits inside the call.
    Case(seqlen_q=600, seqlen_k=600, heads=4, kv_heads=2, head_dim=128, mask="B,Hkv,Sq,Sk", bias="B,H,Sq,Sk", causal=True, listed=True),
    # A bias per pair over a key list: both kernels read its kept keys' biases.
    Case(seqlen_q=400, seqlen_k=500, head_dim=64, mask=PER_KEY, bias="B,H,Sq,Sk", causal=True, listed=True),
]


def _hopper_kernels(case: Case) -> list[str]:
    """The Hopper kernels the case's backward takes: both, unless a per-pair bool mask stays a
    bool mask (a small problem: the Triton kernels)."""
    shape = case.dims(case.mask) if case.mask else (1, 1, 1, 1)
    bool_pairs = shape[2] > 1 and shape[3] > 1 and not case.packed and not case.listed
    return [] if bool_pairs else ["dkdv", "dq"]


@pytest.fixture
def hopper_calls(monkeypatch):
    """The backward launches that took a Hopper kernel: ``"dkdv"`` or ``"dq"`` (``hopper_passes``:
    the call's own, not its dry run's)."""
    return hopper_passes(monkeypatch, ("dkdv", "dq"))


@pytest.mark.parametrize(
    "chunks, counted, deterministic", [(1, False, False), (3, False, False), (8, True, False), (3, False, True)],
    ids=["chunks1", "chunks3", "counted-up-to-8", "chunks3-deterministic"],
)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES + PAIR_CASES, ids=str)
def test_hopper_gradients_match_reference(case, dtype, chunks, counted, deterministic, hopper_calls, poison_outputs):
    """Written directly (one chunk) or added up in fp32 scratch (three chunks of each key tile's
    queries, or as many up to 8 as the columns' work counted by the kernel wants): by atomics, or
    deterministic, in slices of their own, summed in chunk order."""
    inputs = make_inputs(case, dtype, requires_grad=True)
    before = {name: t.detach().clone() for name, t in inputs.items() if t is not None}
    with forced_query_chunks(chunks, counted):
        out = triton_call(case, inputs, deterministic=deterministic)
        dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
        out.backward(dout)
    assert hopper_calls == _hopper_kernels(case)
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    _, _, baseline = reference_outputs(case, inputs, dout, dtype)
    assert_gradients_close(inputs, oracle, baseline)
    assert all(torch.equal(inputs[name].detach(), t) for name, t in before.items())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_hopper_walks_a_per_query_block_summary(dtype, hopper_calls, monkeypatch, poison_outputs):
    """A per-query-block top-k (``topk_block_mask(query_len=...)``) with no element-wise mask:
    both kernels walk its lists, and dK/dV counts it as a mask when choosing query chunks (its
    columns are sparse; the sink column is seen by every query), and counts its columns' work."""
    case = Case(seqlen_q=1000, seqlen_k=1000, heads=4, kv_heads=2, head_dim=128, bias=PER_KEY, causal=True)
    masked = []
    real = backward_module.query_chunks

    def recorded(seqlen_q, seqlen_k, kv_entries, in_order, device, queued, is_masked, counted):
        masked.append((is_masked, counted))
        return real(seqlen_q, seqlen_k, kv_entries, in_order, device, queued, is_masked, counted)

    monkeypatch.setattr(backward_module, "query_chunks", recorded)
    memo.forget_memos()  # the chunks of a layout seen before are remembered
    inputs = make_inputs(case, dtype, requires_grad=True)
    summary = topk_block_mask(
        inputs["attn_bias"].detach(), 256, block_size=(128, 128), query_len=case.seqlen_q, is_causal=True,
        sink_blocks=1, local_blocks=1,
    )
    out = triton_call(case, inputs, block_mask=summary)
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    out.backward(dout)
    assert hopper_calls == ["dkdv", "dq"] and masked == [(True, True)]
    as_elements = dict(inputs, attn_mask=summary.dense_rows(0, case.seqlen_q, case.seqlen_k) == FULL)
    _, _, oracle = reference_outputs(case, as_elements, dout, torch.float64)
    _, _, baseline = reference_outputs(case, as_elements, dout, dtype)
    assert_gradients_close(inputs, oracle, baseline)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_float32_gradients(dtype, hopper_calls, poison_outputs):
    """Gradients asked for in float32 (context parallelism sums several calls' before rounding):
    the Hopper dQ stores them from registers (they are too wide for its Q tile in shared memory)."""
    case = Case(seqlen_q=300, seqlen_k=300, heads=4, kv_heads=2, head_dim=128, bias=PER_KEY, causal=True)
    inputs = make_inputs(case, dtype, requires_grad=True)
    detached = {name: None if t is None else t.detach() for name, t in inputs.items()}
    call = kernel_call(detached, softmax_scale=case.head_dim**-0.5, window=(-1, 0))
    out, lse = attention_forward(call)
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    grads = attention_backward(dout, call, out, lse, True, grad_dtype=torch.float32)
    assert hopper_calls == ["dkdv", "dq"] and all(g.dtype == torch.float32 for g in grads[:3])
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    _, _, baseline = reference_outputs(case, inputs, dout, dtype)
    for name, grad in zip(("query", "key", "value", "attn_bias"), grads):
        assert_close(name, grad, oracle[name], baseline[name])


def test_backward_dispatch(hopper_calls, monkeypatch):
    """Plain backwards take the Hopper kernels, softcapped and deterministic ones too; a bool
    per-pair mask and FLASH_DMA_HOPPER=0 take the Triton ones."""
    case = Case(seqlen_q=256, seqlen_k=256, heads=4, kv_heads=2, head_dim=128, bias=PER_KEY, causal=True)

    def backward(case, **kwargs):
        inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
        triton_call(case, inputs, **kwargs).sum().backward()

    backward(case)
    assert hopper_calls == ["dkdv", "dq"]
    backward(case, deterministic=True)
    assert hopper_calls == ["dkdv", "dq"] * 2
    backward(case.with_(softcap=5.0))
    assert hopper_calls == ["dkdv", "dq"] * 3
    backward(case.with_(mask="B,Hkv,Sq,Sk"))  # a small problem's bool per-pair mask
    monkeypatch.setenv("FLASH_DMA_HOPPER", "0")
    backward(case)
    assert hopper_calls == ["dkdv", "dq"] * 3


def test_dq_is_launched_right_behind_dkdv_to_start_beside_it(hopper_calls):
    """dQ goes right behind dK/dV in the stream, by programmatic dependent launch: any kernel
    launched between them would run beside dQ instead, unordered with it. The kernel that started
    just before dQ is dK/dV, dQ's launch asks to start beside it, and the gradients are as exact as
    ever. (Whether it does start before dK/dV ends depends on the host issuing it in time, which
    the profiler slows: docs/design-notes.md, "Hopper backward: dQ beside dK/dV's last programs",
    times it.)"""
    case = Case(batch=2, seqlen_q=2048, seqlen_k=2048, heads=8, kv_heads=2, head_dim=128, mask=PER_KEY, bias=PER_KEY,
                mask_kind="blocks", causal=True, block_size=(128, 128))
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    dout = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, generator=case.generator("dout")).to(inputs["query"])
    triton_call(case, inputs).backward(dout)  # compiled, and its dry run done, before the profiled call
    for t in inputs.values():
        if t is not None and t.requires_grad:
            t.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        triton_call(case, inputs).backward(dout)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start,
    )
    names = [e.name for e in kernels]
    assert names[names.index("_dq_hopper_kernel") - 1] == "_dkdv_hopper_kernel", names
    assert all(compiled.metadata.launch_pdl for compiled, _ in hopper_dq_launcher.compiled.values())
    assert hopper_calls == ["dkdv", "dq"] * 2
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    _, _, baseline = reference_outputs(case, inputs, dout, KERNEL_DTYPES[0])
    assert_gradients_close(inputs, oracle, baseline)


def test_a_key_list_is_gathered_once_per_backward(hopper_calls, monkeypatch):
    """The kept keys of a key list are gathered once for both backward kernels
    (``common.kept_keys``), not once for dK/dV and again for dQ."""
    gathers = []
    gather = hopper_common.gather_kept_keys

    def counted(*args):
        if not memo.dry_running():
            gathers.append(len(args))
        return gather(*args)

    monkeypatch.setattr(hopper_common, "gather_kept_keys", counted)
    case = Case(seqlen_q=300, seqlen_k=777, head_dim=128, mask=PER_KEY, bias=PER_KEY, causal=True, listed=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    out = triton_call(case, inputs)
    dout = torch.randn(out.shape, generator=case.generator("dout")).to(out)
    before = len(gathers)
    out.backward(dout)
    assert hopper_calls == ["dkdv", "dq"]
    assert len(gathers) - before == 1
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    _, _, baseline = reference_outputs(case, inputs, dout, KERNEL_DTYPES[0])
    assert_gradients_close(inputs, oracle, baseline)

DETERMINISTIC_CASES = [
    # Per-key bias shared by the batch and the key/value heads: a slice per program, summed after.
    Case(batch=2, seqlen_q=1500, seqlen_k=1500, heads=8, kv_heads=2, head_dim=128, mask=PER_KEY, bias="1,1,1,Sk",
         mask_kind="blocks", causal=True, block_size=(128, 128)),
    # Per-pair bias per key/value head, walked per query head: a slice per query head, summed after.
    Case(seqlen_q=700, seqlen_k=700, heads=4, kv_heads=2, head_dim=64, bias="B,Hkv,Sq,Sk", causal=True, softcap=5.0),
    # A key list, its per-key bias shared by the key/value heads.
    Case(seqlen_q=900, seqlen_k=1100, heads=4, kv_heads=2, head_dim=128, mask=PER_KEY, bias="1,1,1,Sk", causal=True, listed=True),
]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=str)
def test_deterministic_gradients_are_bit_identical(case, hopper_calls):
    """deterministic=True: the Hopper dK/dV writes each query chunk's part to a slice of its own,
    summed in chunk order, and the bias gradient's shared rows are summed after the kernel, so
    two runs agree bit for bit."""
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    summary = None
    if case.bias.startswith("B,Hkv,Sq"):  # a per-query-head walk: the summary's rows differ per query head
        scores = torch.randn(case.batch, case.heads, 1, case.seqlen_k, generator=case.generator("walk")).to(inputs["query"].device)
        summary = topk_block_mask(scores, 256, block_size=(128, 128), query_len=case.seqlen_q, is_causal=True)
    dout = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, generator=case.generator("dout")).to(inputs["query"])
    runs = []
    with forced_query_chunks(5):
        for _ in range(3):
            for t in inputs.values():
                if t is not None and t.requires_grad:
                    t.grad = None
            out = triton_call(case, inputs, deterministic=True, **({} if summary is None else {"block_mask": summary}))
            out.backward(dout)
            runs.append([inputs[n].grad.clone() for n in ("query", "key", "value", "attn_bias")])
    assert hopper_calls == ["dkdv", "dq"] * 3
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
    as_elements = inputs if summary is None else dict(inputs, attn_mask=summary.dense_rows(0, case.seqlen_q, case.seqlen_k) == FULL)
    _, _, oracle = reference_outputs(case, as_elements, dout, torch.float64)
    _, _, baseline = reference_outputs(case, as_elements, dout, KERNEL_DTYPES[0])
    assert_gradients_close(inputs, oracle, baseline)
