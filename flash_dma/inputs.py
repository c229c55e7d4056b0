"""Normalisation and validation of the arguments of the attention entry points.

Every public entry point funnels its arguments through :func:`normalize_inputs`, which
either returns an :class:`AttentionProblem` that every backend can trust, or raises a
``TypeError``/``ValueError`` that names the argument, what was expected and what was given.
Inputs are never modified: where a layout must change (a non-unit last stride), a new
tensor is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from flash_dma.bit_mask import BitMask
from flash_dma.block_mask import BlockMask
from flash_dma.key_intervals import KeyIntervals
from flash_dma.memo import CheckedValues, Memo

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# FP8 inputs (forward only): e4m3, with per-(batch, key/value head) descale factors, as
# FlashAttention-3 takes them; the output is bfloat16.
FP8_DTYPE = torch.float8_e4m3fn
FP8_OUT_DTYPE = torch.bfloat16
DESCALES = ("q_descale", "k_descale", "v_descale")


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the output of inputs of ``dtype``."""
    return FP8_OUT_DTYPE if dtype == FP8_DTYPE else dtype
MAX_HEAD_DIM = 256
UNBOUNDED = -1


@dataclass(frozen=True)
class AttentionProblem:
    """One attention call, validated.

    ``window`` folds ``is_causal`` in: causal attention is ``window=(left, 0)``.
    Tensors keep the caller's shapes and strides (broadcast dimensions stay size 1).
    """

    query: torch.Tensor  # [B, Sq, H, D]
    key: torch.Tensor  # [B, Sk, Hkv, D]
    value: torch.Tensor  # [B, Sk, Hkv, D]
    attn_mask: torch.Tensor | BitMask | KeyIntervals | None  # [1|B, 1|Hkv|H, 1|Sq, 1|Sk]: bool, 0/1 integer, bits or intervals
    attn_bias: torch.Tensor | None  # [1|B, 1|Hkv|H, 1|Sq, 1|Sk], fp32 or query.dtype
    block_mask: BlockMask | None
    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    deterministic: bool
    # Packed (varlen) problems: query/key/value are [1, total, heads, D], and the mask, bias and
    # summary hold one entry per sequence: [1|N, 1|Hkv|H, 1, 1|max_seqlen_k].
    cu_seqlens_q: torch.Tensor | None = None  # [N + 1] int32
    cu_seqlens_k: torch.Tensor | None = None  # [N + 1] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # FP8 inputs: q, k and v's descale factors, [B, Hkv, 3] float32 (ones where not given).
    descale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(B, Sq, Sk, H, Hkv, D)`` of the tensors."""
        batch, seqlen_q, num_heads, head_dim = self.query.shape
        return batch, seqlen_q, self.key.shape[1], num_heads, self.key.shape[2], head_dim

    @property
    def entries(self) -> tuple[int, int, int, int, int, int]:
        """``(B, Sq, Sk, H, Hkv, D)`` of the entries: for packed sequences ``(N, max_seqlen_q, max_seqlen_k, ...)``."""
        if self.cu_seqlens_q is None:
            return self.shape
        _, _, _, num_heads, num_kv_heads, head_dim = self.shape
        return self.cu_seqlens_q.shape[0] - 1, self.max_seqlen_q, self.max_seqlen_k, num_heads, num_kv_heads, head_dim


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_qkv(query, key, value, same_batch: bool = True, fp8: bool = False, names=("query", "key", "value")) -> None:
    """The checks of ``query [B, Sq, H, D]``, ``key`` and ``value [B, Sk, Hkv, D]``, named in errors
    as the caller's arguments are (``names``). ``same_batch``: key and value have query's batch (not
    a KV cache's rows). ``fp8``: the entry point takes FP8 inputs too (``flash_dma_func``).

    A mismatch names the two tensors that disagree and the dimension: key and value are each
    checked against query first, then value against key.
    """
    q_name, k_name, v_name = names
    dtypes, named = (FLOAT_DTYPES, "float16, bfloat16 or float32")
    if fp8:
        dtypes, named = (*FLOAT_DTYPES, FP8_DTYPE), "float16, bfloat16, float32 or float8_e4m3fn"
    layouts = ("[B, Sq, H, D]", "[B, Sk, Hkv, D]", "[B, Sk, Hkv, D]")
    for name, t, layout in zip(names, (query, key, value), layouts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor {layout}, got {t.dim()}-D with shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {named}, got {t.dtype}")
    batch, _, num_heads, head_dim = query.shape
    for name, t in ((k_name, key), (v_name, value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name}: expected dtype {query.dtype} (the dtype of {q_name}), got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} (the device of {q_name}), got {t.device}")
        if same_batch and t.shape[0] != batch:
            raise ValueError(f"{name}: expected batch size {batch} (that of {q_name}), got {t.shape[0]}")
        if t.shape[3] != head_dim:
            raise ValueError(f"{name}: expected head dim {head_dim} (that of {q_name}), got {t.shape[3]}")
        if t.shape[2] < 1 or num_heads % t.shape[2] != 0:
            raise ValueError(
                f"{name}: expected a number of heads that divides the {num_heads} heads of {q_name} "
                f"(each group of query heads shares a key/value head), got {t.shape[2]}"
            )
    for dim, what in ((0, "batch size"), (1, "key length"), (2, "number of heads")):
        if value.shape[dim] != key.shape[dim]:
            raise ValueError(f"{v_name}: expected {what} {key.shape[dim]} (that of {k_name}), got {value.shape[dim]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{q_name}: head dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")


def check_broadcastable(name: str, t, shape: tuple[int, int, int, int, int, int]) -> None:
    """Check that ``t`` (a tensor, a :class:`BitMask` or :class:`KeyIntervals`) is ``[1|B, 1|Hkv|H, 1|Sq, 1|Sk]`` for
    ``shape = (B, Sq, Sk, H, Hkv, D)``."""
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, _ = shape
    if t.dim() == 4:
        b, h, q, k = t.shape
        if b in (1, batch) and h in (1, num_kv_heads, num_heads) and q in (1, seqlen_q) and k in (1, seqlen_k):
            return
    if t.dim() != 4:
        raise ValueError(
            f"{name}: expected a 4-D tensor broadcastable to [B, H, Sq, Sk] = "
            f"[{batch}, {num_heads}, {seqlen_q}, {seqlen_k}], got shape {tuple(t.shape)}"
            + (" (a [B, Sk] padding mask becomes mask[:, None, None, :])" if t.dim() == 2 else "")
        )
    allowed = (
        ("batch", (1, batch)),
        ("heads", (1, num_kv_heads, num_heads)),
        ("query length", (1, seqlen_q)),
        ("key length", (1, seqlen_k)),
    )
    for dim, (label, sizes) in enumerate(allowed):
        if t.shape[dim] not in sizes:
            options = [str(size) for size in sorted(set(sizes))]
            options = " or ".join([", ".join(options[:-1]), options[-1]] if len(options) > 1 else options)
            raise ValueError(
                f"{name}: dimension {dim} ({label}) must be {options}, got {t.shape[dim]} "
                f"(shape {tuple(t.shape)}, broadcast to [B, H, Sq, Sk] = "
                f"[{batch}, {num_heads}, {seqlen_q}, {seqlen_k}])"
            )


def check_mask(mask, query: torch.Tensor, shape) -> None:
    if isinstance(mask, (BitMask, KeyIntervals)):
        if mask.device != query.device:
            raise ValueError(f"attn_mask: expected device {query.device} (the device of query), got {mask.device}")
        check_broadcastable("attn_mask", mask, shape)
        if isinstance(mask, KeyIntervals):
            _check_intervals(mask, shape)
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attn_mask: expected a torch.Tensor, a flash_dma.BitMask, a flash_dma.KeyIntervals or None, got {type(mask).__name__}"
        )
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"attn_mask: expected a bool (True = attend) or 0/1 integer tensor, got {mask.dtype}; "
            "pass additive float masks as attn_bias"
        )
    if mask.device != query.device:
        raise ValueError(f"attn_mask: expected device {query.device} (the device of query), got {mask.device}")
    check_broadcastable("attn_mask", mask, shape)
    check_mask_values(mask)


def _check_intervals(mask: KeyIntervals, shape) -> None:
    """Key intervals span the call's queries and keys (their rows are query indices: they do not
    broadcast over queries, nor over keys), and hold int32 rows of their shape."""
    _, seqlen_q, seqlen_k, _, _, _ = shape
    if mask.shape[2:] != (seqlen_q, seqlen_k):
        raise ValueError(
            f"attn_mask: KeyIntervals of shape {mask.shape} must span the call's [Sq, Sk] = [{seqlen_q}, {seqlen_k}] "
            f"(no broadcasting over queries or keys), got [{mask.shape[2]}, {mask.shape[3]}]"
        )
    rows = (mask.shape[0], mask.shape[1], mask.shape[3])
    for name, t in (("end", mask.end), ("start", mask.start)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != rows:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"attn_mask: KeyIntervals.{name} must be int32 {rows} (its shape less Sq), got {got}")
        if t.device != mask.device:
            raise ValueError(f"attn_mask: KeyIntervals.{name} must be on {mask.device} (the device of end), got {t.device}")


def check_mask_values(mask) -> None:
    """An integer mask must hold only 0 and 1. This reads the mask (and waits for the device), once
    per version of the tensor (``_CHECKED_MASKS``: layers that share a mask check it once per
    step); under torch.compile it is skipped because it would force a graph break."""
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool and not torch.compiler.is_compiling():
        if _CHECKED_MASKS.passed((mask,), ()):
            return
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attn_mask: an integer mask must hold only 0 and 1 (use a bool mask, True = attend)")
        _CHECKED_MASKS.remember((mask,), ())


def sizes_allowed(*sizes: int) -> str:
    """A dimension's allowed sizes as error messages write them, each once: ``1|4|16``, or ``1``."""
    return "|".join(str(size) for size in dict.fromkeys(sizes))


