"""flash-dma as a Hugging Face transformers attention implementation named ``"flash_dma"``.

    from flash_dma.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flash_dma")

:func:`register` installs two functions under that name (transformers >= 5):

- the attention function (``AttentionInterface``), which runs :func:`flash_dma.flash_dma_func`:
  the reference backend on the CPU, the Triton kernels on CUDA;
- the mask function (``AttentionMaskInterface``), which decides what the models' mask builders
  (``create_causal_mask`` and friends) hand to it. Without one, transformers passes no mask at
  all to an implementation it does not know, and padding would be silently ignored.

Masks, as the attention function receives them:

- None: no mask; causal if the layer is (``is_causal`` argument, else ``module.is_causal``), per
  document where ``position_ids`` pack several into one row (below).
- ``[B, Sk]`` padding mask (True or 1 = real token): the mask function returns this for plain
  causal masks over keys that end where the queries end (no cache, a DynamicCache), so a padded
  batch costs O(B * Sk) rather than a ``[B, 1, Sq, Sk]`` tensor; causal as above. A shorter mask
  (a model handing its own 2-D mask over a static cache) drops the key slots past it.
- 4-D boolean ``[1|B, 1|H, Sq, Sk]``: HF's own mask (sliding windows, packed sequences, static
  caches, models that ask for a materialised mask), taken as complete: no causal rule or window
  is added.
- 4-D additive float (eager masks): positions at or below the dtype's minimum are masked (a
  BitMask packed once per step), and the mask itself is the attention bias, with gradient.
- Doge's dynamic mask: its bias per key, with the selection its layer left (``doge.py``, which
  :func:`register` installs: Doge's ``[B, H, Sq, Sk]`` float mask is never made).

Caches: ``generate()`` works with a DynamicCache and a StaticCache (``cache_implementation="static"``),
left padding included. Continuous batching (``generate_batch``, ``init_continuous_batching``,
serving; ``"paged|flash_dma"`` is the same name) hands the attention function every request's new
tokens packed into one row, with a ``PagedAttentionCache`` to update (transformers <= 5.23) or
the keys the layer read from it (5.24 on); the requests then run through
:func:`flash_dma.flash_dma_varlen_func`, one causal problem each, as do packed training batches
(one row with ``cu_seq_lens_q``/``cu_seq_lens_k``). transformers' decode fast path (a
block table for ``flash_attn_with_kvcache``) is only taken for flash_attention_2/3 kernels; a block
table handed to flash_dma is refused (``NotImplementedError``) rather than attended without the cache.

Documents packed by ``position_ids`` alone (``DataCollatorWithFlattening``'s default: one row,
positions restarting per document, no mask or an all-ones one) are found as transformers'
flash-attention path finds them. Where the attention function gets no mask, a row (batch of 1)
whose keys are its queries and whose positions return to their smallest value is split there
(``cu_seqlens`` as ``prepare_fa_kwargs_from_position_ids`` derives them), and each document runs
as its own problem through :func:`flash_dma.flash_dma_varlen_func`, with a cache object (the
DynamicCache a model makes when ``use_cache`` is on) or without. The positions are read on the
host once per tensor and version, so once per step whatever the number of layers, and never inside
a CUDA graph capture or a torch.compile trace; an ordinary batch of several rows is not read at
all. Without a cache, transformers' mask builders find the documents themselves and hand a
complete 4-D mask, in a trace too. Models that use that mask beyond attention (Doge's selection,
Falcon's ALiBi, DeepSeek V3.2's indexer) ask for it materialised, and the mask function cannot
tell their call from another, so it is built and taken as complete. In a trace with a cache,
pass ``cu_seq_lens_q``/``cu_seq_lens_k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.utils.weak import WeakIdKeyDictionary

from flash_dma.integrations import doge
from flash_dma.interface import flash_dma_func, flash_dma_varlen_func
from flash_dma.memo import DerivedTensors
from flash_dma.packed import values_checkable
from flash_dma.summaries import pack_mask

ATTENTION_NAME = doge.ATTENTION_NAME
# transformers < 5.23 looks continuous batching's "paged|flash_dma" up by that name; later versions
# drop the prefix themselves. The same function serves both (it takes the paged cache).
_NAMES = (ATTENTION_NAME, f"paged|{ATTENTION_NAME}")
# An eager (additive float) mask's bits, once per version of the mask (``_split_additive_mask``).
_ADDITIVE_MASK_BITS = DerivedTensors()
# Why the installed transformers' Doge could not take flash-dma's Doge path, if it could not.
_DOGE_MISFIT: RuntimeError | None = None


def _padding_to_keys(padding: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Align a 2-D padding mask ``[B, L]`` with the keys ``[B, Sk, Hkv, D]``.

    ``L > Sk``: the mask covers tokens already out of a sliding cache; its last Sk columns count.
    ``L < Sk``: the keys past L are empty slots of a static cache; they are dropped, so that the
    bottom-right causal alignment of ``flash_dma_func`` holds.
    """
    seqlen_k = key.shape[1]
    if padding.shape[1] >= seqlen_k:
        return padding[:, -seqlen_k:], key, value
    real = padding.shape[1]
    return padding, key[:, :real], value[:, :real]


