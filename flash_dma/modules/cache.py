"""Key/value caches of one :class:`~flash_dma.modules.DynamicMaskAttention` layer, for generation.

A cache holds, for each of B sequences, the keys, values and per-key bias of the tokens seen so
far, in the layout that :func:`flash_dma.flash_dma_with_kvcache` reads and appends to:

- :class:`KVCache`: contiguous, ``[B, max_len, Hkv, D]`` keys and values, preallocated;
- :class:`PagedKVCache`: a pool of pages ``[num_pages, page_size, Hkv, D]`` and a block table
  ``[B, max_pages]``; pages are handed to the sequences as they grow.

Every sequence of a cache holds the same number of tokens: the layer appends the same number of
new tokens to each (it accepts no padding with a cache). One cache serves one layer; a model keeps
one per layer.
"""

from __future__ import annotations

import torch

from flash_dma.integers import cdiv
from flash_dma.inputs import check_int


class KVCache:
    """A contiguous cache: keys, values and the per-key bias of up to ``max_len`` tokens per sequence.

    Args:
        batch_size: B, the number of sequences.
        max_len: the most tokens a sequence may hold; appending past it raises a ValueError.
        num_kv_heads: Hkv, the layer's key/value heads.
        head_dim: D, the layer's head size.
        dtype: the dtype of the keys and values: that of the layer's projections. The bias is
            always float32, as the layer computes it.
        device: where the cache lives: the layer's device.

    Attributes:
        key, value: ``[B, max_len, Hkv, D]``, the first ``length`` positions of each sequence filled.
        bias: ``[B, max_len, Hkv]`` float32, the per-key importance of each key, per key/value head.
        seqlens: ``[B]`` int32, the tokens each sequence holds (``cache_seqlens`` of
            ``flash_dma_with_kvcache``); every entry equals ``length``.
        length: int, the tokens each sequence holds, on the host (no device read needed).
    """

    block_table = None  # contiguous: sequence b is row b

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        sizes = (("batch_size", batch_size), ("max_len", max_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))
        for name, value in sizes:
            check_int(name, value, 1)
        self.batch_size, self.max_len, self.num_kv_heads, self.head_dim = batch_size, max_len, num_kv_heads, head_dim
        self.key, self.value, self.bias = self._storage(dtype, device)
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=self.key.device)
        self.length = 0

    def _storage(self, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (self.batch_size, self.max_len, self.num_kv_heads)
        key = torch.zeros(*shape, self.head_dim, dtype=dtype, device=device)
        return key, torch.zeros_like(key), torch.zeros(shape, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        """Key positions per sequence as ``flash_dma_with_kvcache`` addresses them (the last
        dimension of its ``attn_mask``): ``max_len`` here."""
        return self.max_len

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def device(self) -> torch.device:
        return self.key.device

    def reserve(self, num_tokens: int) -> None:
        """Make room for ``num_tokens`` more tokens per sequence (before appending them).

        Raises:
            ValueError: naming ``max_len`` when the tokens would not fit.
        """
        check_int("num_tokens", num_tokens, 0)
        if self.length + num_tokens > self.max_len:
            raise ValueError(
                f"max_len: the cache holds {self.length} tokens per sequence, and {num_tokens} new ones need "
                f"{self.length + num_tokens} positions, more than max_len = {self.max_len}; build the cache "
                f"with max_len >= {self.length + num_tokens}"
            )

    def advance(self, num_tokens: int) -> None:
        """Record that ``flash_dma_with_kvcache`` appended ``num_tokens`` tokens to every sequence."""
        self.length += num_tokens
        self.seqlens += num_tokens

    def kvcache_arguments(self) -> dict:
        """The cache arguments of :func:`flash_dma.flash_dma_with_kvcache`: ``k_cache``,
        ``v_cache``, ``bias_cache``, ``cache_seqlens`` and ``block_table``."""
        return {
            "k_cache": self.key,
            "v_cache": self.value,
            "bias_cache": self.bias,
            "cache_seqlens": self.seqlens,
            "block_table": self.block_table,
        }

    def cached_bias(self) -> torch.Tensor:
        """The bias of the ``length`` cached keys, ``[B, Hkv, 1, length]`` float32: the layout of
        :meth:`DynamicMaskAttention.key_importance <flash_dma.modules.DynamicMaskAttention.key_importance>`."""
        return self._bias_rows().permute(0, 2, 1).unsqueeze(2)

    def _bias_rows(self) -> torch.Tensor:
        """``[B, length, Hkv]``."""
        return self.bias[:, : self.length]

    def reset(self) -> None:
        """Empty every sequence (the storage is kept, and overwritten by the next tokens)."""
        self.length = 0
        self.seqlens.zero_()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(batch_size={self.batch_size}, length={self.length}, max_len={self.max_len}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})"
        )