def bias_dtypes(dtype: torch.dtype, owner: str) -> str:
    """A bias's allowed dtypes as errors name them: float32, or float32 and ``owner``'s ``dtype``."""
    return str(torch.float32) if dtype == torch.float32 else f"{torch.float32} or {dtype} (the dtype of {owner})"


def check_bias_tensor(bias, query: torch.Tensor) -> None:
    """``attn_bias`` must be a tensor of float32 or ``query``'s dtype (FP8: the output's), on
    ``query``'s device (any shape)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"attn_bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    dtype, owner = (FP8_OUT_DTYPE, "the output of FP8 inputs") if query.dtype == FP8_DTYPE else (query.dtype, "query")
    if bias.dtype not in (torch.float32, dtype):
        raise TypeError(f"attn_bias: expected dtype {bias_dtypes(dtype, owner)}, got {bias.dtype}")
    if bias.device != query.device:
        raise ValueError(f"attn_bias: expected device {query.device} (the device of query), got {bias.device}")


def check_bias(bias: torch.Tensor, query: torch.Tensor, shape) -> None:
    check_bias_tensor(bias, query)
    check_broadcastable("attn_bias", bias, shape)


def check_int(name: str, value, minimum: int) -> None:
    """``value`` must be an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def _normalize_window(window_size, is_causal: bool) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected a pair (left, right) of ints, got {window_size!r}")
    left, right = window_size
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"window_size: expected int {side} size, got {type(value).__name__} {value!r}")
        if value < UNBOUNDED:
            raise ValueError(f"window_size: {side} size must be -1 (unbounded) or >= 0, got {value}")
    # FlashAttention's convention: causal is a window with no keys to the right of the diagonal.
    return (left, 0) if is_causal else (left, right)


