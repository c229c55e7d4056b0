"""One fuzz trial: build its inputs, run the Triton backend forward and backward, compare.

The comparison is the suite's own (``tests/helpers.py``): every result against the float64
reference, with an error of at most twice the reference's own error in the input dtype plus a
small floor; for gradients the floor is their dtype's rounding unit, as in FlashAttention's
tests, and the bias gradient is first cleared of the error that the kernels make by design
(``_output_rounding``). On top of it, what the contract states exactly: rows with no visible key give
``out = 0``, ``lse = -inf`` and zero dQ; bias positions and keys that no query attends get
exactly zero gradients; gradients have their input's shape and dtype; with
``repeat_backward`` a second backward gives a bitwise-equal dQ (free of atomics) and, in
deterministic mode, every gradient (dK and dV otherwise add query chunks, or top-k entries, by
atomics, as the bias gradient does); with ``check_inputs`` no input has changed.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field

import torch

import flash_dma
from flash_dma import BitMask, BlockMask, KeyIntervals, build_block_mask, causal_topk_intervals, interval_mask, pack_mask
from flash_dma.backends.reference import reference_attention, reference_topk_attention, valid_indices, visible_positions
from flash_dma.backends.triton.backward import forced_query_chunks
from flash_dma.backends.triton.topk import union
from flash_dma.block_mask import effective_mask_rows
from flash_dma.inputs import FP8_DTYPE, FP8_OUT_DTYPE, dequantize, head_descale, output_dtype
from flash_dma.masks import topk_block_mask
from tests.fuzz.configs import INDICES, INTERVALS, Trial
from tests.helpers import Case, assert_close, poisoned_empty, reference_outputs, topk_reference_outputs, triton_call

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": FP8_DTYPE}
_DESCALES = ("q_descale", "k_descale", "v_descale")
_MASK_DTYPES = {"bool": torch.bool, "uint8": torch.uint8, "int64": torch.int64}
_GUARD = 4096  # elements before and after each input; a multiple of 16 bytes keeps pointers aligned
_GRADIENTS = ("query", "key", "value", "attn_bias")
_TRACEBACK_CHARS = 3000  # of a crash's traceback kept in the report (Triton's compile errors run long)


@dataclass
class Outcome:
    """What a trial gave: ``status`` is ``"ok"``, ``"mismatch"`` or ``"crash"`` (an exception,
    raised in ``stage``); ``problems`` says what was wrong, one line each."""

    status: str = "ok"
    problems: list[str] = field(default_factory=list)
    stage: str | None = None
    empty_rows: bool = False  # some query row saw no key (coverage)
    seconds: float = 0.0


def _stored(values: torch.Tensor, padded: bool, fill) -> torch.Tensor:
    """``values`` as a view into a buffer filled with ``fill``, with guard elements on both sides
    and, when ``padded``, rows of the last dimension strided by a multiple of 16 past its end.
    Reads outside the view pick up ``fill`` (NaN for floats, True for masks)."""
    *lead, last = values.shape
    width = (last // 16 + 1) * 16 if padded else last
    rows = values.numel() // last
    buffer = torch.full((2 * _GUARD + rows * width,), fill, dtype=values.dtype, device=values.device)
    view = buffer[_GUARD : _GUARD + rows * width].view(*lead, width)[..., :last]
    view.copy_(values)
    return view.detach()


def _mask(trial: Trial, gen: torch.Generator, device) -> torch.Tensor:
    shape = trial.dims(trial.mask)
    density = trial.mask_density
    rand = lambda *size: torch.rand(size, generator=gen, device=device)  # noqa: E731
    mask = rand(*shape) < density
    if trial.mask_pattern == "blocks":
        # Blocks empty, full or random, at the summary's block size, so that summaries hold all three states.
        bq, bk = trial.block_size or (16, 16)
        kind = torch.randint(0, 3, (*shape[:2], -(-shape[2] // bq), -(-shape[3] // bk)), generator=gen, device=device)
        kind = kind.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., : shape[2], : shape[3]]
        mask = torch.where(kind == 0, False, torch.where(kind == 1, True, mask))
    elif trial.mask_pattern == "rows":
        mask &= rand(*shape[:3], 1) >= 0.3  # about 30% of the rows fully masked
    elif trial.mask_pattern == "keys":
        mask = (rand(*shape[:2], 1, shape[3]) < density).expand(shape)  # the same keys for every query
    elif trial.mask_pattern == "none":
        mask = torch.zeros(shape, dtype=torch.bool, device=device)
    elif trial.mask_pattern == "all":
        mask = torch.ones(shape, dtype=torch.bool, device=device)
    return _stored(mask.to(_MASK_DTYPES[trial.mask_dtype]), trial.padded, 1)


def _indices(trial: Trial, gen: torch.Generator, device) -> torch.Tensor:
    """``[B, Sq, Hkv, W]`` int32 lists for the indices walk, shaped by the trial's mask pattern: about
    ``1 - density`` of the entries -1, a few past the keys, repeats; ``rows``: some lists empty;
    ``keys``: every query lists the same keys (the longest dK/dV sums); ``none``: nothing listed."""
    shape = (trial.batch, trial.seqlen_q, trial.kv_heads, trial.width)
    rand = lambda *size: torch.rand(size, generator=gen, device=device)  # noqa: E731
    keys = torch.randint(0, max(trial.seqlen_k, 1), shape, generator=gen, device=device)
    if trial.mask_pattern == "keys":
        keys = keys[:, :1].expand(shape)
    keys = torch.where(rand(*shape) < 0.1, keys.roll(1, dims=-1), keys)  # repeats
    keys = torch.where(rand(*shape) < 0.05, trial.seqlen_k + keys % 3, keys)  # past the keys
    listed = rand(*shape) < trial.mask_density
    if trial.mask_pattern == "rows":
        listed &= rand(*shape[:3], 1) >= 0.3
    elif trial.mask_pattern == "none":
        listed &= False
    return _stored(torch.where(listed, keys, -1).to(torch.int32), trial.padded, -7)


def _key_intervals(trial: Trial, gen: torch.Generator, device) -> KeyIntervals:
    """The intervals trial's mask (``Trial``), its tensors stored as the trial's layout says: a
    causal top-k of scores ``[Bm, Hm, Sk]`` (keys padded by the mask pattern and density: none
    with "all", every one with "none"), or runs of rows ``[start, end)`` spilling past the rows."""
    batch, heads, sq, sk = trial.dims(trial.mask)
    shape = (batch, heads, sk)
    spec = trial.intervals
    if spec["kind"] == "topk":
        scores = torch.randint(0, 4, shape, generator=gen, device=device).float() if spec["ties"] else torch.randn(shape, generator=gen, device=device)
        padding = None
        if trial.mask_pattern != "all":
            padding = torch.rand(batch, sk, generator=gen, device=device) < (0.0 if trial.mask_pattern == "none" else trial.mask_density)
        dtype = torch.float32 if trial.dtype == "fp8" else TORCH_DTYPES[trial.dtype]  # scores in the model's precision
        scores = _stored(scores.to(dtype), trial.padded, float("nan"))
        return causal_topk_intervals(scores, spec["keep"], padding, query_len=sq, block_size=trial.block_size)
    start = torch.randint(-2, sq + 2, shape, generator=gen, device=device, dtype=torch.int32)
    end = start + torch.randint(-2, sq + 2, shape, generator=gen, device=device, dtype=torch.int32)
    if spec["aligned"]:  # each key keeping all of a 128-row tile's rows or none
        start, end = start // 128 * 128, end // 128 * 128
    # Reads past the keys would pick up runs over every row.
    start = _stored(start, trial.padded, -(2**30)) if spec["start"] else None
    return interval_mask(_stored(end, trial.padded, 2**30), start, query_len=sq, block_size=trial.block_size)


def make_inputs(trial: Trial, device) -> tuple[dict, BlockMask | None, torch.Tensor]:
    """``(inputs, block_mask, dout)``: inputs in ``flash_dma_func``'s argument names, seeded by the trial."""
    gen = torch.Generator(device=device).manual_seed(trial.data_seed)
    dtype = TORCH_DTYPES[trial.dtype]
    fp8 = dtype == FP8_DTYPE  # forward only: e4m3 inputs with descales, nothing requires a gradient
    randn = lambda *size: torch.randn(size, generator=gen, device=device)  # noqa: E731
    b, sq, sk, d = trial.batch, trial.seqlen_q, trial.seqlen_k, trial.head_dim
    descale = 0.5 + 1.5 * torch.rand(b, trial.kv_heads, 3, generator=gen, device=device)
    q, k, v = (
        _stored((randn(b, s, h, d) / head_descale(descale[..., i], h) if fp8 else randn(b, s, h, d)).to(dtype), trial.padded, float("nan"))
        .requires_grad_(trial.grad_qkv and not fp8)
        for i, (s, h) in enumerate(((sq, trial.heads), (sk, trial.kv_heads), (sk, trial.kv_heads)))
    )
    if trial.walk == INTERVALS:
        mask = _key_intervals(trial, gen, device)
    else:
        mask = None if trial.mask is None else _mask(trial, gen, device)
    if trial.walk == INDICES:
        mask = _indices(trial, gen, device)
    bias = None
    if trial.bias is not None:
        shape = trial.dims(trial.bias)
        values = randn(*shape) * trial.bias_scale
        values = values.masked_fill(torch.rand(shape, generator=gen, device=device) < trial.bias_neg_inf, float("-inf"))
        bias_dtype = torch.float32 if trial.bias_fp32 else output_dtype(dtype)
        bias = _stored(values.to(bias_dtype), trial.padded, float("nan")).requires_grad_(not fp8)
    block_mask = None
    if trial.walk == "summary" and trial.packed:
        mask = pack_mask(mask, block_size=trial.block_size)  # its own summary: no block_mask
    elif trial.walk == "summary":
        block_mask = build_block_mask(mask, block_size=trial.block_size)
    elif trial.walk == "topk":
        top = trial.topk
        # Selection by the per-key bias when there is one (the usual use), else by scores of its own.
        per_key_bias = bias is not None and bias.shape[2] == 1 and bias.shape[3] == sk
        scores = bias if per_key_bias else randn(b, trial.kv_heads, 1, sk)
        block_mask = topk_block_mask(
            scores, top["keys"], mask, block_size=trial.block_size, reduce=top["reduce"],
            query_len=sq if top["per_query"] else None, is_causal=top["causal"],
            sink_blocks=top["sink_blocks"], local_blocks=top["local_blocks"],
        )
    inputs = {"query": q, "key": k, "value": v, "attn_mask": mask, "attn_bias": bias}
    if trial.walk == INDICES:
        inputs["indices"] = inputs.pop("attn_mask")
    if fp8:
        inputs.update(zip(_DESCALES, descale.unbind(-1)))
    dout = None if fp8 else randn(b, sq, trial.heads, d).to(dtype)
    return inputs, block_mask, dout


