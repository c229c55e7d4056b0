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

import torch

from flash_dma.backends import get_available_backends as _available
from flash_dma.interface import (
    V1_BACKENDS,
    flash_dmattn_func,
    flash_dmattn_func_auto,
    flash_sparse_attn_func,
    flash_sparse_attn_func_auto,
)


def get_available_backends(device: torch.device | str | None = None) -> list[str]:
    """v1's names of the backends that can run on ``device`` (default: CUDA if present, else CPU)."""
    ours = _available(device)
    return [name for name, backend in V1_BACKENDS.items() if backend in ours]


__all__ = [
    "flash_dmattn_func",
    "flash_dmattn_func_auto",
    "flash_sparse_attn_func",
    "flash_sparse_attn_func_auto",
    "get_available_backends",
]