def _check_block_mask(block_mask, attn_mask, query, shape) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask: expected a flash_dma.BlockMask (from build_block_mask) or None, got {type(block_mask).__name__}"
        )
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, _ = shape
    if block_mask.device != query.device:
        raise ValueError(f"block_mask: expected device {query.device} (the device of query), got {block_mask.device}")
    mb, mh, mq, mk = block_mask.mask_shape
    for label, got, sizes in (
        ("batch", mb, (1, batch)),
        ("heads", mh, (1, num_kv_heads, num_heads)),
        ("query length", mq, (1, seqlen_q)),
        ("key length", mk, (1, seqlen_k)),
    ):
        if got not in sizes:
            options = " or ".join(str(s) for s in sorted(set(sizes)))
            raise ValueError(
                f"block_mask: it was built for a mask of shape {block_mask.mask_shape}, whose {label} "
                f"must be {options} for this call, got {got}"
            )
    if isinstance(attn_mask, (BitMask, KeyIntervals)):
        raise ValueError(
            f"block_mask: attn_mask is a {type(attn_mask).__name__}, which carries its own summary; expected "
            f"block_mask=None, got {block_mask!r}"
        )
    if attn_mask is None and block_mask.needs_mask:
        raise ValueError(
            "block_mask: it was built from an element-wise mask and may hold partial blocks; "
            "pass that mask as attn_mask too (block masks from topk_block_mask need none)"
        )