class PagedKVCache(KVCache):
    """A paged cache: a pool of pages, handed to the sequences as they grow.

    Position ``i`` of sequence ``b`` lives in slot ``i % page_size`` of page
    ``block_table[b, i // page_size]``. Pages are taken from the pool in order, page by page as
    the sequences reach them, so the pool may be smaller than ``B * max_len`` tokens when not
    every sequence runs to ``max_len``.

    Args:
        batch_size, max_len, num_kv_heads, head_dim, dtype, device: as for :class:`KVCache`.
        page_size: tokens per page (any size; 256 suits the GPU kernels).
        num_pages: pages in the pool; defaults to ``B * max_pages``, enough for every sequence to
            reach ``max_len``. Appending when the pool is used up raises a ValueError.

    Attributes:
        key, value: ``[num_pages, page_size, Hkv, D]``, the pool.
        bias: ``[num_pages, page_size, Hkv]`` float32, the per-key bias in the same pages.
        block_table: ``[B, max_pages]`` int32, ``max_pages = ceil(max_len / page_size)``: the pages
            of each sequence in order. Entries past a sequence's pages hold 0 and are never read.
        seqlens, length: as for :class:`KVCache`.
        pages_used: int, pages handed out so far.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        page_size: int = 256,
        num_pages: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        check_int("page_size", page_size, 1)
        check_int("max_len", max_len, 1)
        check_int("batch_size", batch_size, 1)
        self.page_size, self.max_pages = page_size, cdiv(max_len, page_size)
        self.num_pages = batch_size * self.max_pages if num_pages is None else num_pages
        check_int("num_pages", self.num_pages, 1)
        super().__init__(batch_size, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.block_table = torch.zeros(batch_size, self.max_pages, dtype=torch.int32, device=self.key.device)
        self.pages_used = 0

    def _storage(self, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (self.num_pages, self.page_size, self.num_kv_heads)
        key = torch.zeros(*shape, self.head_dim, dtype=dtype, device=device)
        return key, torch.zeros_like(key), torch.zeros(shape, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        """Key positions per sequence as ``flash_dma_with_kvcache`` addresses them:
        ``max_pages * page_size``, which may exceed ``max_len``."""
        return self.max_pages * self.page_size

    def reserve(self, num_tokens: int) -> None:
        """Make room for ``num_tokens`` more tokens per sequence: hand each sequence the pages it
        reaches, from the pool.

        Raises:
            ValueError: naming ``max_len`` when the tokens would not fit in a sequence, or
                ``num_pages`` when the pool has too few pages left.
        """
        super().reserve(num_tokens)
        held, needed = cdiv(self.length, self.page_size), cdiv(self.length + num_tokens, self.page_size)
        if needed <= held:
            return
        missing = (needed - held) * self.batch_size
        if self.pages_used + missing > self.num_pages:
            raise ValueError(
                f"num_pages: {num_tokens} new tokens per sequence need {missing} more pages of {self.page_size} "
                f"tokens, and the pool has {self.num_pages - self.pages_used} of its num_pages = {self.num_pages} "
                f"left; build the cache with num_pages >= {self.pages_used + missing}"
            )
        # Page by page, the sequences in turn: the pages of a sequence are spread over the pool.
        pages = torch.arange(self.pages_used, self.pages_used + missing, dtype=torch.int32)
        self.block_table[:, held:needed] = pages.view(needed - held, self.batch_size).T.to(self.block_table.device)
        self.pages_used += missing

    def _bias_rows(self) -> torch.Tensor:
        positions = torch.arange(self.length, device=self.block_table.device)
        pages = self.block_table[:, positions // self.page_size].long()  # [B, length]
        return self.bias[pages, positions % self.page_size]

    def reset(self) -> None:
        """Empty every sequence and give every page back to the pool."""
        super().reset()
        self.block_table.zero_()
        self.pages_used = 0

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", page_size={self.page_size}, pages_used={self.pages_used}/{self.num_pages})"
