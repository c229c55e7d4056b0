"""Packed (varlen) inputs: sequences of different lengths laid end to end, FlashAttention's convention.

``cu_seqlens_q`` ``[N + 1]`` holds the cumulative query lengths of N sequences (``0`` first, the
total last), ``cu_seqlens_k`` the key lengths. Sequence i owns query rows
``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``q [total_q, H, D]`` and key rows likewise of
``k``/``v [total_k, Hkv, D]``; sequences never see each other.

Masks and biases are per key, in one of two forms, both turned here into the kernels' one entry
per sequence, ``[1|N, 1|Hkv|H, 1, 1|max_seqlen_k]``:

- packed, ``[1|Hkv|H, total_k]``: one value per key (the Doge form);
- per sequence, ``[1|N, 1|Hkv|H, 1|max_seqlen_k]``: one row per sequence (or one for all), read
  up to each sequence's length.

The packed form is gathered into rows of ``max_seqlen_k`` (an ``O(N * max_seqlen_k)`` copy,
never ``O(total_q * total_k)``), differentiably, so the bias gradient comes back packed.
"""

from __future__ import annotations

import dataclasses

import torch

from flash_dma.inputs import AttentionProblem, check_int, normalize_inputs
from flash_dma.memo import CheckedValues

SEQLEN_DTYPES = (torch.int32, torch.int64)


