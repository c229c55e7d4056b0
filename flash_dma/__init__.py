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

import re
from importlib import metadata
from pathlib import Path

from flash_dma.backends import get_available_backends
from flash_dma.bit_mask import BitMask
from flash_dma.block_mask import BlockMask
from flash_dma.interface import (
    flash_dma_func,
    flash_dma_func_auto,
    flash_dma_topk_func,
    flash_dma_varlen_func,
    flash_dma_with_kvcache,
    flash_dmattn_func,
    flash_sparse_attn_func,
)
from flash_dma.key_intervals import KeyIntervals
from flash_dma.masks import (
    attended_fraction,
    causal_topk_intervals,
    chunked_topk_indices,
    create_mask,
    indices_to_mask,
    interval_mask,
    topk_block_mask,
    topk_indices,
    topk_mask,
)
from flash_dma.modules import DynamicMaskAttention
from flash_dma.summaries import block_mask_from_state, build_block_mask, pack_mask


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

__all__ = [
    "BitMask",
    "BlockMask",
    "DynamicMaskAttention",
    "KeyIntervals",
    "attended_fraction",
    "block_mask_from_state",
    "build_block_mask",
    "causal_topk_intervals",
    "chunked_topk_indices",
    "create_mask",
    "flash_dma_func",
    "flash_dma_func_auto",
    "flash_dma_topk_func",
    "flash_dma_varlen_func",
    "flash_dma_with_kvcache",
    "flash_dmattn_func",
    "flash_sparse_attn_func",
    "get_available_backends",
    "indices_to_mask",
    "interval_mask",
    "pack_mask",
    "topk_block_mask",
    "topk_indices",
    "topk_mask",
]
