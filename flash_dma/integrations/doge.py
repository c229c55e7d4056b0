"""transformers' Doge (``DogeForCausalLM``, the seeds' model family) under ``attn_implementation="flash_dma"``.

Doge's attention layer scores every key with a per-key dynamic bias ``dt = exp(A * softplus(dt_proj(V)))``
``[B, Hkv, Sk]``, keeps for each query the ``keep_window_size`` keys of largest ``dt`` among those
its causal mask leaves it (``DogeAttention.prepare_dynamic_mask``, with ``torch.topk``), and hands
the attention function a float mask ``[B, H, Sq, Sk]``: ``dt`` where a key is kept, the dtype's
minimum elsewhere. Read as it comes, that is an ``[S, S]`` tensor per head, in the forward and
again as its gradient.

:func:`install` replaces ``prepare_dynamic_mask`` for layers whose model runs ``"flash_dma"``:

- it returns the bias per key, ``dt[:, :, None, :]`` ``[B, Hkv, 1, Sk]`` (which Doge then repeats
  to ``[B, H, 1, Sk]`` and passes as the mask: the gradient still reaches ``A`` and ``dt_proj``);
- it makes the selection and leaves it on the layer, where the attention function
  (:func:`take_selection`) picks it up. When the mask Doge got says the causal rule, with or
  without key padding, the selection is Doge's prefix top-k, and each key is kept by one run of
  queries: it is made as :class:`~flash_dma.KeyIntervals` ``[B, Hkv, Sq, Sk]`` by one kernel
  launch from ``dt`` and the key padding (``masks.causal_topk_intervals``; ties to the lower key,
  where Doge's ``torch.topk`` leaves them unspecified). Any other mask (a sliding window, packed
  documents, a static cache, a mask of the caller's), and every mask under ``torch.compile``,
  takes Doge's own ``torch.topk`` over the same values, a chunk of query rows at a time, packed as
  a :class:`~flash_dma.BitMask`.

The masks that say the causal rule are those ``flash_dma_mask`` hands over for a plain causal mask
(keys ending where the queries end). transformers 5.23 on has Doge ask for it materialised
(``allow_is_causal_skip=False``): ``flash_dma_mask`` records the ``[B, 1, Sq, Sk]`` mask it builds,
with its padding (:func:`remember_causal`: recognised by identity, its values never read). Earlier
5.x versions let it skip: it hands ``[B, Sk]`` padding, or None where nothing is padded. All three
are the causal rule here, where Doge's own code ranks every key, later ones included, when it gets
None (so does ``"sdpa"`` before 5.23, for an unpadded batch), and cannot read ``[B, Sk]``.

Nothing of size ``[B, H, Sq, Sk]`` is made beyond the causal mask transformers builds for every
implementation. A query with no kept key gets 0 (flash-dma's contract) where SDPA averages every key.
Other implementations run Doge's own ``prepare_dynamic_mask``.
"""

from __future__ import annotations

import functools
import inspect

import torch

from flash_dma.bit_mask import BitMask, pack_words
from flash_dma.key_intervals import KeyIntervals, causal_starts
from flash_dma.masks import causal_topk_intervals
from flash_dma.summaries import bit_mask_from_words

ATTENTION_NAME = "flash_dma"
_SELECTION = "_flash_dma_selection"  # the layer attribute that carries a call's selection
_PARAMETERS = ("self", "hidden_states", "dt_states", "keep_window_size", "attention_mask")
_ATTRIBUTES = ("A", "dt_proj", "keep_window_size", "num_key_value_groups")


def _selected_rows(dt_states, visible_rows, keep: int, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
    """Doge's selection for query rows ``[start, stop)``: bool ``[B, Hkv, rows, Sk]``.

    ``dt_states`` ``[B, Hkv, Sk]``; ``visible_rows(start, stop)`` gives the keys those rows may keep,
    bool ``[B|1, 1, rows, Sk]`` (True = visible), or None for every key. The scores and
    ``torch.topk`` call are Doge's, so ties among equal scores resolve as they do there.
    """
    rows = stop - start
    scores = dt_states[:, :, None, :].expand(-1, -1, rows, -1).to(dtype)
    allowed = visible_rows(start, stop)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(dtype).min)
    if scores.shape[-1] > keep:
        chosen = torch.topk(scores, keep, dim=-1, largest=True, sorted=False).indices
        kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, chosen, True)
    else:
        kept = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    return kept if allowed is None else kept & allowed


# The plain causal masks flash_dma_mask made (keys ending where the queries end: the causal rule is
# flash-dma's bottom-right one), each with its key padding [B, Sk] or None. The mask Doge's layers
# get is recognised here, by identity, rather than by reading its [B, 1, Sq, Sk] values.
_CAUSAL_MASKS = torch.utils.weak.WeakIdKeyDictionary()


def remember_causal(mask: torch.Tensor, padding: torch.Tensor | None) -> None:
    """Record that ``mask`` ``[B, 1, Sq, Sk]`` is the causal rule and ``padding`` ``[B, Sk]`` bool
    (True = real key; None: none padded), for as long as ``mask`` lives. Not while compiling: a
    compiled model's Doge layers take the general path."""
    if not torch.compiler.is_compiling():
        _CAUSAL_MASKS[mask] = padding