def values_checkable(t: torch.Tensor) -> bool:
    """Whether reading values of ``t`` on the host is allowed now: never inside a CUDA graph
    capture or a torch.compile trace, where the kernels bound every access instead."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


_CHECKED = CheckedValues()


def check_cu_seqlens(name: str, cu_seqlens, total: int, max_seqlen: int, device: torch.device) -> torch.Tensor:
    """Validate ``cu_seqlens`` and return it as int32.

    Its values (starts at 0, never decreases, ends at ``total``, no sequence longer than
    ``max_seqlen``) are checked wherever :func:`values_checkable` allows, once per tensor and
    version: a wrong value would otherwise make the kernels skip rows silently.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D tensor [N + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in SEQLEN_DTYPES:
        raise TypeError(f"{name}: expected dtype torch.int32 or torch.int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {cu_seqlens.device}")
    if values_checkable(cu_seqlens) and not _CHECKED.passed((cu_seqlens,), (total, max_seqlen)):
        values = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {values[0]}")
        if any(n < 0 for n in lengths):
            raise ValueError(f"{name}: must never decrease, got {values}")
        if values[-1] != total:
            raise ValueError(f"{name}: must end at the total length {total} of its tensor, got {values[-1]}")
        if lengths and max(lengths) > max_seqlen:
            raise ValueError(
                f"{name}: its longest sequence has {max(lengths)} tokens, more than max_seqlen = {max_seqlen}"
            )
        _CHECKED.remember((cu_seqlens,), (total, max_seqlen))
    return cu_seqlens.to(torch.int32)


def sequence_rows(
    name: str, t: torch.Tensor | None, cu_seqlens: torch.Tensor, max_seqlen: int, total: int, fill
) -> torch.Tensor | None:
    """A packed or per-sequence mask/bias as ``[1|N, 1|Hkv|H, 1, 1|max_seqlen]`` (see the module doc).

    Positions past a sequence's end hold ``fill``. Shapes are checked here; dtypes and head
    counts by :func:`flash_dma.inputs.normalize_inputs`, against the entries.
    """
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() == 3:
        return t.unsqueeze(2)
    if t.dim() != 2:
        raise ValueError(
            f"{name}: expected a packed [1|Hkv|H, total_k] or per-sequence [1|N, 1|Hkv|H, 1|max_seqlen_k] "
            f"tensor, got shape {tuple(t.shape)}"
        )
    if t.shape[1] == 1:
        return t[None, :, None, :]  # one value per head for every key
    positions = torch.arange(max_seqlen, device=t.device)
    starts, lengths = cu_seqlens[:-1, None], (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    inside = positions[None, :] < lengths  # [N, max_seqlen]
    index = (starts + positions[None, :]).clamp(max=total - 1)
    rows = t[:, index]  # [Hm, N, max_seqlen]
    rows = rows.masked_fill(~inside, fill)
    return rows.permute(1, 0, 2).unsqueeze(2)


def check_per_key(name: str, t, sequences: int, heads: tuple[int, ...], max_seqlen: int, total: int) -> None:
    """Check a varlen mask or bias's sizes in the form the caller gave, so that errors quote its shape
    (the kernels' entries, ``[1|N, 1|Hkv|H, 1, 1|max_seqlen_k]``, are not what the caller made).

    ``heads`` are the sizes a head dimension may have: ``(1, Hkv, H)``.
    """
    forms = {
        2: ("packed [1|Hkv|H, total_k]", (("heads", heads), ("keys", (1, total)))),
        3: ("per-sequence [1|N, 1|Hkv|H, 1|max_seqlen_k]",
            (("sequences", (1, sequences)), ("heads", heads), ("keys", (1, max_seqlen)))),
    }
    if not isinstance(t, torch.Tensor) or t.dim() not in forms:
        return  # sequence_rows names the type or rank
    form, dims = forms[t.dim()]
    for dim, (label, sizes) in enumerate(dims):
        if t.shape[dim] not in sizes:
            raise ValueError(
                f"{name}: dimension {dim} ({label}) of a {form} tensor must be "
                f"{' or '.join(map(str, sorted(set(sizes))))}, got {t.shape[dim]} (shape {tuple(t.shape)}); "
                "masks and biases over packed sequences are per key, never per query"
            )


def packed_rows(name: str, t: torch.Tensor, cu_seqlens_k, max_seqlen_k, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """For the block builders: ``(sequence_rows of t, the checked int32 cu_seqlens_k)``."""
    check_int("max_seqlen_k", max_seqlen_k, 1)
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1:
        raise TypeError(f"cu_seqlens_k: expected a 1-D torch.Tensor [N + 1], got {cu_seqlens_k!r}")
    total = t.shape[-1] if t.dim() == 2 else int(cu_seqlens_k[-1])
    cu_seqlens_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total, max_seqlen_k, t.device)
    return sequence_rows(name, t, cu_seqlens_k, max_seqlen_k, total, fill), cu_seqlens_k


def normalize_varlen_inputs(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, attn_bias, **settings
) -> AttentionProblem:
    """Validate the arguments of :func:`flash_dma.flash_dma_varlen_func` into a packed problem."""
    for name, t, layout in (("q", q, "[total_q, H, D]"), ("k", k, "[total_k, Hkv, D]"), ("v", v, "[total_k, Hkv, D]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor {layout}, got shape {tuple(t.shape)}")
    check_int("max_seqlen_q", max_seqlen_q, 0)
    check_int("max_seqlen_k", max_seqlen_k, 0)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_k: expected {cu_q.shape[0]} entries (as many sequences as cu_seqlens_q), got {cu_k.shape[0]}"
        )
    if k.shape[0] == 0:
        max_seqlen_k = 0  # no keys at all: every sequence's row is empty
    heads = (1, k.shape[1], q.shape[1])
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        check_per_key(name, t, cu_q.shape[0] - 1, heads, max_seqlen_k, k.shape[0])
    mask = sequence_rows("attn_mask", attn_mask, cu_k, max_seqlen_k, k.shape[0], False)
    bias = sequence_rows("attn_bias", attn_bias, cu_k, max_seqlen_k, k.shape[0], 0.0)
    entries = (cu_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[2])
    problem = normalize_inputs(
        q[None], k[None], v[None], mask, bias, entries=entries, names=("q", "k", "v"), **settings
    )
    return dataclasses.replace(
        problem, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k
    )
