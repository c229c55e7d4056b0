"""The block summary of a mask: which tiles of the attention matrix hold any work.

A :class:`BlockMask` cuts the ``[Sq, Sk]`` plane of each (batch, mask-head) into blocks of
``block_size = (block_q, block_k)`` and records, per block, whether its mask is all false
(EMPTY, skipped outright), all true (FULL, computed without reading the mask) or mixed
(PARTIAL, computed with the element-wise mask). The kernels never look at the dense state:
they walk sorted lists of the non-empty blocks, so an empty block costs no load, no math
and no loop iteration.

An axis that the mask broadcasts (size 1) is a single block spanning the whole axis, so the
usual per-key mask ``[B, Hkv, 1, Sk]`` has one row of ``Sk / block_k`` blocks.

Causal and window limits are not part of the summary: kernels apply them analytically, so one
summary serves causal and non-causal calls, every layer, and the forward and backward passes.

This module holds the type and its plain-torch construction; ``flash_dma/summaries.py`` builds
summaries (on CUDA through the Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dma.integers import cdiv

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK_SIZE = (128, 128)
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128, 256)
# Elements of the mask converted at a time while summarising; bounds the temporary memory.
_SUMMARY_CHUNK_ELEMENTS = 1 << 26


def block_lists(state: torch.Tensor) -> torch.Tensor:
    """``[..., R, C]`` block states -> ``[..., R, 2, 2, C + 1]`` int32 lists.

    Per row, ``[0]`` describes the PARTIAL blocks and ``[1]`` the FULL ones, each as two arrays:
    ``[.., 0, :]`` the listed column indices in ascending order (then zeros), and ``[.., 1, :]``
    their rank: ``rank[c]`` is the number of listed columns before column ``c``, so ``rank[C]``
    is the count. With the rank a kernel finds where any column range starts in the list with
    one load, so causal and window limits cost no search.
    """
    columns = state.shape[-1]
    codes = torch.arange(PARTIAL, FULL + 1, dtype=state.dtype, device=state.device)  # no host-to-device copy
    hit = state.unsqueeze(-2) == codes[:, None]  # [..., R, 2, C]
    rank = torch.nn.functional.pad(hit.cumsum(-1, dtype=torch.int32), (1, 0))
    # Each listed column goes to position rank[c]; the others to a spare slot C, cut off after.
    slot = torch.where(hit, rank[..., :-1], columns).long()
    index = torch.zeros(*hit.shape[:-1], columns + 1, dtype=torch.int32, device=state.device)
    index.scatter_(-1, slot, torch.arange(columns, dtype=torch.int32, device=state.device).expand_as(slot))
    index[..., columns] = 0
    return torch.stack([index, rank], dim=-2).contiguous()


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Reusable block summary of a ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` mask.

    Build it with :func:`flash_dma.build_block_mask` (from an element-wise mask),
    :func:`flash_dma.masks.topk_block_mask` (directly from a bias) or
    :func:`flash_dma.block_mask_from_state` (from block states), then pass it as
    ``flash_dma_func(..., block_mask=...)`` to every layer that shares the mask.

    Attributes:
        state: ``[Bm, Hm, NQB, NKB]`` int8, EMPTY (0), PARTIAL (1) or FULL (2) per block.
        kv_lists: ``[Bm, Hm, NQB, 2, 2, NKB + 1]`` int32, per query block the partial and full
            key blocks (see ``block_lists``); walked by the forward and dQ kernels.
        q_lists: ``[Bm, Hm, NKB, 2, 2, NQB + 1]`` int32, the transpose; walked by the dK/dV kernel.
        mask_shape: ``(Bm, Hm, Sqm, Skm)``, the shape of the mask it summarises.
        block_size: ``(block_q, block_k)``. A broadcast axis (size 1) is one block.
        needs_mask: whether PARTIAL blocks may occur, so that the element-wise mask must be
            passed along with the summary.
    """

    state: torch.Tensor
    kv_lists: torch.Tensor
    q_lists: torch.Tensor
    mask_shape: tuple[int, int, int, int]
    block_size: tuple[int, int]
    needs_mask: bool

    @property
    def device(self) -> torch.device:
        return self.state.device

    def density(self) -> float:
        """Fraction of blocks that are not empty (causal/window limits not counted)."""
        return float((self.state != EMPTY).float().mean())

    def dense_rows(self, start: int, stop: int, seqlen_k: int) -> torch.Tensor:
        """Block states expanded to elements for query rows ``[start, stop)``: ``[Bm, Hm, rows, Sk]`` int8."""
        block_q, block_k = self.block_size
        rows = torch.arange(start, stop, device=self.device)
        cols = torch.arange(seqlen_k, device=self.device)
        rows = torch.zeros_like(rows) if self.state.shape[2] == 1 else rows // block_q
        cols = torch.zeros_like(cols) if self.state.shape[3] == 1 else cols // block_k
        return self.state[:, :, rows][:, :, :, cols]

    def __repr__(self) -> str:
        return (
            f"BlockMask(mask_shape={self.mask_shape}, block_size={self.block_size}, "
            f"blocks={tuple(self.state.shape)}, needs_mask={self.needs_mask})"
        )


