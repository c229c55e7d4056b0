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

- None: no mask; causal if the layer is (``is_causal`` argument, else ``module.is_causal``).
- ``[B, Sk]`` padding mask (True or 1 = real token): the mask function returns this for plain
  causal masks, so a padded batch costs O(B * Sk) rather than a ``[B, 1, Sq, Sk]`` tensor;
  causal as above. A shorter mask (the real tokens of a static cache) drops the empty keys.
- 4-D boolean ``[1|B, 1|H, Sq, Sk]``: HF's own mask (sliding windows, packed sequences, static
  caches...), taken as complete: no causal rule or window is added.
- 4-D additive float (eager masks, Doge's dynamic masks): positions at or below the dtype's
  minimum are masked, and the finite values elsewhere become the attention bias, with gradient.
"""

from __future__ import annotations

import functools

import torch

from flash_dma.interface import flash_dma_func

ATTENTION_NAME = "flash_dma"


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
    """An additive float mask -> ``(visible bool, bias)`` of the same shape.

    HF fills masked positions with ``torch.finfo(dtype).min`` (sums of them may reach -inf); the
    rest is a bias (0 for a plain mask, Doge's dynamic bias otherwise), kept differentiable.
    """
    visible = mask > torch.finfo(mask.dtype).min
    bias = mask.masked_fill(~visible, 0.0)
    if bias.dtype not in (torch.float32, query_dtype):
        bias = bias.float()
    return visible, bias


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
        kwargs: other model arguments, not used.

    Returns:
        ``(out [B, Sq, H, D], None)``: attention weights are never materialised.
    """
    if dropout:
        raise ValueError(
            f"dropout: flash_dma has no attention dropout; set the model's attention dropout to 0, got {dropout}"
        )
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)):
        raise ValueError(f"sliding_window: expected an int or None, got {sliding_window!r}")
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window_left = -1 if sliding_window is None else sliding_window - 1
    attn_mask = attn_bias = None
    if attention_mask is not None and attention_mask.dim() == 2:
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
        softcap=0.0 if softcap is None else softcap,
    )
    return out, None


def flash_dma_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """The ``AttentionMaskInterface`` function for ``"flash_dma"``.

    A plain causal mask over keys that line up with the queries (no static-cache offset) becomes
    the 2-D padding mask ``[B, kv_length]`` bool, or None when nothing is padded: the attention
    function applies causality itself. Any other pattern is built by transformers' ``sdpa_mask``
    (4-D bool, or None where SDPA could use ``is_causal``).
    """
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    plain_causal = (
        mask_function is causal_mask_function
        and kv_offset == 0
        and isinstance(q_offset, int)
        and q_offset + q_length == kv_length
    )
    if not plain_causal:
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )
    if attention_mask is None:
        return None
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, -kv_length:].bool()
    return None if bool(padding.all()) else padding


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
        if implementation == ATTENTION_NAME:
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
    AttentionInterface.register(ATTENTION_NAME, flash_dma_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, flash_dma_mask)
    _exempt_from_flash_attention_loading()
