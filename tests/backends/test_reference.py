"""The reference backend against an independent, dense float64 formulation of the contract."""

import subprocess
import sys

import pytest
import torch

from flash_dma.backends.reference import reference_attention
from tests.helpers import DEVICE, Case, assert_close, broadcast_cases, make_inputs


def dense_attention(q, k, v, mask, bias, scale, window, softcap):
    """The contract written out densely: every [B, H, Sq, Sk] tensor is materialised."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, group = k.shape[1], heads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)

    def per_head(t):  # [b, 1|Hkv|H, ., .] -> [b, 1|H, ., .]
        return t if t.shape[1] in (1, heads) else t.repeat_interleave(heads // t.shape[1], dim=1)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + per_head(bias)
    i = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    allowed = allowed.expand(batch, heads, seqlen_q, seqlen_k)
    if mask is not None:
        allowed = allowed & per_head(mask.bool())
    empty = ~allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    probs = torch.softmax(scores, dim=-1) * ~empty
    lse = torch.logsumexp(scores, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def _cases():
    cases = broadcast_cases(Case(seqlen_q=17, seqlen_k=63))
    cases += broadcast_cases(Case(seqlen_q=130, seqlen_k=17, heads=3, kv_heads=1, causal=True, mask_kind="rows"))
    cases += [
        Case(seqlen_q=1, seqlen_k=130, mask="B,Hkv,1,Sk", bias="B,H,Sq,Sk", causal=True),
        Case(seqlen_q=63, seqlen_k=63, heads=4, kv_heads=4, mask="B,H,Sq,Sk", mask_kind="rows"),
        Case(seqlen_q=63, seqlen_k=130, bias="1,H,1,Sk", window=(7, 3)),
        Case(seqlen_q=130, seqlen_k=63, mask="B,Hkv,1,Sk", window=(20, -1), causal=True),
        Case(seqlen_q=17, seqlen_k=130, bias="B,Hkv,Sq,Sk", softcap=5.0, causal=True),
        Case(seqlen_q=17, seqlen_k=17, head_dim=40, mask="B,H,Sq,Sk", bias="B,H,Sq,Sk", softcap=2.0, window=(0, 0)),
    ]
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_reference_matches_dense_formulation(case):
    inputs = make_inputs(case, torch.float64, requires_grad=True)
    window = (case.window[0], 0) if case.causal else case.window
    names = [n for n in ("query", "key", "value", "attn_bias") if inputs[n] is not None]
    # Small chunks, so that chunking is exercised as well.
    out, lse = reference_attention(
        **inputs, window=window, softcap=case.softcap, compute_dtype=torch.float64, chunk_size=7
    )
    expected_out, expected_lse = dense_attention(
        *(inputs[n] for n in ("query", "key", "value", "attn_mask", "attn_bias")),
        case.head_dim**-0.5, window, case.softcap,
    )
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [inputs[n] for n in names], dout)
    expected_grads = torch.autograd.grad(expected_out, [inputs[n] for n in names], dout)
    for name, actual, expected in [("out", out, expected_out), ("lse", lse, expected_lse), *zip(names, grads, expected_grads)]:
        assert_close(name, actual, expected, expected, floor=1e-10 if actual.dtype == torch.float64 else 1e-6)


def test_rows_with_no_visible_key_give_zero_output_and_gradients():
    # Causal with Sq > Sk leaves the first Sq - Sk query rows with no key at all.
    case = Case(seqlen_q=20, seqlen_k=5, bias="B,H,Sq,Sk", causal=True)
    inputs = make_inputs(case, torch.float32, requires_grad=True)
    out, lse = reference_attention(**inputs, window=(-1, 0))
    out.sum().backward()
    assert torch.equal(out[:, :15], torch.zeros_like(out[:, :15]))
    assert torch.isneginf(lse[:, :, :15]).all() and lse[:, :, 15:].isfinite().all()
    for name in ("query", "attn_bias"):
        grad = inputs[name].grad
        assert grad.isfinite().all(), name
    assert torch.equal(inputs["query"].grad[:, :15], torch.zeros_like(inputs["query"].grad[:, :15]))
    assert torch.equal(inputs["attn_bias"].grad[:, :, :15], torch.zeros_like(inputs["attn_bias"].grad[:, :, :15]))


def test_window_larger_than_the_keys_is_unbounded():
    case = Case(seqlen_q=9, seqlen_k=7, mask="B,H,Sq,Sk")
    inputs = make_inputs(case, torch.float32)
    wide, _ = reference_attention(**inputs, window=(1000, 1000))
    unbounded, _ = reference_attention(**inputs, window=(-1, -1))
    assert torch.equal(wide, unbounded)


_LONG_CAUSAL = """
import resource, torch
from flash_dma.backends.reference import reference_attention
torch.manual_seed(0)
q, k, v = (torch.randn(1, 16384, 1, 16) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    out, lse = reference_attention(q, k, v, window=(-1, 0))
assert out.isfinite().all() and lse.isfinite().all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU memory check")
def test_16k_causal_runs_on_the_cpu_in_bounded_memory():
    # Dense scores would take 16384^2 * 4 bytes = 1 GiB; chunks take 64 MiB each.
    result = subprocess.run([sys.executable, "-c", _LONG_CAUSAL], capture_output=True, text=True, check=True)
    grown_mib = int(result.stdout.strip())
    assert grown_mib < 512, f"peak memory grew by {grown_mib} MiB"