def _dequantized(inputs: dict) -> dict:
    """FP8 ``inputs`` as the float32 values they stand for, without their descales (what the reference reads)."""
    exact = {name: t for name, t in inputs.items() if name not in _DESCALES}
    for name, descale in zip(("query", "key", "value"), _DESCALES):
        exact[name] = dequantize(inputs[name], inputs[descale])
    return exact


def _case(trial: Trial) -> Case:
    """The suite's description of the call's settings (what ``triton_call`` and ``reference_outputs`` read)."""
    return Case(causal=trial.causal, window=trial.window, softcap=trial.softcap, listed=trial.walk == "listed")


@contextlib.contextmanager
def _forced_union_share(share: float | None):
    """The top-k backward's union share (``union.UNION_SHARE``) forced for the trial: every
    query block over its union of keys (1), or none (-1); None keeps the default split."""
    real = union.UNION_SHARE
    if share is not None:
        union.UNION_SHARE = share
    try:
        yield
    finally:
        union.UNION_SHARE = real


@contextlib.contextmanager
def _poisoned_outputs():
    """New tensors start as NaN (integers at their maximum), so an element a kernel fails to write shows up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    torch.empty, torch.empty_like = poisoned_empty(real_empty), poisoned_empty(real_empty_like)
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def _attended(trial: Trial, inputs: dict, block_mask) -> torch.Tensor:
    """``[B, H, Sq, Sk]`` bool: the pairs with a finite score (visible, and no -inf bias)."""
    window = (trial.window[0], 0) if trial.causal else trial.window
    device = inputs["query"].device
    shape = (trial.batch, trial.heads, trial.seqlen_q, trial.seqlen_k)
    pairs = visible_positions(torch.arange(trial.seqlen_q, device=device), trial.seqlen_q, trial.seqlen_k, window)
    group = trial.heads // trial.kv_heads

    def per_query_head(t):  # a head dimension of Hkv is shared by the heads of each group
        return t.repeat_interleave(group, dim=1) if t.shape[1] not in (1, trial.heads) else t

    allowed = effective_mask_rows(inputs["attn_mask"], block_mask, 0, trial.seqlen_q, trial.seqlen_k)
    if allowed is not None:
        pairs = pairs & per_query_head(allowed)
    if inputs["attn_bias"] is not None:
        pairs = pairs & per_query_head(inputs["attn_bias"].detach() != float("-inf"))
    return pairs.expand(shape)


def _reduce(t: torch.Tensor, trial: Trial, shape: tuple[int, ...], how: str) -> torch.Tensor:
    """``[B, H, Sq, Sk]`` -> a ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` shape, by ``how`` ("sum" or "any") over
    each broadcast dimension; a head dimension of Hkv takes the heads of each group."""
    b, h, sq, sk = t.shape
    if shape[1] == trial.kv_heads != h:
        t = getattr(t.reshape(b, trial.kv_heads, h // trial.kv_heads, sq, sk), how)(2)
    for dim, size in enumerate(shape):
        if size == 1 and t.shape[dim] > 1:
            t = getattr(t, how)(dim, keepdim=True)
    return t


def _output_rounding(trial: Trial, inputs: dict, block_mask, dout, out, oracle_out) -> torch.Tensor:
    """The bias gradient's part of the error that the kernels make by design, in the bias's shape.

    Like FlashAttention, the backward computes ``delta = rowsum(dO * O)`` from the output rounded to
    the input dtype, so each dS = P * (dP - delta) is off by ``-P * rowsum(dO * (O - O_exact))``. A bias
    gradient summed over many rows and heads gathers this, and can exceed twice PyTorch's own error
    in that dtype on small problems. P comes from the float64 reference with one-hot values (q and k
    padded with zeros when there are more keys than head dims, which leaves the scores as they are).
    """
    b, sk, hkv, d = trial.batch, trial.seqlen_k, trial.kv_heads, trial.head_dim
    width = max(d, sk)
    q, k = (torch.nn.functional.pad(inputs[name].detach().double(), (0, width - d)) for name in ("query", "key"))
    one_hot = torch.eye(sk, width, dtype=torch.float64, device=q.device)[None, :, None, :].expand(b, sk, hkv, width)
    bias = inputs["attn_bias"].detach().double()
    window = (trial.window[0], 0) if trial.causal else trial.window
    probs, _ = reference_attention(
        q, k, one_hot, inputs["attn_mask"], bias, softmax_scale=trial.softmax_scale or d**-0.5, window=window,
        softcap=trial.softcap, block_mask=block_mask, compute_dtype=torch.float64,
    )
    probs = probs[..., :sk]  # [B, Sq, H, Sk]
    delta_error = (dout.double() * (out.double() - oracle_out)).sum(-1)  # [B, Sq, H]
    return _reduce(-(probs * delta_error[..., None]).transpose(1, 2), trial, bias.shape, "sum")


def _exact_zeros(name: str, t: torch.Tensor, where: torch.Tensor, problems: list[str]) -> None:
    wrong = int((t[where] != 0).sum())
    if wrong:
        problems.append(f"{name}: {wrong} of {int(where.sum())} elements that must be exactly 0 are not")


def _check_results(results: list, inputs: dict, grads: dict, out, dtype, problems: list[str]) -> None:
    """Each ``(name, actual, oracle, baseline, floor)`` by the suite's tolerance rule; the output's dtype
    and every gradient's dtype and shape."""
    for name, actual, oracle, baseline, floor in results:
        try:
            assert_close(name, actual, oracle, baseline, floor)
        except AssertionError as error:
            problems.append(str(error))
    if out.dtype != dtype:
        problems.append(f"out: dtype {out.dtype}, expected {dtype}")
    for name, grad in grads.items():
        if grad.dtype != inputs[name].dtype or grad.shape != inputs[name].shape:
            expected = f"{inputs[name].dtype} {tuple(inputs[name].shape)}"
            problems.append(f"{name} gradient: {grad.dtype} {tuple(grad.shape)}, expected {expected}")


def _check_empty_rows(empty, lse, out, grads: dict, problems: list[str]) -> None:
    """Rows with no visible key (``empty`` ``[B, H, Sq]``): lse = -inf, out = 0 and dQ = 0."""
    if not bool((lse[empty] == float("-inf")).all()):
        problems.append("lse: rows with no visible key must be -inf")
    _exact_zeros("out (rows with no visible key)", out.transpose(1, 2), empty, problems)
    if "query" in grads:
        _exact_zeros("query gradient (rows with no visible key)", grads["query"].transpose(1, 2), empty, problems)


def _compare(trial: Trial, inputs: dict, block_mask, dout, out, lse, grads: dict, outcome: Outcome) -> None:
    """Every result against the float64 reference (the suite's tolerance rule), then the exact properties."""
    problems = outcome.problems
    dtype = TORCH_DTYPES[trial.dtype]
    case = _case(trial)
    kwargs = {"softmax_scale": trial.softmax_scale, "block_mask": block_mask}
    if dtype == FP8_DTYPE:
        # The values the inputs stand for; the baseline models the Hopper forward's FP8 tensor-core products.
        inputs = _dequantized(inputs)
        oracle_out, oracle_lse, oracle_grads = reference_outputs(case, inputs, None, torch.float64, **kwargs)
        baseline_out, baseline_lse, baseline_grads = reference_outputs(case, inputs, None, torch.float32, fp8_tensor_cores=True, **kwargs)
        baseline_out = baseline_out.to(FP8_OUT_DTYPE)
    else:
        oracle_out, oracle_lse, oracle_grads = reference_outputs(case, inputs, dout, torch.float64, **kwargs)
        baseline_out, baseline_lse, baseline_grads = reference_outputs(case, inputs, dout, dtype, **kwargs)
    # Gradients may also be off by their dtype's rounding unit at their magnitude, as FlashAttention's
    # tests allow (dq_atol = 2 * (dq_ref + 0.3 - 0.3 - dq_ref).abs().max()).
    grad_floor = max(1e-5, torch.finfo(dtype).eps)
    results = [("out", out, oracle_out, baseline_out, 1e-5), ("lse", lse, oracle_lse, baseline_lse, 1e-5)]
    for name, grad in grads.items():
        # A bias broadcast over the keys gets exact zeros, from no kernel: nothing to clear then.
        if name == "attn_bias" and grad.shape == inputs[name].shape and grad.shape[3] > 1:
            grad = grad.double() - _output_rounding(trial, inputs, block_mask, dout, out, oracle_out)
        results.append((name, grad, oracle_grads[name], baseline_grads[name], grad_floor))
    _check_results(results, inputs, grads, out, output_dtype(dtype), problems)
    outcome.empty_rows = bool((oracle_lse == float("-inf")).any())
    shapes = [(out, oracle_out), (lse, oracle_lse), *((g, inputs[n]) for n, g in grads.items())]
    if all(actual.shape == expected.shape for actual, expected in shapes):
        _check_exact_zeros(trial, inputs, block_mask, out, lse, oracle_lse, grads, problems)


def _check_exact_zeros(trial: Trial, inputs: dict, block_mask, out, lse, oracle_lse, grads: dict, problems: list) -> None:
    """Rows with no visible key: lse = -inf, out = 0 and dQ = 0; unattended bias positions and keys: zero gradients."""
    empty = oracle_lse == float("-inf")  # [B, H, Sq]
    if empty.any():
        _check_empty_rows(empty, lse, out, grads, problems)
    attended = _attended(trial, inputs, block_mask)
    if "attn_bias" in grads:
        unseen = ~_reduce(attended, trial, grads["attn_bias"].shape, "any")
        _exact_zeros("attn_bias gradient (unattended)", grads["attn_bias"], unseen, problems)
    if "key" in grads:
        # [B, Hkv, 1, Sk] -> [B, Sk, Hkv]: keys that no query of the group attends.
        unseen = ~_reduce(attended, trial, (trial.batch, trial.kv_heads, 1, trial.seqlen_k), "any")[:, :, 0].transpose(1, 2)
        _exact_zeros("key gradient (unattended keys)", grads["key"], unseen, problems)
        _exact_zeros("value gradient (unattended keys)", grads["value"], unseen, problems)


def _window(trial: Trial) -> tuple[int, int]:
    return (trial.window[0], 0) if trial.causal else trial.window


def _to_bias_shape(pairs: torch.Tensor, trial: Trial, indices: torch.Tensor, shape: tuple[int, ...], how: str) -> torch.Tensor:
    """``[B, Sq, H, W]`` per listed pair -> a top-k bias's shape, by ``how`` ("sum" or "any"): per pair
    ``[1|B, Sq, 1|Hkv|H, W]`` over its broadcast dimensions, per key ``[1|B, 1|Hkv|H, Sk]`` over the
    entries that list each key as well."""
    b, sq, h, w = pairs.shape
    group = h // trial.kv_heads
    if len(shape) == 3:  # per key: add each entry into its key's column (column Sk takes the rest)
        keys = torch.where(valid_indices(indices, 0, sq, trial.seqlen_k, _window(trial)), indices, trial.seqlen_k).long()
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2).reshape(b, h, sq * w)
        columns = torch.zeros(b, h, trial.seqlen_k + 1, dtype=torch.float64, device=pairs.device)
        pairs = columns.scatter_add_(2, keys, pairs.double().transpose(1, 2).reshape(b, h, sq * w))[..., :-1]
        pairs = pairs != 0 if how == "any" else pairs
        head_dim = 1
    else:
        head_dim = 2
    if shape[head_dim] == trial.kv_heads != h:
        grouped = pairs.unflatten(head_dim, (trial.kv_heads, group))
        pairs = getattr(grouped, how)(head_dim + 1)
    for dim, size in enumerate(shape):
        if size == 1 and pairs.shape[dim] > 1:
            pairs = getattr(pairs, how)(dim, keepdim=True)
    return pairs


def _pair_bias(trial: Trial, inputs: dict) -> torch.Tensor:
    """The bias of each listed pair ``[B, Sq, H, W]`` float64 (0 without a bias; any value at entries that do not count)."""
    indices, bias = inputs["indices"], inputs["attn_bias"]
    b, sq, h, w = trial.batch, trial.seqlen_q, trial.heads, trial.width
    if bias is None:
        return torch.zeros(b, sq, h, w, dtype=torch.float64, device=indices.device)
    bias = bias.detach().double()
    if bias.dim() == 4:
        return bias.repeat_interleave(h // bias.shape[2], dim=2).expand(b, sq, h, w)
    keys = indices.clamp(0, max(trial.seqlen_k - 1, 0)).long().repeat_interleave(h // trial.kv_heads, dim=2)  # [B, Sq, H, W]
    table = bias.repeat_interleave(h // bias.shape[1], dim=1).expand(b, h, trial.seqlen_k)  # [B, H, Sk]
    return table.gather(2, keys.transpose(1, 2).reshape(b, h, sq * w)).reshape(b, h, sq, w).transpose(1, 2)


def _topk_output_rounding(trial: Trial, inputs: dict, dout, out, oracle_out) -> torch.Tensor:
    """``_output_rounding`` of a top-k call: ``-P * rowsum(dO * (O - O_exact))`` per listed pair, with P the
    float64 gradient of the LSE by a per-pair bias, in the bias's shape."""
    pair = _pair_bias(trial, inputs).requires_grad_()
    _, lse = reference_topk_attention(
        *(inputs[name].detach().double() for name in ("query", "key", "value")), inputs["indices"], pair,
        softmax_scale=trial.softmax_scale, window=_window(trial), softcap=trial.softcap, compute_dtype=torch.float64,
    )
    delta_error = (dout.double() * (out.double() - oracle_out)).sum(-1)  # [B, Sq, H]
    (probs,) = torch.autograd.grad((lse.transpose(1, 2).nan_to_num(neginf=0.0) * delta_error).sum(), pair)
    return _to_bias_shape(-probs, trial, inputs["indices"], tuple(inputs["attn_bias"].shape), "sum")


def _compare_topk(trial: Trial, inputs: dict, dout, out, lse, grads: dict, outcome: Outcome) -> None:
    """``_compare`` for the indices walk: the float64 reference, then rows with no counting entry
    (out 0, lse -inf, dQ 0), keys no pair attends (dK, dV 0) and bias entries of no attended pair (0)."""
    problems = outcome.problems
    dtype = TORCH_DTYPES[trial.dtype]
    kwargs = {"softmax_scale": trial.softmax_scale, "softcap": trial.softcap}
    oracle_out, oracle_lse, oracle_grads = topk_reference_outputs(inputs, dout, torch.float64, _window(trial), **kwargs)
    baseline_out, baseline_lse, baseline_grads = topk_reference_outputs(inputs, dout, dtype, _window(trial), **kwargs)
    grad_floor = max(1e-5, torch.finfo(dtype).eps)
    results = [("out", out, oracle_out, baseline_out, 1e-5), ("lse", lse, oracle_lse, baseline_lse, 1e-5)]
    for name, grad in grads.items():
        if name == "attn_bias" and grad.shape == inputs[name].shape:
            grad = grad.double() - _topk_output_rounding(trial, inputs, dout, out, oracle_out)
        results.append((name, grad, oracle_grads[name], baseline_grads[name], grad_floor))
    _check_results(results, inputs, grads, out, dtype, problems)
    empty = oracle_lse == float("-inf")  # [B, H, Sq]
    outcome.empty_rows = bool(empty.any())
    if problems:
        return
    if empty.any():
        _check_empty_rows(empty, lse, out, grads, problems)
    group = trial.heads // trial.kv_heads
    counted = valid_indices(inputs["indices"], 0, trial.seqlen_q, trial.seqlen_k, _window(trial)).repeat_interleave(group, dim=2)
    attended = counted & (_pair_bias(trial, inputs) != float("-inf"))  # [B, Sq, H, W]
    if "attn_bias" in grads:
        unseen = ~_to_bias_shape(attended, trial, inputs["indices"], tuple(grads["attn_bias"].shape), "any")
        _exact_zeros("attn_bias gradient (unattended)", grads["attn_bias"], unseen, problems)
    if "key" in grads:
        unseen = ~_to_bias_shape(attended, trial, inputs["indices"], (trial.batch, trial.kv_heads, trial.seqlen_k), "any")
        _exact_zeros("key gradient (unattended keys)", grads["key"], unseen.transpose(1, 2), problems)
        _exact_zeros("value gradient (unattended keys)", grads["value"], unseen.transpose(1, 2), problems)


def _snapshot(inputs: dict, block_mask) -> dict:
    tensors = {}
    for name, t in inputs.items():
        if isinstance(t, KeyIntervals):
            tensors.update({f"{name}.end": t.end, **({} if t.start is None else {f"{name}.start": t.start})})
        elif t is not None:
            tensors[name] = t.words if isinstance(t, BitMask) else t
    if block_mask is not None:
        tensors.update(state=block_mask.state, kv_lists=block_mask.kv_lists, q_lists=block_mask.q_lists)
    return {name: t.detach().clone() for name, t in tensors.items()}


def run_trial(trial: Trial, device) -> Outcome:
    """Run ``trial`` on the Triton backend on ``device`` and check it; exceptions become a crash outcome."""
    outcome = Outcome()
    start = time.perf_counter()
    stage = "inputs"
    try:
        # Poisoned from here on: block summaries built on the GPU included.
        with _poisoned_outputs(), forced_query_chunks(trial.query_chunks if trial.query_chunks > 1 else None, trial.counted), _forced_union_share(trial.union_share):
            inputs, block_mask, dout = make_inputs(trial, device)
            before = _snapshot(inputs, block_mask) if trial.check_inputs else None
            leaves = [name for name in _GRADIENTS if inputs[name] is not None and inputs[name].requires_grad]
            tensors = [inputs[name] for name in leaves]
            stage = "forward"
            if trial.walk == INDICES:
                out, lse = flash_dma.flash_dma_topk_func(
                    **inputs, softmax_scale=trial.softmax_scale, is_causal=trial.causal, window_size=trial.window,
                    softcap=trial.softcap, deterministic=trial.deterministic, return_lse=True, backend="triton",
                )
            else:
                out, lse = triton_call(
                    _case(trial), inputs, softmax_scale=trial.softmax_scale, block_mask=block_mask,
                    deterministic=trial.deterministic, return_lse=True,
                )
            stage = "backward"
            grads, again = {}, ()
            if leaves:  # none for FP8 inputs
                grads = dict(zip(leaves, torch.autograd.grad(out, tensors, dout, retain_graph=trial.repeat_backward)))
                again = torch.autograd.grad(out, tensors, dout) if trial.repeat_backward else ()
        stage = "compare"
        # dQ never uses atomics; dK, dV and the bias gradient may, unless deterministic. The top-k
        # backward over a block's union of keys walks them in the order its build's atomics landed.
        union_order = trial.walk == INDICES and trial.union_share != -1.0
        for name, grad in zip(leaves, again):
            if ((name == "query" and not union_order) or trial.deterministic) and not torch.equal(grad, grads[name]):
                outcome.problems.append(f"{name} gradient: a second backward gave different bits")
        if trial.walk == INDICES:
            _compare_topk(trial, inputs, dout, out.detach(), lse, grads, outcome)
        else:
            _compare(trial, inputs, block_mask, dout, out.detach(), lse, grads, outcome)
        if before is not None:
            after = _snapshot(inputs, block_mask)
            changed = [name for name in before if not torch.equal(before[name], after[name])]
            outcome.problems += [f"{name}: input modified by the call" for name in changed]
    except Exception as error:  # noqa: BLE001 - a crash of any kind is a finding; the run goes on
        outcome.status, outcome.stage = "crash", stage
        message = str(error).strip()
        outcome.problems.append(f"{type(error).__name__} in {stage}: {message.splitlines()[0] if message else ''}")
        outcome.problems.append("".join(traceback.format_exception(error)[-3:]).strip()[-_TRACEBACK_CHARS:])
    else:
        outcome.status = "mismatch" if outcome.problems else "ok"
    outcome.seconds = time.perf_counter() - start
    return outcome