def _split_additive_mask(mask: torch.Tensor, query_dtype: torch.dtype):
    """An additive float mask ``[1|B, 1|H, Sq, Sk]`` -> ``(BitMask, bias)``.

    HF fills masked positions with ``torch.finfo(dtype).min`` (sums of them may reach -inf): the
    bits keep the pairs above it (``flash_dma.pack_mask``, packed once per version of the mask, so
    once per step for all the layers that share it), and the mask itself is the bias (0 for a
    plain mask, Doge's dynamic bias otherwise), kept differentiable. Its masked values are never
    added to a kept pair, so nothing else of size ``[Sq, Sk]`` is made.
    """
    bits = _ADDITIVE_MASK_BITS.get(mask, "bits", lambda: pack_mask(mask.detach()))
    return bits, mask if mask.dtype in (torch.float32, query_dtype) else mask.float()


def _is_paged_cache(cache) -> bool:
    """Whether ``cache`` is transformers' ``PagedAttentionCache``: the call comes from continuous batching."""
    if cache is None:
        return False
    from transformers.generation.continuous_batching import PagedAttentionCache

    return isinstance(cache, PagedAttentionCache)


def _within(rows: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The rows that belong to a sequence: continuous batching pads its batches (for CUDA graphs or
    compiled steps) with rows past the last sequence's end, which flash_dma_varlen_func does not take.
    Inside a graph capture or a trace, where nothing may read cu_seqlens on the host, the rows stay:
    there flash-dma does not check the total, and the kernels read no row past it."""
    return rows[: int(cu_seqlens[-1])] if values_checkable(cu_seqlens) else rows


def _packed_attention(module, query, key, value, cache, kwargs: dict, **settings) -> torch.Tensor:
    """Attention over packed sequences (continuous batching: ``generate_batch``,
    ``init_continuous_batching``; and packed training batches).

    transformers packs the new tokens of every request into one row, ``query`` ``[1, H, total_q, D]``
    with ``cu_seq_lens_q``. Up to 5.23 it hands the ``PagedAttentionCache`` (``cache``):
    ``cache.update`` writes the new keys and values into its pages and returns each request's keys,
    past and new, packed likewise, with ``cu_seq_lens_k``. From 5.24 the layer updates the cache
    itself and passes those keys as ``key`` and ``value`` (``cache`` is None). Each request is then
    its own causal problem, bottom-right aligned: exactly :func:`flash_dma_varlen_func`. The mask that
    the models build from the packed positions covers the new tokens only, not the cache, and the
    sequence bounds already say all it says: it is not used.

    Returns:
        ``[1, total_q, H, D]``.
    """
    if kwargs.get("block_table") is not None:
        # transformers 5 sends block tables (its decode fast path) only to flash_attention_2/3 kernels.
        raise NotImplementedError(
            "block_table: flash_dma serves continuous batching through packed sequences; transformers' "
            "decode fast path (a block table, flash_attn_with_kvcache) is not wired to it, got a block table"
        )
    if cache is not None:
        k, v, cu_k, max_k, max_q = _cached_keys(module, key, value, cache, kwargs)
    else:
        k, v = (t[0].transpose(0, 1) for t in (key, value))  # [total_k, Hkv, D]
        cu_k, max_k, max_q = kwargs["cu_seq_lens_k"], kwargs["max_length_k"], kwargs["max_length_q"]
    cu_q = kwargs["cu_seq_lens_q"]
    q = query[0].transpose(0, 1)  # [total_q, H, D]
    out = flash_dma_varlen_func(
        _within(q, cu_q), _within(k, cu_k), _within(v, cu_k), cu_q, cu_k, int(max_q), int(max_k), is_causal=True,
        **settings,
    )
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, q.shape[0] - out.shape[0]))[None]


def _packed_call(query: torch.Tensor, cache, kwargs: dict) -> bool:
    """Whether transformers hands packed sequences: a paged cache (continuous batching up to 5.23),
    or one row with their bounds (continuous batching from 5.24, packed training batches)."""
    if _is_paged_cache(cache):
        return True
    return query.shape[0] == 1 and kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None


@functools.cache
def _updates_through_kwargs(cache_type: type) -> bool:
    """Whether this paged cache's ``update`` takes ``kwargs`` (transformers 5.23) rather than read
    and write indices; asked once per cache class, not on every layer of every step."""
    return "kwargs" in inspect.signature(cache_type.update).parameters


def _cached_keys(module, key, value, cache, kwargs: dict):
    """Write the new keys and values into the paged cache and read each request's back:
    ``(k, v, cu_seq_lens_k, max_k, max_q)``, ``k`` and ``v`` ``[total_k, Hkv, D]``, for this layer.

    transformers 5.23 takes ``kwargs`` (updated in place with this layer's ``cu_seq_lens_k`` and
    ``max_length_k``) and returns ``[1, Hkv, total_k, D]``; earlier 5.x versions take ``read_index``
    and ``write_index``, return ``[total_k, Hkv, D]``, and name the lengths ``max_seqlen_*``, per
    layer type where a model mixes full and sliding-window layers.
    """
    if _updates_through_kwargs(type(cache)):
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
        k, v = (t[0].transpose(0, 1) for t in (key, value))
        return k, v, kwargs["cu_seq_lens_k"], kwargs["max_length_k"], kwargs["max_length_q"]
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        layer_type = "sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    return k, v, cu_k, max_k, kwargs["max_seqlen_q"]


# What a position_ids tensor says of the documents in its row, with the version it was read at.
# A model hands every layer the same tensor: it is read once per step, not once per layer.
_DOCUMENTS = WeakIdKeyDictionary()


def _packed_documents(position_ids, query: torch.Tensor, key: torch.Tensor):
    """The documents that ``position_ids`` packs into one row, found as transformers'
    flash-attention path finds them: ``(cu_seqlens [N + 1] int32, longest)``, or None for a row
    of one document, for any other layout, and where ``position_ids`` may not be read.

    ``position_ids`` ``[1, S]``; ``query`` ``[1, H, S, D]``; ``key`` ``[1, Hkv, S, D]``. Only a row
    whose keys are its queries (no earlier tokens in a cache) is split, and only where
    :func:`values_checkable` allows the read, once per tensor and version (an inference tensor,
    which has no version, on every call).
    """
    seqlen = query.shape[2]
    if not (
        isinstance(position_ids, torch.Tensor)
        and position_ids.shape == (1, seqlen)
        and query.shape[0] == 1
        and seqlen > 1
        and key.shape[2] == seqlen
        and values_checkable(position_ids)
    ):
        return None
    version = None if position_ids.is_inference() else position_ids._version
    known = _DOCUMENTS.get(position_ids)
    if version is not None and known is not None and known[0] == version:
        return known[1]
    documents = _documents_of(position_ids[0])
    if version is not None:
        _DOCUMENTS[position_ids] = (version, documents)
    return documents


def _documents_of(positions: torch.Tensor):
    """``positions`` ``[S]`` -> ``(cu_seqlens [N + 1] int32, longest)``, or None for one document.

    A document starts wherever the position is the row's smallest (transformers'
    ``prepare_fa_kwargs_from_position_ids``: packed documents restart from the same first
    position, not always 0). Where that does not hold for the first token, the row's head counts
    as a document too, where flash-attention would leave those rows out.
    """
    starts = positions == positions.min()
    starts[0] = True
    bounds = starts.nonzero().flatten().tolist()
    if len(bounds) == 1:
        return None
    bounds.append(positions.shape[0])
    longest = max(end - start for start, end in zip(bounds, bounds[1:]))
    return torch.tensor(bounds, dtype=torch.int32, device=positions.device), longest


def flash_dma_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    cache=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function for ``attn_implementation="flash_dma"``.

    Args:
        module: the calling attention layer; its ``is_causal`` attribute is read when no 4-D mask comes.
        query: ``[B, H, Sq, D]``.
        key, value: ``[B, Hkv, Sk, D]``.
        attention_mask: None, ``[B, L]`` padding, 4-D bool or 4-D additive float (see the module doc).
        scaling: the softmax scale; defaults to ``D ** -0.5``.
        dropout: must be 0: flash-dma has no attention dropout.
        is_causal: overrides ``module.is_causal``.
        softcap: logit soft-capping (Gemma 2), or None.
        sliding_window: without a 4-D mask, keys more than ``sliding_window - 1`` positions before
            the query are not attended (Mistral-style windows); a 4-D mask already holds the window.
        cache: transformers' ``PagedAttentionCache`` under continuous batching up to 5.23; None
            otherwise.
        kwargs: other model arguments; only those of packed sequences are read
            (``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/``max_length_k`` and, with a
            paged cache, its indices), and ``position_ids`` ``[1, S]`` where no mask comes (documents
            packed in one row, see the module doc).

    Returns:
        ``(out [B, Sq, H, D], None)``: attention weights are never materialised.
    """
    if dropout:
        raise ValueError(
            f"dropout: flash_dma has no attention dropout; set the model's attention dropout to 0, got {dropout}"
        )
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)):
        raise ValueError(f"sliding_window: expected an int or None, got {sliding_window!r}")
    window_left = -1 if sliding_window is None else sliding_window - 1
    softcap = 0.0 if softcap is None else softcap
    if _packed_call(query, cache, kwargs):
        settings = dict(softmax_scale=scaling, window_size=(window_left, -1), softcap=softcap)
        paged = cache if _is_paged_cache(cache) else None
        return _packed_attention(module, query, key, value, paged, kwargs, **settings), None
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    selection = doge.take_selection(module)
    if selection is None and _DOGE_MISFIT is not None and type(module).__name__ == "DogeAttention":
        raise _DOGE_MISFIT
    documents = None
    if selection is None and attention_mask is None:
        documents = _packed_documents(kwargs.get("position_ids"), query, key)
    if documents is not None:
        cu_seqlens, longest = documents
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, H|Hkv, D]
        out = flash_dma_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, longest, longest, is_causal=causal, softmax_scale=scaling,
            window_size=(window_left, -1), softcap=softcap,
        )
        return out[None], None
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    attn_mask = attn_bias = None
    if selection is not None:
        # Doge (``doge.py``): its bias per key comes as the mask, its selection (which holds the
        # causal rule) packed on the layer.
        attn_mask, attn_bias, causal, window_left = selection, attention_mask, False, -1
    elif attention_mask is not None and attention_mask.dim() == 2:
        padding, key, value = _padding_to_keys(attention_mask, key, value)
        attn_mask = padding.bool()[:, None, None, :]
    elif attention_mask is not None:
        # A 4-D mask is complete: it holds the causal rule and any window, aligned as HF aligns them.
        causal, window_left = False, -1
        if attention_mask.dtype.is_floating_point:
            attn_mask, attn_bias = _split_additive_mask(attention_mask, query.dtype)
        else:
            attn_mask = attention_mask
    out = flash_dma_func(
        query,
        key,
        value,
        attn_mask,
        attn_bias,
        softmax_scale=scaling,
        is_causal=causal,
        window_size=(window_left, -1),
        softcap=softcap,
    )
    return out, None