def _is_finite_number(x) -> bool:
    # Comparisons rather than math.isfinite: torch.compile can trace them on symbolic floats.
    return not isinstance(x, bool) and isinstance(x, (int, float)) and -math.inf < x < math.inf


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Kernels vectorise along the head dimension; any other stride pattern is fine.
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def normalize_inputs(
    query,
    key,
    value,
    attn_mask=None,
    attn_bias=None,
    *,
    softmax_scale=None,
    is_causal=False,
    window_size=(UNBOUNDED, UNBOUNDED),
    softcap=0.0,
    block_mask=None,
    deterministic=False,
    entries=None,
    descales=None,
    names=("query", "key", "value"),
) -> AttentionProblem:
    """Validate the arguments of :func:`flash_dma.flash_dma_func` and return the problem they describe.

    ``entries`` ``(B, Sq, Sk, H, Hkv, D)`` is what masks, biases and summaries broadcast to, when
    not the tensors' own shape (packed sequences: one entry per sequence). ``descales``: FP8
    inputs' ``(q_descale, k_descale, v_descale)`` (:func:`fp8_descale`), given by the entry points
    that take FP8 inputs; None for the others. ``names``: the entry point's names of query, key and
    value, for its errors.
    """
    fp8 = descales is not None
    signature = _signature(query, key, value, attn_mask, attn_bias, block_mask, entries, fp8)
    if signature is None or signature not in _VALIDATED:
        _check_tensors(query, key, value, attn_mask, attn_bias, block_mask, entries, fp8, names)
        if signature is not None:
            _VALIDATED.remember(signature, True)
    else:
        check_mask_values(attn_mask)
    return AttentionProblem(
        query=_last_dim_contiguous(query),
        key=_last_dim_contiguous(key),
        value=_last_dim_contiguous(value),
        attn_mask=attn_mask,
        attn_bias=attn_bias,
        block_mask=block_mask,
        descale=fp8_descale(query, key, value, attn_bias, descales) if fp8 else None,
        **normalize_settings(query, softmax_scale, is_causal, window_size, softcap, deterministic),
    )


def fp8_descale(query, key, value, attn_bias, descales) -> torch.Tensor | None:
    """The ``[B, Hkv, 3]`` float32 descale factors of FP8 inputs (``q_descale``, ``k_descale``,
    ``v_descale``: each ``[B, Hkv]`` float32 or None for ones), or None for 16- and 32-bit inputs,
    which take none. FP8 attention has a forward only: no input may require a gradient."""
    if query.dtype != FP8_DTYPE:
        for name, descale in zip(DESCALES, descales):
            if descale is not None:
                raise ValueError(f"{name}: expected None for {query.dtype} inputs (only float8_e4m3fn inputs take one)")
        return None
    batch, num_kv_heads = query.shape[0], key.shape[2]
    for name, descale in zip(DESCALES, descales):
        if descale is None:
            continue
        if not isinstance(descale, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(descale).__name__}")
        if descale.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype {torch.float32}, got {descale.dtype}")
        if tuple(descale.shape) != (batch, num_kv_heads):
            raise ValueError(f"{name}: expected shape [B, Hkv] = [{batch}, {num_kv_heads}], got {tuple(descale.shape)}")
        if descale.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} (the device of query), got {descale.device}")
    names = ("query", "key", "value", "attn_bias")
    grads = torch.is_grad_enabled() and [t is not None and t.requires_grad for t in (query, key, value, attn_bias)]
    if grads and any(grads):
        raise ValueError(f"{names[grads.index(True)]}: FP8 attention has a forward only; expected a tensor that does not require grad")
    if any(d is None for d in descales):
        ones = torch.ones(batch, num_kv_heads, dtype=torch.float32, device=query.device)
        descales = [ones if d is None else d for d in descales]
    return torch.stack(descales, dim=-1)


