"""The ``"flex"`` backend: the contract of ``docs/api.md`` through PyTorch's FlexAttention.

The mask (key intervals read from their start and end rows), the causal rule and the window
become a ``mask_mod``; softcap and the bias become a ``score_mod``; gradients, the bias's
included (in its own shape), come from Flex's autograd.
Flex's block mask is made from flash-dma's block summary (the caller's ``block_mask``, or one
built here from the mask) combined with the causal/window band, so no ``[Sq, Sk]`` mask is ever
evaluated and Flex skips the same empty blocks the Triton kernels skip.

On CUDA Flex runs compiled, with static shapes (one compiled entry per shape). The backend is
listed on CUDA only, Flex having no backward pass on the CPU; there the module still computes
forward passes with Flex's eager implementation, which the CPU tests use. Where Flex cannot meet
the contract the backend raises: packed sequences, KV caches, head dims below 16, and bitwise
reproducible gradients (Flex sums the bias gradient with atomic adds).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

from flash_dma.bit_mask import WORD_BITS, BitMask
from flash_dma.block_mask import DEFAULT_BLOCK_SIZE, EMPTY, FULL, PARTIAL, summarize_mask
from flash_dma.integers import cdiv
from flash_dma.key_intervals import KeyIntervals

# Flex's default sparse block: its kernels' tiles divide it for every head dim.
FLEX_BLOCK = 128
# Flex's kernels need at least this head dim (its own check: "embedding dimension ... at least 16").
MIN_HEAD_DIM = 16


def unavailable_reason(device: torch.device) -> str | None:
    """Why Flex cannot run on ``device`` in this process, or None if it can."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if device.type != "cuda":
        # Flex's CPU path has no backward pass (its own NotImplementedError), so it cannot train there.
        return f"it needs a CUDA device (got {device.type}; Flex has no backward pass on the CPU)"
    return None if torch.cuda.is_available() else "CUDA is not available"


# Compiled entries kept per process: shapes are static (below), so each new shape is one more.
FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Static shapes: once dynamo turns shapes dynamic it also makes the softcap closure symbolic,
    # which Inductor's Flex lowering cannot take ("unbacked_bindings").
    return torch.compile(flex_attention, dynamic=False)


def _dynamo_settings(compiled: bool):
    """Dynamo settings for one call of Flex, which dynamo traces in both paths.

    Compiled: a higher limit of compiled entries per function (shapes are static, so each new
    shape is one more). Eager (the CPU): floats specialised, as the compiled path has them: from
    torch 2.15 on, a float that changed since the last call (the softcap in ``score_mod``'s
    closure) turns into a SymFloat, which the Flex op refuses ("can only be of Tensor, int, SymInt").
    """
    import torch._dynamo

    config = torch._dynamo.config
    if not compiled:
        return config.patch(specialize_float=True)
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))