def _match_heads(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Make two ``[., 1|Hkv|H, ., .]`` tensors broadcast over heads: Hkv heads are repeated to H."""
    ha, hb = a.shape[1], b.shape[1]
    if ha == hb or 1 in (ha, hb):
        return a, b
    if ha < hb:
        return a.repeat_interleave(hb // ha, dim=1), b
    return a, b.repeat_interleave(ha // hb, dim=1)


def effective_mask_rows(attn_mask, block_mask: "BlockMask | None", start: int, stop: int, seqlen_k: int) -> torch.Tensor | None:
    """What the kernels attend for query rows ``[start, stop)``, before causal/window limits.

    ``attn_mask`` is a bool or 0/1 tensor, a :class:`~flash_dma.bit_mask.BitMask` (whose own
    summary then applies), or None. Returns bool ``[1|B, 1|Hkv|H, rows or 1, Sk]``, or None when
    there is no mask at all. With a summary, FULL blocks attend everywhere, EMPTY blocks nowhere,
    and PARTIAL blocks follow the mask.
    """
    mask = None
    if isinstance(attn_mask, torch.Tensor):
        mask = attn_mask[:, :, start:stop] if attn_mask.shape[2] > 1 else attn_mask
        mask = mask if mask.dtype == torch.bool else mask != 0
    elif attn_mask is not None:  # a BitMask (which imports this module): its bits, through its summary
        mask, block_mask = attn_mask.rows(start, stop), attn_mask.summary
    if block_mask is None:
        return mask
    state = block_mask.dense_rows(start, stop, seqlen_k)
    if mask is None:
        return state == FULL
    mask, state = _match_heads(mask, state)
    return (state == FULL) | ((state == PARTIAL) & mask)


def check_block_size(block_size) -> None:
    if (
        not isinstance(block_size, (tuple, list))
        or len(block_size) != 2
        or any(b not in SUPPORTED_BLOCK_SIZES for b in block_size)
    ):
        raise ValueError(f"block_size: expected a pair of values from {SUPPORTED_BLOCK_SIZES}, got {block_size!r}")


def state_shape(mask_shape, block_q: int, block_k: int) -> tuple[int, int, int, int]:
    """``(Bm, Hm, NQB, NKB)``: the block states of a mask of ``mask_shape`` in blocks of
    ``block_q x block_k``, an axis of size 1 being one block."""
    nb, nh, sq, sk = mask_shape
    return nb, nh, 1 if sq == 1 else cdiv(sq, block_q), 1 if sk == 1 else cdiv(sk, block_k)


def summarize_mask(mask: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """Per-block EMPTY/PARTIAL/FULL states of a 4-D mask, reading it once in bounded chunks."""
    nb, nh, sq, sk = mask.shape
    block_q = block_q if sq > 1 else 1
    block_k = block_k if sk > 1 else 1
    nkb = cdiv(sk, block_k)
    rows_per_chunk = max(1, _SUMMARY_CHUNK_ELEMENTS // max(1, nb * nh * nkb * block_k * block_q)) * block_q
    states = []
    for r0 in range(0, sq, rows_per_chunk):
        chunk = mask[:, :, r0 : r0 + rows_per_chunk]
        # True -> +1, False -> -1, padding -> 0: a block's max is > 0 iff it holds a True, and its
        # min is >= 0 iff it holds no False, whatever padding it has.
        signs = (chunk if chunk.dtype == torch.bool else chunk != 0).to(torch.int8) * 2 - 1
        n_qb = cdiv(signs.shape[2], block_q)
        signs = torch.nn.functional.pad(signs, (0, nkb * block_k - sk, 0, n_qb * block_q - signs.shape[2]))
        blocks = signs.view(nb, nh, n_qb, block_q, nkb, block_k)
        any_true = blocks.amax(dim=(3, 5)) > 0
        no_false = blocks.amin(dim=(3, 5)) >= 0
        states.append((any_true.to(torch.int8) + no_false.to(torch.int8)))  # EMPTY 0, PARTIAL 1, FULL 2
    return torch.cat(states, dim=2) if len(states) > 1 else states[0]
