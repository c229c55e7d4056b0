"""Flash-DMA / Flash-Sparse-Attention v1's names, for v1 code that changes only its imports::

    from flash_sparse_attn import flash_sparse_attn_func_auto  # v1
    from flash_dma.v1 import flash_sparse_attn_func_auto        # flash-dma

    from flash_sparse_attn.utils.mask import create_mask        # v1
    from flash_dma.v1.utils.mask import create_mask             # flash-dma

and likewise ``flash_dmattn`` -> ``flash_dma.v1``. The package lives under ``flash_dma`` so that
it never shadows an installed v1. What behaves differently from v1 (bottom-right causal, zero
output for fully masked rows, the standard softcap, ...) is listed in ``docs/migration.md``.
"""

from __future__ import annotations

import functools

import torch

from flash_dma.backends import check_available, default_backend
from flash_dma.backends import get_available_backends as _available
from flash_dma.interface import _check_backend_name, flash_dmattn_func, flash_sparse_attn_func

# v1's backend names. Its CUDA extension's place goes to the Triton kernels, flash-dma's fastest GPU
# backend; "reference" (exact PyTorch, which v1 lacks) is what backend=None runs off CUDA.
V1_BACKENDS = {"cuda": "triton", "triton": "triton", "flex": "flex", "reference": "reference"}


def get_available_backends(device: torch.device | str | None = None) -> list[str]:
    """v1's names of the backends that can run on ``device`` (default: CUDA if present, else the CPU).

    The first is what ``backend=None`` runs there, so ``flash_sparse_attn_func_auto(names[0])`` and
    ``flash_sparse_attn_func_auto()`` agree: ``["cuda", "triton", "flex", "reference"]`` on a CUDA
    machine, ``["reference"]`` on the CPU (``["reference", "cuda", "triton"]`` under the Triton
    interpreter, which tests use).
    """
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    ours = _available(device)
    names = [name for name, backend in V1_BACKENDS.items() if backend in ours]
    default = next(name for name in names if V1_BACKENDS[name] == default_backend(device))
    return [default] + [name for name in names if name != default]


def flash_sparse_attn_func_auto(backend: str | None = None):
    """v1's ``flash_sparse_attn_func_auto`` / ``flash_dmattn_func_auto``: :func:`flash_dmattn_func`
    on a v1 backend.

    Args:
        backend: ``"cuda"`` (the Triton kernels, flash-dma's fastest GPU backend), ``"triton"``,
            ``"flex"`` (PyTorch's FlexAttention), ``"reference"`` (exact PyTorch, everywhere), or
            None: the best backend for each call's device (unlike v1, which raises on a machine
            without its CUDA extension). An unavailable backend is reported by the name given here.

    Returns:
        A function taking v1's arguments ``(query, key, value, attn_mask=None, attn_bias=None,
        softmax_scale=None, is_causal=None, softcap=None, deterministic=None,
        return_attn_probs=None)``, in that order, with the shapes of :func:`flash_dma.flash_dma_func`.
    """
    _check_backend_name(backend, tuple(V1_BACKENDS))
    if backend is None:
        return functools.partial(flash_dmattn_func, backend=None)
    ours = V1_BACKENDS[backend]

    @functools.wraps(flash_dmattn_func)
    def attention(*args, **kwargs):
        query = kwargs["query"] if "query" in kwargs else args[0] if args else None
        if isinstance(query, torch.Tensor):  # otherwise flash_dmattn_func names what is wrong with it
            check_available(ours, query.device, called=backend)
        return flash_dmattn_func(*args, backend=ours, **kwargs)

    return attention


flash_dmattn_func_auto = flash_sparse_attn_func_auto


__all__ = [
    "flash_dmattn_func",
    "flash_dmattn_func_auto",
    "flash_sparse_attn_func",
    "flash_sparse_attn_func_auto",
    "get_available_backends",
]