def flash_dma_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """The ``AttentionMaskInterface`` function for ``"flash_dma"``.

    A plain causal mask over keys that line up with the queries becomes the 2-D padding mask
    ``[B, kv_length]`` bool, or None when nothing is padded: the attention function applies
    causality itself. Any other pattern gets transformers' ``sdpa_mask``: 4-D bool, or None where
    the causal rule of flash-dma alone gives the same mask.

    flash-dma's causal rule is bottom-right (the last query sees the last key); SDPA's ``is_causal``
    is top-left. The two agree only when the keys end where the queries end, which a static cache
    breaks: its keys run on into empty slots past the queries (and it gives ``q_offset`` as a
    tensor). There, and wherever the caller asks for a materialised mask
    (``allow_is_causal_skip=False``, as Doge does from transformers 5.23 to add its dynamic mask
    onto it), the answer is always the complete 4-D mask; a plain causal one is recorded for
    ``doge.py``, which reads it, as it reads the padding mask or None, as the causal rule.
    """
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    keys_end_with_queries = isinstance(q_offset, int) and q_offset + q_length == kv_offset + kv_length
    may_skip = allow_is_causal_skip and keys_end_with_queries
    plain_causal = keys_end_with_queries and mask_function is causal_mask_function and kv_offset == 0
    padding = None
    if plain_causal and attention_mask is not None:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, -kv_length:].bool()
    if not (may_skip and plain_causal):
        mask = sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=may_skip,
            **kwargs,
        )
        if plain_causal:  # materialised all the same (Doge's): doge.py selects from the padding instead
            doge.remember_causal(mask, padding)
        return mask
    return None if padding is None or bool(padding.all()) else padding