def _broadcast_index(shape: torch.Size, num_heads: int, block: tuple[int, int] = (1, 1)):
    """``index(b, h, q, k)`` into a ``[1|B, 1|Hkv|H, rows, keys]`` tensor: 0 along its broadcast
    axes, a query head's group along an Hkv axis, and blocks of ``block`` along rows and keys."""
    batch_1, heads, rows_1, keys_1 = shape[0] == 1, shape[1], shape[2] == 1, shape[3] == 1
    group = num_heads // heads
    block_q, block_k = block

    def index(b, h, q_idx, kv_idx):
        return (
            0 if batch_1 else b,
            0 if heads == 1 else (h if group == 1 else h // group),
            0 if rows_1 else (q_idx if block_q == 1 else q_idx // block_q),
            0 if keys_1 else (kv_idx if block_k == 1 else kv_idx // block_k),
        )

    return index


def _band(seqlen_q: int, seqlen_k: int, window: tuple[int, int]):
    """``(lowest, highest)`` key offsets from query ``i``'s diagonal ``i + Sk - Sq`` (None: unbounded)."""
    left, right = window
    diagonal = seqlen_k - seqlen_q
    return (None if left < 0 else diagonal - left), (None if right < 0 else diagonal + right)


def _interval_mod(intervals: KeyIntervals, num_heads: int):
    """``kept(b, h, q_idx, kv_idx)`` of key intervals, read from their start and end rows."""
    start, end = intervals.start, intervals.end
    index = _broadcast_index((*end.shape[:2], 1, end.shape[2]), num_heads)

    def kept(b, h, q_idx, kv_idx):
        b, h, _, k = index(b, h, q_idx, kv_idx)
        inside = q_idx < end[b, h, k]
        return inside if start is None else inside & (start[b, h, k] <= q_idx)

    return kept


def _mask_mod(problem):
    """Flex ``mask_mod``: the bottom-right aligned causal/window band, and the mask as the contract
    reads it: with a summary, FULL blocks attend, EMPTY ones do not, and PARTIAL ones follow the mask."""
    _, seqlen_q, seqlen_k, num_heads, _, _ = problem.shape
    lowest, highest = _band(seqlen_q, seqlen_k, problem.window)
    mask, summary = problem.attn_mask, problem.block_mask
    intervals = None
    if isinstance(mask, KeyIntervals):  # its rows; its own summary
        intervals, mask, summary = _interval_mod(mask, num_heads), None, mask.summary
    bits = isinstance(mask, BitMask)
    if bits:  # its words, one per 32 keys; its own summary
        mask, summary = mask.words, mask.summary
    mask_index = None if mask is None else _broadcast_index(mask.shape, num_heads, (1, WORD_BITS if bits else 1))
    keys_broadcast = mask is not None and problem.attn_mask.shape[3] == 1
    is_bool = mask is None or mask.dtype == torch.bool
    state = None if summary is None else summary.state
    state_index = None if summary is None else _broadcast_index(state.shape, num_heads, summary.block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = q_idx >= 0  # true, with the shape Flex expects
        if lowest is not None:
            visible = visible & (kv_idx >= q_idx + lowest)
        if highest is not None:
            visible = visible & (kv_idx <= q_idx + highest)
        kept = None if intervals is None else intervals(b, h, q_idx, kv_idx)
        if mask is not None:
            kept = mask[mask_index(b, h, q_idx, kv_idx)]
            if bits:
                kept = (kept >> (0 if keys_broadcast else kv_idx % WORD_BITS)) & 1
            kept = kept if is_bool else kept != 0
        if state is not None:
            block = state[state_index(b, h, q_idx, kv_idx)]
            kept = block == FULL if kept is None else (block == FULL) | ((block == PARTIAL) & kept)
        return visible if kept is None else visible & kept

    return mask_mod


def _score_mod(problem):
    """Flex ``score_mod``: softcap of the scaled score, then the bias; None when neither applies."""
    softcap, bias = problem.softcap, problem.attn_bias
    if softcap <= 0 and bias is None:
        return None
    index = None if bias is None else _broadcast_index(bias.shape, problem.shape[3])

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[index(b, h, q_idx, kv_idx)].to(score.dtype)
        return score

    return score_mod


def _reblocked(state: torch.Tensor, dim: int, block: int, length: int) -> torch.Tensor:
    """Block states along ``dim`` re-cut from blocks of ``block`` to blocks of :data:`FLEX_BLOCK`.

    A broadcast axis (one block spanning it) is repeated; smaller blocks are merged (EMPTY if all
    are, FULL if all are, else PARTIAL); larger ones are split. Supported sizes are powers of two.
    """
    blocks = cdiv(length, FLEX_BLOCK)
    if state.shape[dim] == 1:
        return state.expand(*state.shape[:dim], blocks, *state.shape[dim + 1 :])
    if block >= FLEX_BLOCK:
        return state.repeat_interleave(block // FLEX_BLOCK, dim=dim).narrow(dim, 0, blocks)
    merged = FLEX_BLOCK // block
    state = state.movedim(dim, -1)
    pad = blocks * merged - state.shape[-1]
    # Past the sequence's end a block is neutral: EMPTY for "any work", FULL for "all work".
    any_work = torch.nn.functional.pad(state, (0, pad), value=EMPTY).unflatten(-1, (blocks, merged)).amax(-1)
    all_work = torch.nn.functional.pad(state, (0, pad), value=FULL).unflatten(-1, (blocks, merged)).amin(-1)
    state = torch.where(any_work == EMPTY, EMPTY, torch.where(all_work == FULL, FULL, PARTIAL)).to(torch.int8)
    return state.movedim(-1, dim)


def _band_state(seqlen_q: int, seqlen_k: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``[NQB, NKB]`` states of the causal/window band over Flex's blocks."""
    lowest, highest = _band(seqlen_q, seqlen_k, window)
    q_first = torch.arange(0, seqlen_q, FLEX_BLOCK, device=device)[:, None]
    k_first = torch.arange(0, seqlen_k, FLEX_BLOCK, device=device)[None, :]
    q_last = (q_first + FLEX_BLOCK).clamp(max=seqlen_q) - 1
    k_last = (k_first + FLEX_BLOCK).clamp(max=seqlen_k) - 1
    # A block is all visible if its last query reaches down to its first key and its first query
    # reaches up to its last key; nothing is visible if the band passes it on either side.
    full = torch.ones(q_first.shape[0], k_first.shape[1], dtype=torch.bool, device=device)
    empty = ~full
    if lowest is not None:
        full = full & (q_last + lowest <= k_first)
        empty = empty | (q_first + lowest > k_last)
    if highest is not None:
        full = full & (q_first + highest >= k_last)
        empty = empty | (q_last + highest < k_first)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _block_state(problem) -> torch.Tensor | None:
    """``[1|B, 1|H, NQB, NKB]`` states over Flex's blocks, or None when nothing is masked."""
    batch, seqlen_q, seqlen_k, num_heads, _, _ = problem.shape
    mask_state, block_size = None, DEFAULT_BLOCK_SIZE
    if problem.block_mask is not None:
        mask_state, block_size = problem.block_mask.state, problem.block_mask.block_size
    elif isinstance(problem.attn_mask, (BitMask, KeyIntervals)):
        mask_state, block_size = problem.attn_mask.summary.state, problem.attn_mask.summary.block_size
    elif problem.attn_mask is not None:
        mask_state = summarize_mask(problem.attn_mask, *block_size)
    if mask_state is None and problem.window == (-1, -1):
        return None
    state = _band_state(seqlen_q, seqlen_k, problem.window, problem.query.device)[None, None]
    if mask_state is not None:
        block_q, block_k = block_size
        mask_state = _reblocked(_reblocked(mask_state, 2, block_q, seqlen_q), 3, block_k, seqlen_k)
        if mask_state.shape[1] not in (1, num_heads):  # Hkv heads -> their query heads
            mask_state = mask_state.repeat_interleave(num_heads // mask_state.shape[1], dim=1)
        # EMPTY < PARTIAL < FULL: a block holds work only where both do, and is FULL where both are.
        state = torch.minimum(state, mask_state)
    return state


def _build_flex_block_mask(problem):
    """Flex's ``BlockMask`` of the problem, or None for dense attention."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    state = _block_state(problem)
    if state is None:
        return None

    def listed(code: int) -> tuple[torch.Tensor, torch.Tensor]:
        hit = state == code
        # A stable sort puts the listed key blocks first, in ascending order.
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)
        return hit.sum(-1, dtype=torch.int32), order.to(torch.int32)

    (partial_count, partial_blocks), (full_count, full_blocks) = listed(PARTIAL), listed(FULL)
    _, seqlen_q, seqlen_k, _, _, _ = problem.shape
    return FlexBlockMask.from_kv_blocks(
        partial_count, partial_blocks, full_count, full_blocks,
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=_mask_mod(problem), seq_lengths=(seqlen_q, seqlen_k),
    )  # fmt: skip


# Flex block masks already made, per summary (or mask) they were made from, or of the band alone:
# building one costs about 2 ms of host time on an H100, ten times Flex's kernels at 4K. Entries
# keep their mask alive, so its id stays unique while cached.
_MADE = torch.utils.weak.WeakIdKeyDictionary()
_MADE_OF_BANDS: dict = {}
_MADE_PER_OWNER = 8


def _flex_block_mask(problem):
    """:func:`_build_flex_block_mask`, made once per summary (or mask, or band) and problem shape."""
    mask, summary = problem.attn_mask, problem.block_mask
    if torch.compiler.is_compiling():
        return _build_flex_block_mask(problem)
    owner = summary if summary is not None else mask
    _, seqlen_q, seqlen_k, num_heads, _, _ = problem.shape
    key = (
        None if mask is None else (id(mask), getattr(mask, "_version", 0)),  # BitMask, KeyIntervals: never written
        seqlen_q, seqlen_k, num_heads, problem.window, problem.query.device,
    )  # fmt: skip
    made = _MADE_OF_BANDS if owner is None else _MADE.setdefault(owner, {})
    if key not in made:
        if len(made) >= _MADE_PER_OWNER:
            made.clear()
        made[key] = _build_flex_block_mask(problem)
    return made[key]


def _check_supported(problem) -> None:
    if problem.cu_seqlens_q is not None:
        raise ValueError("backend: 'flex' does not take packed sequences; use backend='triton' or 'reference'")
    if problem.descale is not None:
        raise ValueError("backend: 'flex' does not take FP8 inputs; use backend='triton' or 'reference'")
    head_dim = problem.shape[5]
    if problem.query.is_cuda and head_dim < MIN_HEAD_DIM:
        raise ValueError(
            f"query: the 'flex' backend needs a head dim of at least {MIN_HEAD_DIM} on CUDA, got {head_dim}; "
            "use backend='triton'"
        )
    tensors = (problem.query, problem.key, problem.value, problem.attn_bias)
    if problem.deterministic and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise ValueError(
            "deterministic: the 'flex' backend cannot make gradients bitwise reproducible (Flex sums the "
            "bias gradient with atomic adds); use backend='triton' or 'reference', or deterministic=False"
        )


def _lse_request() -> dict:
    """The keyword that makes Flex return the log-sum-exp as well, feature-detected: torch >= 2.9 has
    ``return_aux=AuxRequest(lse=True)`` (its ``return_lse`` is deprecated), torch 2.5-2.8 ``return_lse``."""
    from torch.nn.attention import flex_attention as flex_module

    request = getattr(flex_module, "AuxRequest", None)
    return {"return_lse": True} if request is None else {"return_aux": request(lse=True)}


def _lse(extra) -> torch.Tensor:
    """The LSE out of what the :func:`_lse_request` keyword returned beside ``out``: an ``AuxOutput``, or the LSE."""
    return extra if isinstance(extra, torch.Tensor) else extra.lse


def attention(problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry point: ``(out, lse)`` for a validated :class:`~flash_dma.inputs.AttentionProblem`."""
    _check_supported(problem)
    from torch.nn.attention.flex_attention import flex_attention

    _, _, _, num_heads, num_kv_heads, _ = problem.shape
    # Inside the caller's torch.compile, Flex is traced with the rest of the graph, as it is.
    tracing = torch.compiler.is_compiling()
    compiled = problem.query.is_cuda and not tracing
    with contextlib.nullcontext() if tracing else _dynamo_settings(compiled):
        out, extra = (_compiled_flex_attention() if compiled else flex_attention)(
            problem.query.transpose(1, 2),
            problem.key.transpose(1, 2),
            problem.value.transpose(1, 2),
            score_mod=_score_mod(problem),
            block_mask=_flex_block_mask(problem),
            scale=problem.softmax_scale,
            enable_gqa=num_heads != num_kv_heads,
            **_lse_request(),
        )
    return out.transpose(1, 2), _lse(extra).detach()


def attention_with_cache(cached):
    """KV caches are not served by Flex here."""
    raise ValueError("backend: 'flex' does not serve flash_dma_with_kvcache; use backend='triton' or 'reference'")


def topk_attention(problem):
    """``flash_dma_topk_func`` is not served by Flex: a ``ValueError`` saying so."""
    raise ValueError("backend: 'flex' does not serve flash_dma_topk_func; use backend='triton' or 'reference'")