def head_descale(descale: torch.Tensor, heads: int) -> torch.Tensor:
    """``descale`` ``[B, Hkv]`` as a factor of ``[B, S, heads, D]`` inputs: query heads
    ``[h * group, (h + 1) * group)`` take head h's."""
    return descale.repeat_interleave(heads // descale.shape[1], dim=1)[:, None, :, None]


def dequantize(t: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """FP8 ``t`` ``[B, S, heads, D]`` as float32, times ``descale`` ``[B, Hkv]`` (``head_descale``)."""
    return t.float() * head_descale(descale, t.shape[2])


def dequantized(problem: AttentionProblem) -> AttentionProblem:
    """``problem`` with FP8 inputs turned to float32 (``dequantize``), for the backends and forms
    without an FP8 kernel; their output is then cast to ``FP8_OUT_DTYPE``."""
    q_descale, k_descale, v_descale = problem.descale.unbind(-1)
    return replace(
        problem, query=dequantize(problem.query, q_descale), key=dequantize(problem.key, k_descale),
        value=dequantize(problem.value, v_descale), descale=None,
    )


def _check_tensors(query, key, value, attn_mask, attn_bias, block_mask, entries, fp8: bool, names) -> None:
    """The checks of :func:`normalize_inputs`' tensor arguments: their types, shapes, dtypes and
    devices (and the values of an integer mask)."""
    _check_qkv(query, key, value, fp8=fp8, names=names)
    shape = (query.shape[0], query.shape[1], key.shape[1], query.shape[2], key.shape[2], query.shape[3])
    shape = shape if entries is None else entries
    if attn_mask is not None:
        check_mask(attn_mask, query, shape)
    if attn_bias is not None:
        check_bias(attn_bias, query, shape)
    if block_mask is not None:
        _check_block_mask(block_mask, attn_mask, query, shape)


# Signatures of the tensor arguments that passed _check_tensors (the settings are checked on every call).
_VALIDATED = Memo()
# Integer masks whose values passed check_mask_values, by identity and version.
_CHECKED_MASKS = CheckedValues()
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _signature(query, key, value, attn_mask, attn_bias, block_mask, entries, fp8: bool) -> tuple | None:
    """All that :func:`_check_tensors` reads of its arguments (types, shapes, dtypes, devices; the
    values of an integer mask are read on every call), or None where the checks must run: arguments
    of other types, and tracing under torch.compile, whose own guards cover the shapes."""
    types = type(query), type(key), type(value), type(attn_mask), type(attn_bias), type(block_mask)
    if not (types[0] in _TENSOR_TYPES and types[1] in _TENSOR_TYPES and types[2] in _TENSOR_TYPES):
        return None
    if attn_mask is None or types[3] in _TENSOR_TYPES:
        mask = None if attn_mask is None else (attn_mask.shape, attn_mask.dtype, attn_mask.device)
    elif types[3] is BitMask:
        mask = (attn_mask.shape, attn_mask.device)
    elif types[3] is KeyIntervals:
        rows = [t if t is None else (type(t), t.shape, t.dtype, t.device) for t in (attn_mask.start, attn_mask.end)]
        mask = (attn_mask.shape, attn_mask.device, *rows)
    else:
        return None
    if attn_bias is not None and types[4] not in _TENSOR_TYPES or block_mask is not None and types[5] is not BlockMask:
        return None
    if torch.compiler.is_compiling():
        return None
    return (
        types, query.shape, query.dtype, query.device, key.shape, key.dtype, key.device, value.shape, value.dtype,
        value.device, mask, None if attn_bias is None else (attn_bias.shape, attn_bias.dtype, attn_bias.device),
        None if block_mask is None else (block_mask.mask_shape, block_mask.device, block_mask.needs_mask), entries, fp8,
    )


def normalize_settings(query, softmax_scale, is_causal, window_size, softcap, deterministic=False) -> dict:
    """The scalar settings of an attention call, validated: the matching fields of :class:`AttentionProblem`."""
    if softmax_scale is None:
        # int(): under torch.compile the head dim is specialised (the kernels compile per head dim
        # anyway), so that the scale is a plain float rather than a symbolic one.
        softmax_scale = int(query.shape[-1]) ** -0.5
    if not _is_finite_number(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float or None, got {softmax_scale!r}")
    if not _is_finite_number(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite float >= 0 (0 disables it), got {softcap!r}")
    for name, flag in (("is_causal", is_causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")

    return {
        "softmax_scale": float(softmax_scale),
        "window": _normalize_window(window_size, is_causal),
        "softcap": float(softcap),
        "deterministic": deterministic,
    }
