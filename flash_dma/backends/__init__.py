"""Backend registry.

A backend is a module with ``attention(problem) -> (out, lse)`` for a validated
:class:`~flash_dma.inputs.AttentionProblem`; gradients flow through its autograd graph. The
Triton and reference backends also offer ``partial_forward(problem)`` and
``partial_backward(problem, dout, out, lse, bias_requires_grad)``, without autograd, for a
problem that is one part of a larger softmax (context parallelism merges such parts).

- ``"triton"``: the Triton kernels. Available on CUDA devices, and on the CPU under the
  Triton interpreter (``TRITON_INTERPRET=1``, for tests).
- ``"flex"``: PyTorch's FlexAttention (``flex.py``), compiled on CUDA, eager on the CPU. It
  raises where Flex cannot meet the contract (packed sequences, KV caches, determinism).
- ``"reference"``: exact, chunked PyTorch. Available everywhere; the default off CUDA.
"""

from __future__ import annotations

import torch

from flash_dma.backends import flex, reference
from flash_dma.backends import triton as triton_backend
from flash_dma.backends.triton.configs import triton_interpreting

# Modules, not names to import per call: torch.compile traces straight through the lookup.
_MODULES = {"triton": triton_backend, "flex": flex, "reference": reference}
BACKENDS = tuple(_MODULES)


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why ``name`` cannot run on ``device`` in this process, or None if it can."""
    if name == "triton":
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "CUDA is not available"
        if device.type == "cpu" and triton_interpreting():
            return None
        return f"it needs a CUDA device (got {device.type}; on the CPU it runs only under TRITON_INTERPRET=1)"
    if name == "flex":
        return flex.unavailable_reason(device)
    return None


def get_available_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of the backends that can run on ``device`` (default: CUDA if present, else CPU), best first."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return [name for name in BACKENDS if unavailable_reason(name, device) is None]


def default_backend(device: torch.device) -> str:
    """What ``backend=None`` runs on ``device``: the Triton kernels on CUDA, the reference elsewhere."""
    return "triton" if device.type == "cuda" and unavailable_reason("triton", device) is None else "reference"


def check_available(name: str, device: torch.device, called: str | None = None) -> None:
    """A ValueError saying why ``name`` cannot run on ``device``, naming it as the caller did
    (``called``: v1's "cuda" for "triton"); nothing if it can run."""
    reason = unavailable_reason(name, device)
    if reason is not None:
        label = repr(name) if called in (None, name) else f"{called!r} (flash-dma's {name!r})"
        raise ValueError(f"backend: {label} is unavailable for tensors on {device}: {reason}")


def resolve_backend(name: str | None, device: torch.device):
    """The backend module for ``name`` (None: the best for ``device``), or a ValueError saying why not."""
    if name is None:
        name = default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))} or None, got {name!r}")
    check_available(name, device)
    return _MODULES[name]
