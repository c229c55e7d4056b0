"""v1's published Quick Start and gradient example, run with nothing changed but the import lines."""

import re

import pytest
import torch

from flash_dma import flash_dma_func, get_available_backends
from tests.helpers import ON_GPU, Case, make_inputs

# Flash-Sparse-Attention v1's README: "Basic Usage" then "Gradient Computation Example", as published.
V1_QUICK_START = """
import torch
from flash_sparse_attn import flash_sparse_attn_func_auto
from flash_sparse_attn.utils.mask import create_mask
import math

# Setup
batch_size, seq_len, num_heads, num_kv_heads, head_dim = 1, 256, 2, 1, 64
window_size = 128
device = torch.device('cuda')
dtype = torch.bfloat16
min_dtype = torch.finfo(dtype).min  # dtype minimum value

# Input tensors
query = torch.randn(batch_size, seq_len, num_heads, head_dim, device=device, dtype=dtype)
key = torch.randn(batch_size, seq_len, num_kv_heads, head_dim, device=device, dtype=dtype)
value = torch.randn(batch_size, seq_len, num_kv_heads, head_dim, device=device, dtype=dtype)

# Create bias for sparse attention
attn_bias = torch.randn(batch_size, num_kv_heads, 1, seq_len, device=device, dtype=dtype)

# Generate dynamic mask based on bias
if seq_len > window_size:
    attn_mask = create_mask(
        attention_bias=attn_bias,
        attention_mask=None,
        batch_size=batch_size,
        query_len=seq_len,
        key_len=seq_len,
        window_size=window_size,
        min_dtype=min_dtype,
    )

# Select FSA kernel
flash_sparse_attn_func = flash_sparse_attn_func_auto(backend="cuda")

# Run Flash-Sparse-Attention
output = flash_sparse_attn_func(
    query=query,
    key=key,
    value=value,
    attn_mask=attn_mask,
    attn_bias=attn_bias,
    is_causal=True,
    softmax_scale=1.0/math.sqrt(head_dim),
)

print(f"Output shape: {output.shape}")  # [1, 256, 2, 64]

# Enable gradient computation
query.requires_grad_(True)
key.requires_grad_(True)
value.requires_grad_(True)
attn_bias.requires_grad_(True)

# Forward pass
output = flash_sparse_attn_func(
    query=query, key=key, value=value,
    attn_mask=attn_mask,
    attn_bias=attn_bias,
    is_causal=True,
    softmax_scale=1.0/math.sqrt(head_dim)
)

# Backward pass
loss = output.sum()
loss.backward()

print(f"Query gradient shape: {query.grad.shape}")
print(f"Key gradient shape: {key.grad.shape}")
print(f"Value gradient shape: {value.grad.shape}")
print(f"Bias gradient shape: {attn_bias.grad.shape}")
"""

# The whole migration: v1's packages -> flash_dma.v1.
IMPORT_CHANGE = (r"\bflash_sparse_attn(?=[ .])", "flash_dma.v1")


def _migrated(source: str, backend: str) -> str:
    migrated = re.sub(*IMPORT_CHANGE, source)
    changed = [(a, b) for a, b in zip(source.splitlines(), migrated.splitlines()) if a != b]
    assert changed and all(a.startswith("from ") for a, _ in changed), changed
    migrated = migrated.replace('backend="cuda"', f'backend="{backend}"')
    if not ON_GPU:
        # The CPU runs the Triton kernels under the interpreter, which has no bfloat16.
        migrated = migrated.replace("torch.device('cuda')", "torch.device('cpu')").replace("bfloat16", "float32")
    return migrated


V1_BACKENDS = ["cuda", "triton", "flex"] if ON_GPU else ["cuda"]


@pytest.mark.parametrize("backend", V1_BACKENDS)
def test_v1_quick_start_runs_after_the_import_change(backend, capsys):
    namespace = {}
    exec(compile(_migrated(V1_QUICK_START, backend), "v1_quick_start", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "Output shape: torch.Size([1, 256, 2, 64])" in printed
    assert "Bias gradient shape: torch.Size([1, 1, 1, 256])" in printed
    q, k, v, mask, bias = (namespace[n] for n in ("query", "key", "value", "attn_mask", "attn_bias"))
    assert mask.shape == (1, 1, 1, 256) and int(mask.sum()) == 128
    expected = flash_dma_func(
        q.detach(), k.detach(), v.detach(), mask, bias.detach(), is_causal=True, backend="reference"
    )
    tolerance = 2e-2 if ON_GPU else 1e-4
    torch.testing.assert_close(namespace["output"].detach(), expected, atol=tolerance, rtol=tolerance)
    for name in ("query", "key", "value", "attn_bias"):
        grad = namespace[name].grad
        assert grad.shape == namespace[name].shape and grad.isfinite().all(), name


def test_backend_names_follow_v1():
    from flash_dma import v1

    assert v1.flash_dmattn_func_auto is v1.flash_sparse_attn_func_auto
    expected = ["cuda", "triton", "flex", "reference"] if ON_GPU else ["reference", "cuda", "triton"]
    assert v1.get_available_backends() == expected  # the CPU suite runs under the Triton interpreter
    with pytest.raises(ValueError, match=r"backend: expected one of 'cuda', 'triton', 'flex', 'reference' or None, got 'tpu'"):
        v1.flash_sparse_attn_func_auto("tpu")


def test_the_first_available_backend_is_what_none_runs(monkeypatch):
    from flash_dma import backends, v1

    monkeypatch.setattr(backends, "triton_interpreting", lambda: False)  # a CPU machine as users have it
    assert v1.get_available_backends("cpu") == ["reference"]
    inputs = make_inputs(Case(mask="B,Hkv,1,Sk", bias="B,Hkv,1,Sk", causal=True), torch.float32, device="cpu")
    args = (inputs["query"], inputs["key"], inputs["value"], inputs["attn_mask"], inputs["attn_bias"])
    first = v1.flash_sparse_attn_func_auto(v1.get_available_backends("cpu")[0])
    assert torch.equal(first(*args), v1.flash_sparse_attn_func_auto()(*args))


@pytest.mark.parametrize("name, ours", [("cuda", "triton"), ("flex", "flex")])
def test_an_unavailable_backend_is_named_as_the_caller_named_it(name, ours):
    from flash_dma import v1

    # Meta tensors: a device that no backend but the reference serves, on any machine.
    q, k, v = (torch.empty(1, 8, 2, 16, device="meta") for _ in range(3))
    attention = v1.flash_sparse_attn_func_auto(name)
    label = f"'{name}'" + (f" \\(flash-dma's '{ours}'\\)" if ours != name else "")
    with pytest.raises(ValueError, match=rf"^backend: {label} is unavailable for tensors on meta: "):
        attention(query=q, key=k, value=v)