def _causal_padding(layer, attention_mask, batch: int, key_len: int) -> tuple[bool, torch.Tensor | None]:
    """``(True, padding [B, Sk] bool or None)`` if ``attention_mask`` says the causal rule over these
    keys (module doc: None for a causal layer, ``[B, Sk]`` padding, or a mask recorded by
    :func:`remember_causal`, not looked up while compiling); ``(False, None)`` otherwise.

    Raises:
        ValueError: a 2-D ``attention_mask`` that is not ``[B, Sk]``.
    """
    if attention_mask is None:
        # What the attention function makes of no mask: the layer's rule, causal unless it says not.
        return getattr(layer, "is_causal", True), None
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, key_len):
            raise ValueError(
                f"attention_mask: expected a padding mask [B, Sk] = {(batch, key_len)} for Doge's keys, "
                f"got shape {tuple(attention_mask.shape)}"
            )
        return True, attention_mask.bool()
    if torch.compiler.is_compiling() or attention_mask not in _CAUSAL_MASKS:
        return False, None
    padding = _CAUSAL_MASKS[attention_mask]
    if attention_mask.shape[-1] != key_len or (padding is not None and tuple(padding.shape) != (batch, key_len)):
        return False, None
    return True, padding


def _visible_rows(attention_mask, causal: bool, padding, shape: tuple, device, start: int, stop: int):
    """The keys that query rows ``[start, stop)`` see: bool ``[B|1, 1, rows, Sk]``, or None for all.

    ``shape`` is ``(B, Hkv, Sq, Sk)``. ``causal``: the bottom-right causal rule, and ``padding``
    ``[B, Sk]`` where given; otherwise ``attention_mask`` ``[B|1, 1, Sq, >= Sk]`` as Doge reads it
    (bool, or additive float: 0 where visible), or None.
    """
    query_len, key_len = shape[2:]
    if causal:
        rows = torch.arange(start, stop, device=device)[:, None]
        visible = (causal_starts(query_len, key_len, device) <= rows)[None, None]
        return visible if padding is None else visible & padding[:, None, None, :]
    if attention_mask is None:
        return None
    visible = attention_mask[:, :, start:stop, :key_len]
    return visible if visible.dtype == torch.bool else visible == 0


def _prepare_dynamic_mask(original, self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
    """``prepare_dynamic_mask`` for ``"flash_dma"`` (module doc); Doge's own for the others."""
    if self.config._attn_implementation != ATTENTION_NAME:
        return original(self, hidden_states, dt_states, keep_window_size, attention_mask)
    batch, kv_heads, key_len = dt_states.shape
    query_len = hidden_states.shape[1]
    causal, padding = _causal_padding(self, attention_mask, batch, key_len)
    shape = (batch, kv_heads, query_len, key_len)
    with torch.no_grad():
        if causal and not torch.compiler.is_compiling():
            selection = causal_topk_intervals(dt_states.detach(), keep_window_size, padding, query_len=query_len)
        else:
            visible_rows = functools.partial(_visible_rows, attention_mask, causal, padding, shape, dt_states.device)
            rows_of = functools.partial(_selected_rows, dt_states.detach(), visible_rows, keep_window_size, hidden_states.dtype)
            selection = bit_mask_from_words(pack_words(rows_of, shape, dt_states.device), shape)
        setattr(self, _SELECTION, selection)
    return dt_states[:, :, None, :]


def take_selection(module) -> BitMask | KeyIntervals | None:
    """The selection a Doge layer made for this call (and forget it), or None for other layers."""
    selection = getattr(module, _SELECTION, None)
    if selection is not None:
        delattr(module, _SELECTION)
    return selection


def install() -> None:
    """Patch ``DogeAttention.prepare_dynamic_mask`` (module doc); calling it again is harmless.

    Raises:
        RuntimeError: the installed transformers' Doge is not the layer this was written for (its
            ``prepare_dynamic_mask`` parameters or attributes differ), so the patch would not fit.
    """
    try:
        from transformers.models.doge import modeling_doge
    except ImportError:
        return  # a transformers without Doge: nothing to patch
    layer = modeling_doge.DogeAttention
    current = layer.prepare_dynamic_mask
    if getattr(current, "flash_dma_patched", False):
        return
    parameters = tuple(inspect.signature(current).parameters)
    source = inspect.getsource(layer.__init__)
    missing = [name for name in _ATTRIBUTES if f"self.{name}" not in source]
    if parameters != _PARAMETERS or missing:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__}: DogeAttention does not fit flash-dma's Doge path "
            f"(expected prepare_dynamic_mask{_PARAMETERS} and attributes {_ATTRIBUTES}, got "
            f"prepare_dynamic_mask{parameters}, missing {missing}); use transformers 5.x or "
            f'attn_implementation="sdpa" for Doge'
        )

    @functools.wraps(current)  # Doge's own stays reachable as __wrapped__
    def prepare_dynamic_mask(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
        return _prepare_dynamic_mask(current, self, hidden_states, dt_states, keep_window_size, attention_mask)

    prepare_dynamic_mask.flash_dma_patched = True
    layer.prepare_dynamic_mask = prepare_dynamic_mask
