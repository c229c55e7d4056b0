"""What the ranks of a test pool run (module-level functions: they travel to the workers by name)."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

from flash_dma import flash_dma_func
from flash_dma.backends.reference import reference_attention
from flash_dma.backends.triton.configs import triton_interpreting
from flash_dma.distributed import context_parallel_attention, plan_context_parallel, shard_sequence, unshard_sequence
from flash_dma.distributed import plan as plan_module
from tests.helpers import Case, assert_close, call_kwargs, make_inputs, reference_outputs

# Collectives that pass Python objects through the host, or wait for every rank there.
HOST_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "barrier")
# Tensor methods that read a value on the host (on a GPU: wait for it).
HOST_READS = ("item", "tolist", "__bool__")


def merge_rounding(lse_magnitude: float, dtype: torch.dtype) -> float:
    """The relative error that the ring's merges may add to a result in ``dtype``, beyond one
    process's (examples/context_parallel.py derives it): per merged partial, at most two per ring
    step, ``|lse| + 4`` float32 ulps; then one rounding to ``dtype``."""
    merges = 2 * dist.get_world_size()
    return merges * (lse_magnitude + 4) * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps


def device() -> torch.device:
    return torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")


def _sequence_dims(t: torch.Tensor) -> tuple[int | None, str]:
    """How a test shards a mask or bias: ``(dim, form)``; per-key forms by key, others by query row."""
    if t.shape[2] == 1:
        return (3, "keys") if t.shape[3] > 1 else (None, "replicated")
    return 2, "rows"


def _shard(t, layout, dim):
    return t if t is None or dim is None else shard_sequence(t, dim=dim, layout=layout)


def case_inputs(case: Case, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    """The whole sequence's inputs (the same on every rank: seeded by the case) and ``dout``."""
    inputs = make_inputs(case, dtype, device(), requires_grad=True)
    for first, last in case.extra.get("empty", ()):
        inputs["attn_mask"][..., first:last] = False  # whole chunks or key blocks that keep nothing
    shape = (case.batch, case.seqlen_q, case.heads, case.head_dim)
    dout = torch.randn(shape, generator=case.generator("dout")).to(device(), dtype)
    return inputs, dout