def _exempt_from_flash_attention_loading() -> None:
    """Keep transformers from importing ``"flash_dma"`` as a flash-attention kernel.

    transformers >= 5 treats every implementation whose name contains "flash" as a flash-attention
    kernel: building a model calls ``lazy_import_flash_attention(name)``, which fails for any name
    it cannot load from flash-attn or the hub. flash-dma needs no such import; the wrapper skips it
    for this name only and leaves every other implementation untouched.
    """
    from transformers import modeling_utils

    original = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "flash_dma_exempt", False):
        return

    @functools.wraps(original)
    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in _NAMES:
            return None
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention.flash_dma_exempt = True
    modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def register() -> None:
    """Register ``attn_implementation="flash_dma"`` with transformers; calling it again is harmless.

    Raises:
        ImportError: transformers is not installed (``pip install 'flash-dma[hf]'``).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(
            "flash_dma.integrations.transformers needs transformers >= 5 with AttentionInterface and "
            "AttentionMaskInterface: pip install 'flash-dma[hf]'"
        ) from error
    global _DOGE_MISFIT
    for name in _NAMES:
        AttentionInterface.register(name, flash_dma_attention_forward)
        AttentionMaskInterface.register(name, flash_dma_mask)
    _exempt_from_flash_attention_loading()
    try:
        doge.install()
    except RuntimeError as misfit:  # raised when a Doge layer runs, not for every other model
        _DOGE_MISFIT = misfit
