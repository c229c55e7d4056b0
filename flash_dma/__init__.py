"""flash-dma: trainable dynamic-mask sparse attention.

Public API (see ``docs/api.md``):

- :func:`flash_dma_func`: attention with a broadcastable mask and a trainable bias.
- :func:`flash_dma_varlen_func`: the same over packed sequences of different lengths.
- :func:`flash_dma_topk_func`: top-k index attention, keys listed per query (DSA), with a trainable bias.
- :func:`flash_dma_with_kvcache`: decoding over a contiguous or paged KV cache with a per-key bias.
- :func:`build_block_mask` / :class:`BlockMask`: a reusable block summary of a mask
  (:func:`block_mask_from_state` from block states).
- :func:`pack_mask` / :class:`BitMask`: a per-query mask stored one bit per pair, with its summary.
- :func:`interval_mask` / :class:`KeyIntervals`: a mask stored as one interval of query rows per key
  (a causal top-k's form: :func:`causal_topk_intervals`), with its summary.
- :mod:`flash_dma.masks`: dynamic masks from a learned bias (:func:`create_mask`, :func:`topk_block_mask`)
  or from chosen keys (:func:`indices_to_mask`); top-k ``indices`` from an indexer's scores
  (:func:`topk_indices`, :func:`chunked_topk_indices`) and their ``BitMask`` (:func:`topk_mask`).
- :class:`DynamicMaskAttention`: the trainable dynamic-mask attention layer.
- :func:`get_available_backends`, :func:`flash_dma_func_auto`: backend selection.
- :func:`flash_dmattn_func`, :func:`flash_sparse_attn_func`: v1-compatible entry points.
"""

import importlib
import re
from importlib import metadata
from pathlib import Path

# Each public name and the module that defines it. A name's module is imported on its first use
# (PEP 562), not by ``import flash_dma``: the ``flash-dma`` command answers --help and --version
# without importing torch or the kernels.
_EXPORTS = {
    "get_available_backends": "flash_dma.backends",
    "BitMask": "flash_dma.bit_mask",
    "BlockMask": "flash_dma.block_mask",
    "KeyIntervals": "flash_dma.key_intervals",
    "flash_dma_func": "flash_dma.interface",
    "flash_dma_func_auto": "flash_dma.interface",
    "flash_dma_topk_func": "flash_dma.interface",
    "flash_dma_varlen_func": "flash_dma.interface",
    "flash_dma_with_kvcache": "flash_dma.interface",
    "flash_dmattn_func": "flash_dma.interface",
    "flash_sparse_attn_func": "flash_dma.interface",
    "attended_fraction": "flash_dma.masks",
    "causal_topk_intervals": "flash_dma.masks",
    "chunked_topk_indices": "flash_dma.masks",
    "create_mask": "flash_dma.masks",
    "indices_to_mask": "flash_dma.masks",
    "interval_mask": "flash_dma.masks",
    "topk_block_mask": "flash_dma.masks",
    "topk_indices": "flash_dma.masks",
    "topk_mask": "flash_dma.masks",
    "DynamicMaskAttention": "flash_dma.modules",
    "block_mask_from_state": "flash_dma.summaries",
    "build_block_mask": "flash_dma.summaries",
    "pack_mask": "flash_dma.summaries",
}


def __getattr__(name: str):
    """A public name, imported from its module on first use; or a submodule (``flash_dma.masks``)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups find it without this hook
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _version() -> str:
    """The version in ``pyproject.toml``, its one source (releases are tagged ``vX.Y.Z``).

    Installed: the distribution's metadata. A checkout run from ``PYTHONPATH`` without installing
    (as on the GPU machine) reads the ``pyproject.toml`` beside the package; "0+unknown" without one.
    """
    try:
        return metadata.version("flash-dma")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = pyproject.is_file() and re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.MULTILINE)
        return found.group(1) if found else "0+unknown"


__version__ = _version()

__all__ = sorted(_EXPORTS)