@contextlib.contextmanager
def host_round_trips():
    """Counts, by name, the calls of :data:`HOST_COLLECTIVES` and, where the backend runs no
    interpreter (which reads tensors on the host by design), of :data:`HOST_READS`."""
    counts = Counter()
    patched = [(dist, name) for name in HOST_COLLECTIVES]
    if not triton_interpreting():
        patched += [(torch.Tensor, name) for name in HOST_READS]
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def counting(name, original):
        def counted(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return counted

    for owner, name, original in originals:
        setattr(owner, name, counting(name, original))
    try:
        yield counts
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextlib.contextmanager
def gpu_syncs_raise():
    """On a GPU, any synchronisation with the host in the block raises (``torch.cuda.set_sync_debug_mode``)."""
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")


def matches_single_process(case: Case, layout: str, backend: str, dtype_name: str, planned: bool = False) -> None:
    """Context-parallel out and every gradient, unsharded, held to the rule that single-process
    ``flash_dma_func`` on the whole sequence meets (checked here too): an error against the float64
    reference of at most twice PyTorch's own in the same dtype, plus, for the ring's results, the
    rounding of its merges (:func:`merge_rounding`) as the floor.

    ``planned``: the calls take a plan made first; the checked call is the plan's second (the
    first warms it), and it must make no host round trip (:func:`host_round_trips`) nor, on a
    GPU, wait for the GPU. ``case.extra["kept_block"]``: the keys per block of the plan's kept-key
    summaries (:data:`flash_dma.distributed.plan.BLOCK`), smaller than the kernels' tile so that a
    short sequence holds whole blocks that keep nothing.
    """
    size = case.extra.get("kept_block", plan_module.BLOCK)
    original, plan_module.BLOCK = plan_module.BLOCK, size
    try:
        _matches_single_process(case, layout, backend, dtype_name, planned)
    finally:
        plan_module.BLOCK = original


def _matches_single_process(case: Case, layout: str, backend: str, dtype_name: str, planned: bool) -> None:
    dtype = getattr(torch, dtype_name)
    inputs, dout = case_inputs(case, dtype)
    oracle_out, oracle_lse, oracle_grads = reference_outputs(case, inputs, dout, torch.float64)
    torch_out, _, torch_grads = reference_outputs(case, inputs, dout, dtype)
    single = flash_dma_func(**inputs, **call_kwargs(case), backend=backend)
    single.backward(dout)
    single_grads = {name: inputs[name].grad for name in oracle_grads}
    finite_lse = oracle_lse[oracle_lse.isfinite()]
    rounding = merge_rounding(finite_lse.abs().max().item() if finite_lse.numel() else 0.0, dtype)

    def check(name, actual, oracle, pytorch, single_result):
        assert_close(f"{name} (single process)", single_result, oracle, pytorch)
        assert_close(name, actual, oracle, pytorch, floor=rounding)

    mask, bias = inputs["attn_mask"], inputs["attn_bias"]
    mask_dim = None if mask is None else _sequence_dims(mask)[0]
    bias_dim, bias_form = (None, None) if bias is None else _sequence_dims(bias)
    shards = {
        "query": _shard(inputs["query"].detach(), layout, 1).requires_grad_(),
        "key": _shard(inputs["key"].detach(), layout, 1).requires_grad_(),
        "value": _shard(inputs["value"].detach(), layout, 1).requires_grad_(),
        "attn_mask": _shard(mask, layout, mask_dim),
        "attn_bias": None if bias is None else _shard(bias.detach(), layout, bias_dim).requires_grad_(),
    }
    settings = {**call_kwargs(case), "layout": layout, "backend": backend}
    dout_r = _shard(dout, layout, 1)
    if planned:
        with host_round_trips() as planning:
            plan = plan_context_parallel(**shards, **settings)
        assert planning["all_gather_object"] == 2, dict(planning)  # lengths, then descriptions: the count works
        context_parallel_attention(**shards, **settings, plan=plan).backward(dout_r)
        for t in shards.values():
            if t is not None:
                t.grad = None
        with host_round_trips() as counts, gpu_syncs_raise():
            out = context_parallel_attention(**shards, **settings, plan=plan)
            out.backward(dout_r)
        assert not counts, f"host round trips in calls with a plan: {dict(counts)}"
    else:
        out = context_parallel_attention(**shards, **settings)
        out.backward(dout_r)

    check("out", unshard_sequence(out.detach(), layout=layout), oracle_out, torch_out, single.detach())
    for name, expected in oracle_grads.items():
        grad = shards[name].grad
        assert grad.dtype == shards[name].dtype and grad.shape == shards[name].shape, name
        if name == "attn_bias" and bias_form == "replicated":
            dist.all_reduce(grad)  # each rank holds its queries' share, as for any replicated parameter
            whole = grad
        else:
            whole = unshard_sequence(grad, dim=bias_dim if name == "attn_bias" else 1, layout=layout)
        check(f"d{name}", whole, expected, torch_grads[name], single_grads[name])


def _described_call(spec: dict) -> tuple[tuple, dict]:
    """The arguments ``(q, k, v), keywords`` that ``spec`` describes: ``length``, ``dtype``, ``bias``
    (a shape), ``causal``."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    length = spec["length"]
    q = torch.randn(1, length, 2, 8, generator=gen).to(device(), dtype)
    k = torch.randn(1, length, 1, 8, generator=gen).to(device(), dtype)
    bias = None if "bias" not in spec else torch.zeros(spec["bias"]).to(device(), dtype)
    return (q, k, k), {"attn_bias": bias, "is_causal": spec.get("causal", True)}


def call_with(per_rank: list[dict], layout: str = "zigzag") -> None:
    """``context_parallel_attention`` with this rank's entry of ``per_rank``: a description of
    inputs (:func:`_described_call`), for the bad-input tests."""
    tensors, keywords = _described_call(per_rank[dist.get_rank()])
    context_parallel_attention(*tensors, **keywords, layout=layout)


def call_with_plan(planned: dict, called: dict, call_keywords: dict) -> None:
    """A plan made for the inputs ``planned`` describes (:func:`_described_call`), then a call with
    it on those ``called`` describes, and ``call_keywords``."""
    tensors, keywords = _described_call(planned)
    plan = plan_context_parallel(*tensors, **keywords)
    tensors, keywords = _described_call(called)
    context_parallel_attention(*tensors, **{**keywords, "plan": plan, **call_keywords})


@contextlib.contextmanager
def float64_attention(module):
    """In the block, ``module``'s ``flash_dma_func`` (the name its calls use) is the reference in
    float64 (``flash_dma_func`` takes no float64); the yielded list gets each call's largest finite
    ``|lse|``."""
    seen = []

    def exact(query, key, value, attn_mask=None, attn_bias=None, *, is_causal=False, block_mask=None, backend=None):
        out, lse = reference_attention(
            query, key, value, attn_mask, attn_bias, window=(-1, 0) if is_causal else (-1, -1), block_mask=block_mask,
            compute_dtype=torch.float64,
        )
        finite = lse[lse.isfinite()]
        seen.append(finite.abs().max().item() if finite.numel() else 0.0)
        return out

    original = module.flash_dma_func
    module.flash_dma_func = exact
    try:
        yield seen
    finally:
        module.flash_dma_func = original
    assert seen, f"no call of {module.__name__}.flash_dma_func was seen"


def layer_matches_single_process(layer_kwargs: dict, seqlen: int, backend: str, dtype_name: str) -> None:
    """``DynamicMaskAttention`` on shards, ``context_parallel`` set, against the same layer on the
    whole sequence: outputs, the input gradient, and parameter gradients summed over ranks. Both
    are held to the layer in float64 (:func:`float64_attention`) as :func:`matches_single_process` holds
    its calls: at most twice one process's error, plus the rounding of the ring's merges."""
    import copy

    from flash_dma.distributed import ContextParallel
    from flash_dma.modules import DynamicMaskAttention
    from flash_dma.modules import attention as attention_module

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    layer = DynamicMaskAttention(32, 4, 2, backend=backend, **layer_kwargs).to(device(), dtype)
    with torch.no_grad():
        layer.A.copy_(torch.randn(2))  # a bias that orders the keys (A = 0 ties them all)
    sharded = copy.deepcopy(layer)
    exact = copy.deepcopy(layer).double()
    hidden = torch.randn(2, seqlen, 32, generator=torch.Generator().manual_seed(1)).to(device())
    padding = torch.ones(2, seqlen, dtype=torch.bool, device=device())
    padding[1, :5] = False
    weights = torch.randn(2, seqlen, 32, generator=torch.Generator().manual_seed(2)).to(device())

    def whole_sequence(model, dtype):
        """``out``, the input's gradient and the parameters' of ``model`` on the whole sequence."""
        x = hidden.to(dtype, copy=True).requires_grad_()
        out = model(x, padding)
        (out * weights.to(dtype)).sum().backward()
        return out.detach(), x.grad, [p.grad for p in model.parameters()]

    one = whole_sequence(layer, dtype)
    with float64_attention(attention_module) as lse:
        oracle = whole_sequence(exact, torch.float64)
    rounding = merge_rounding(max(lse), dtype)

    shard = shard_sequence(hidden.to(dtype)).requires_grad_()
    out_shard = sharded(shard, shard_sequence(padding), context_parallel=ContextParallel())
    (out_shard * shard_sequence(weights.to(dtype))).sum().backward()
    for q in sharded.parameters():
        dist.all_reduce(q.grad)  # replicated parameters: each rank holds its tokens' share
    ours = (unshard_sequence(out_shard.detach()), unshard_sequence(shard.grad), [q.grad for q in sharded.parameters()])

    names = ["out", "hidden_states.grad", *(f"{name}.grad" for name, _ in layer.named_parameters())]
    flat = [[result[0], result[1], *result[2]] for result in (ours, oracle, one)]
    for name, actual, expected, baseline in zip(names, *flat, strict=True):
        assert_close(name, actual, expected, baseline, floor=rounding)
