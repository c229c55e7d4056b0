"""The trainable dynamic-mask attention layer (the Doge design)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flash_dma.block_mask import check_block_size, effective_mask_rows
from flash_dma.distributed import ContextParallel, context_parallel_attention, shard_positions, shard_sequence, unshard_sequence
from flash_dma.distributed.layout import gather_lengths
from flash_dma.interface import flash_dma_func, flash_dma_topk_func, flash_dma_with_kvcache
from flash_dma.inputs import check_choice, check_int
from flash_dma.masks import create_mask, topk_block_mask, topk_mask
from flash_dma.modules.cache import KVCache
from flash_dma.modules.indexer import LightningIndexer
from flash_dma.modules.rotary import RotaryEmbedding

IMPORTANCE_FORMS = ("softplus", "exp")
# Per-query-block selection over a cache: mask elements per flash_dma_with_kvcache call. The new
# queries go in groups of rows small enough that their [B, Hkv, rows, capacity] mask stays below it.
CACHED_MASK_ELEMENTS = 1 << 24


class DynamicMaskAttention(nn.Module):
    """Multi-head attention over the keys that a learned importance selects.

    From the value states, every key gets a bias per key/value head,
    ``bias = A * softplus(dt_proj(V))`` (or ``exp(A * softplus(dt_proj(V)))``), shape ``[B, Hkv, 1, Sk]``.
    The ``window_size`` keys with the largest bias are selected (token by token, or by whole blocks),
    under ``torch.no_grad``; the bias is also added to the attention scores of the selected keys,
    so its gradient teaches ``A`` and ``dt_proj`` which keys matter, and the selection follows.

    Per-query selection (``indexer_heads > 0``, DeepSeek's DSA design): a
    :class:`~flash_dma.modules.LightningIndexer` scores every (query, key) pair per key/value head,
    each query keeps its own ``window_size`` best-scoring visible keys (shared by the query heads of
    its group; ties to the lower key, so the choice is deterministic), and the scores of the kept
    pairs are the bias of :func:`~flash_dma.flash_dma_topk_func`, whose gradient trains the
    indexer. No ``[S, S]`` tensor is made: the indexer scores a chunk of query rows at a time.
    This mode has no ``dt_proj`` and ``A``, and neither decodes with a cache nor runs with
    ``context_parallel`` (a ``ValueError`` says so).

    Args:
        hidden_size: E, the size of the input and output features.
        num_heads: H, the number of query heads.
        num_kv_heads: Hkv, the number of key/value heads; divides ``num_heads`` (GQA; 1 is MQA).
            Defaults to ``num_heads``.
        head_dim: D, the size of each head; defaults to ``hidden_size // num_heads``.
        window_size: keys kept per query by bias (with blocks, rounded up to whole blocks), at least 1
            (0 with sink or local blocks keeps only those). None
            attends to every key: dense attention with the same learned bias, for comparison.
        block_size: None selects single keys: a per-key mask ``[B, Hkv, 1, Sk]``, which under causal
            attention lets each query see the selected keys at or before it. An int (16, 32, 64,
            128 or 256) selects whole blocks of that many keys with
            :func:`~flash_dma.masks.topk_block_mask` (block maximum of the bias), which the kernels
            skip outright on the GPU.
        sink_blocks: block selection only: the first ``sink_blocks`` key blocks are always kept.
        local_blocks: block selection only: when > 0, each block of queries also keeps the key
            block holding its diagonal and the ``local_blocks - 1`` before it, and chooses its
            own window among the blocks it can see (the per-query-block layout of
            :func:`~flash_dma.masks.topk_block_mask`); when 0, one selection serves all queries.
        importance: ``"softplus"`` for ``A * softplus(dt)``, ``"exp"`` for ``exp(A * softplus(dt))``
            (the per-key bias).
        indexer_heads: 0 selects keys by the per-key bias; > 0 selects each query's own
            ``window_size`` keys by a lightning indexer of this many heads per key/value head
            (``block_size`` None).
        indexer_dim: the size of an indexer head (per-query selection).
        qk_norm: apply an RMSNorm over the head dimension to queries and keys.
        rope_base: base of the rotary position embedding applied to queries and keys; None for none.
        is_causal: query i attends to keys up to position i.
        norm_eps: epsilon of the query/key RMSNorm.
        proj_bias: give the q/k/v/o and dt projections an additive bias.
        backend: ``"triton"``, ``"reference"`` or None (Triton on CUDA, reference elsewhere).

    Parameters: ``q_proj`` ``[H*D, E]``, ``k_proj`` and ``v_proj`` ``[Hkv*D, E]``, ``o_proj`` ``[E, H*D]``,
    ``dt_proj`` ``[Hkv, Hkv*D]`` and ``A`` ``[Hkv]``. ``A`` starts at 0, as in Doge: the bias starts
    neutral (every key tied, so the first selection keeps the earliest keys) and grows only as far
    as it helps; ``dt_proj`` receives its gradient through ``A``, so from the first update of ``A`` on.
    With per-query selection, ``indexer`` (a :class:`~flash_dma.modules.LightningIndexer`) instead
    of ``dt_proj`` and ``A``; its weights start at 0 in the same way.

    Generation: ``forward(..., cache=...)`` with a :class:`~flash_dma.modules.KVCache` or
    :class:`~flash_dma.modules.PagedKVCache` appends the new tokens' keys, values and bias to the
    cache and attends over everything cached through :func:`~flash_dma.flash_dma_with_kvcache`.
    A call with a cache holding L tokens and S new ones returns exactly the last S rows of a forward
    without cache over all L + S tokens: the selection is made over the bias of those L + S keys
    with the same builders, so prefill, chunked prefill and token-by-token decoding agree. How
    that compares with one forward over a longer sequence T > L + S depends on the selection:

    - dense (``window_size=None``) and per-query-block selection (``local_blocks > 0``, causal):
      the same as that forward's rows, whatever follows. A query block chooses among the key blocks
      it can see; the one it sees only partly (its diagonal block, whose score also covers the keys
      after the query) is always kept as a local block, so no later key changes the choice.
    - token selection and per-key block selection (``local_blocks=0``): one choice shared by every
      query, made over every key, so in a forward over T tokens the keys after query t compete for
      the window too (and, with blocks, raise the score of the block that holds t): query t may see
      other keys there than at step t. Decoding cannot know the later keys: at step t it chooses
      among keys ``0..t``, which is what a forward over ``t + 1`` tokens gives its last query. With
      token selection that is a superset of what the longer forward shows query t (with fewer
      competitors, every key kept there stays kept): the full window among the keys so far.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        window_size: int | None = 2048,
        block_size: int | None = None,
        sink_blocks: int = 0,
        local_blocks: int = 0,
        importance: str = "softplus",
        indexer_heads: int = 0,
        indexer_dim: int = 32,
        qk_norm: bool = False,
        rope_base: float | None = 10000.0,
        is_causal: bool = True,
        norm_eps: float = 1e-6,
        proj_bias: bool = False,
        backend: str | None = None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_int("hidden_size", hidden_size, 1)
        check_int("num_heads", num_heads, 1)
        check_int("num_kv_heads", num_kv_heads, 1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads = {num_heads}, got {num_kv_heads}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"head_dim: hidden_size = {hidden_size} is not a multiple of num_heads = {num_heads}; give head_dim"
                )
            head_dim = hidden_size // num_heads
        check_int("head_dim", head_dim, 1)
        if block_size is None:
            for name, value in (("sink_blocks", sink_blocks), ("local_blocks", local_blocks)):
                if value:
                    raise ValueError(f"{name}: only block selection uses it; set block_size, got {value}")
        else:
            check_block_size((block_size, block_size))
        check_int("sink_blocks", sink_blocks, 0)
        check_int("local_blocks", local_blocks, 0)
        check_int("indexer_heads", indexer_heads, 0)
        if indexer_heads and (window_size is None or block_size is not None):
            raise ValueError(
                "indexer_heads: per-query selection keeps window_size single keys per query: it needs an int "
                f"window_size and block_size None, got window_size={window_size!r}, block_size={block_size!r}"
            )
        if window_size is not None:  # 0 keeps only the sink and local blocks, where there are some
            check_int("window_size", window_size, 0 if sink_blocks or local_blocks else 1)
        check_choice("importance", importance, IMPORTANCE_FORMS)

        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, head_dim
        self.window_size, self.block_size = window_size, block_size
        self.sink_blocks, self.local_blocks = sink_blocks, local_blocks
        self.importance, self.is_causal, self.backend = importance, is_causal, backend

        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=proj_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=proj_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=proj_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=proj_bias)
        if indexer_heads:
            self.indexer = LightningIndexer(
                hidden_size, num_kv_heads, indexer_heads, indexer_dim, rope_base=rope_base, proj_bias=proj_bias
            )
        else:
            self.indexer = None
            self.dt_proj = nn.Linear(num_kv_heads * head_dim, num_kv_heads, bias=proj_bias)
            self.A = nn.Parameter(torch.zeros(num_kv_heads))
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.rotary = None if rope_base is None else RotaryEmbedding(head_dim, rope_base)

    def key_importance(self, value: torch.Tensor) -> torch.Tensor:
        """The per-key bias ``[B, Hkv, 1, Sk]`` float32 from value states ``[B, Sk, Hkv, D]``."""
        batch, seqlen, _, _ = value.shape
        dt = self.dt_proj(value.reshape(batch, seqlen, self.num_kv_heads * self.head_dim))  # [B, Sk, Hkv]
        strength = self.A * F.softplus(dt)
        if self.importance == "exp":
            strength = torch.exp(strength)
        return strength.float().transpose(1, 2).unsqueeze(2)

    def select(self, bias: torch.Tensor, attention_mask: torch.Tensor | None, query_len: int | None = None) -> dict:
        """The keys to attend, as the ``attn_mask``/``block_mask`` arguments of ``flash_dma_func``.

        Args:
            bias: ``[B, Hkv, 1, S]``, from :meth:`key_importance`.
            attention_mask: ``[B, S]`` bool (True = real token) or None.
            query_len: the queries are the tokens of the last ``query_len`` keys (fewer than S over
                a cache); None for all S. Only the per-query-block layout (``local_blocks > 0``)
                depends on it.

        Returns:
            ``{"attn_mask": [B, 1|Hkv, 1, S] bool or None, "block_mask": BlockMask or None}``; a
            per-query-block ``block_mask`` has ``mask_shape`` ``(B, Hkv, query_len, S)``.
        """
        batch, _, _, seqlen = bias.shape
        padding = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        if self.window_size is None:
            return {"attn_mask": padding, "block_mask": None}
        if self.block_size is None:
            return {"attn_mask": create_mask(bias, attention_mask, batch, seqlen, seqlen, self.window_size), "block_mask": None}
        per_query_block = self.local_blocks > 0
        block_mask = topk_block_mask(
            bias,
            self.window_size,
            attention_mask,
            block_size=(self.block_size, self.block_size),
            query_len=(seqlen if query_len is None else query_len) if per_query_block else None,
            is_causal=self.is_causal and per_query_block,
            sink_blocks=self.sink_blocks,
            local_blocks=self.local_blocks,
        )
        # Padding inside a kept block makes it PARTIAL; the kernels then read the padding mask there.
        return {"attn_mask": padding if block_mask.needs_mask else None, "block_mask": block_mask}

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_selection: bool = False,
        cache: KVCache | None = None,
        context_parallel=None,
    ):
        """Attend over the selected keys.

        Args:
            hidden_states: ``[B, S, E]``, of this layer's parameter dtype (any dtype under autocast).
                S may be 0.
            attention_mask: ``[B, S]`` padding mask, bool or 0/1 (True = real token), or None.
                Must be None with a cache: cached sequences hold no padding.
            position_ids: ``[1|B, S]`` int positions for the rotary embedding; defaults to
                ``L..L+S-1``, L being the tokens already in ``cache`` (0 without one).
            return_selection: also return what :meth:`select` chose (with per-query selection, the
                keys each query attends as a ``BitMask`` ``[B, Hkv, S, S]``: ``topk_mask`` of its indices).
            cache: a :class:`~flash_dma.modules.KVCache` or :class:`~flash_dma.modules.PagedKVCache`
                holding the L tokens before these (L may be 0), for B sequences, with this layer's
                Hkv, D and dtype; or None. The new tokens' keys, values and bias are appended to it.
                Forward only (``flash_dma_with_kvcache`` has no backward): call under
                ``torch.no_grad()`` or ``torch.inference_mode()``. See the class docstring for
                the selection it makes.
            context_parallel: a :class:`~flash_dma.distributed.ContextParallel`: ``hidden_states``
                (and ``attention_mask``, ``position_ids``) are this rank's shard of a sequence laid
                out as it says, and attention runs over the whole sequence with
                :func:`~flash_dma.distributed.context_parallel_attention`. Key selection gathers
                every shard's bias ``[B, Hkv, 1, S]`` (O(S), not O(S²)) and makes the same global
                choice as a forward over the whole sequence; ``position_ids`` default to the shard's
                global positions. Not with a cache, nor with per-query-block selection
                (``local_blocks > 0``). Every rank must call the layer (and its backward).

        Returns:
            ``[B, S, E]``; with ``return_selection``, the pair ``(output, selection)``. With a
            cache, the selection is ``{"attn_mask": [B, Hkv, 1|S, L+S] bool or None, "block_mask":
            None}``: the keys each new query may attend before the causal limit (one row shared by
            all queries, or one per query with per-query-block selection; None when dense). An empty
            sequence (S = 0) gives ``[B, 0, E]``, with every parameter in its graph, and the
            selection ``{"attn_mask": None, "block_mask": None}``; a cache is left as it is.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states: expected [B, S, {self.hidden_size}], got shape {tuple(hidden_states.shape)}"
            )
        dtype = self.q_proj.weight.dtype
        # Under autocast the projections run in its dtype, whatever the input's; otherwise they need the parameters'.
        if hidden_states.dtype != dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(
                f"hidden_states: expected dtype {dtype} (the dtype of this layer's parameters), got {hidden_states.dtype}"
            )
        batch, seqlen, _ = hidden_states.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, seqlen):
            raise ValueError(f"attention_mask: expected shape {(batch, seqlen)} [B, S], got {tuple(attention_mask.shape)}")
        if self.indexer is not None and (cache is not None or context_parallel is not None):
            argument = "cache" if cache is not None else "context_parallel"
            raise ValueError(f"{argument}: per-query selection (indexer_heads > 0) runs without one; pass {argument}=None")
        past = 0
        if cache is not None:
            if context_parallel is not None:
                raise ValueError("cache: decoding with a cache runs on one device; pass context_parallel=None")
            self._check_cache(cache, hidden_states, attention_mask)
            past = cache.length
        if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
            raise TypeError(
                f"context_parallel: expected a flash_dma.distributed.ContextParallel or None, got {type(context_parallel).__name__}"
            )
        if context_parallel is not None and self.window_size is not None and self.block_size and self.local_blocks:
            raise ValueError(
                f"local_blocks: per-query-block selection is not supported with context_parallel, got {self.local_blocks}"
            )
        query = self.q_proj(hidden_states).view(batch, seqlen, self.num_heads, self.head_dim)
        key = self.k_proj(hidden_states).view(batch, seqlen, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden_states).view(batch, seqlen, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        if self.rotary is not None:
            if position_ids is None and context_parallel is not None:
                position_ids = _shard_positions(seqlen, context_parallel, hidden_states.device)[None, :]
            elif position_ids is None:
                position_ids = torch.arange(past, past + seqlen, device=hidden_states.device)[None, :]
            query, key = self.rotary(query, position_ids), self.rotary(key, position_ids)
        bias = None if self.indexer is not None else self.key_importance(value)
        if self.indexer is not None:
            out, selection = self._attend_per_query(
                hidden_states, query, key, value, attention_mask, position_ids, return_selection
            )
        elif context_parallel is not None:
            selection = {"attn_mask": self._select_sharded(bias, attention_mask, context_parallel), "block_mask": None}
            out = context_parallel_attention(
                query, key, value, selection["attn_mask"], bias, is_causal=self.is_causal, backend=self.backend,
                group=context_parallel.group, layout=context_parallel.layout,
            )
        elif seqlen == 0:
            # No query to select keys for (create_mask needs one), and nothing to append to a cache:
            # attention over the empty sequence gives the empty output, as nn.MultiheadAttention's does.
            selection = {"attn_mask": None, "block_mask": None}
            out = flash_dma_func(query, key, value, attn_bias=bias, backend=self.backend)
        elif cache is None:
            selection = self.select(bias, attention_mask)
            out = flash_dma_func(query, key, value, attn_bias=bias, is_causal=self.is_causal, backend=self.backend, **selection)
        else:
            out, selection = self._attend_cached(query, key, value, bias, cache, return_selection)
        out = self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))
        return (out, selection) if return_selection else out

    def _attend_per_query(self, hidden_states, query, key, value, attention_mask, position_ids, return_selection: bool):
        """Per-query selection: ``(out [B, S, H, D], selection or None)``, the selection the indices
        as a ``BitMask`` ``[B, Hkv, S, S]`` (None for S = 0)."""
        states = self.indexer(hidden_states, position_ids)
        padding = None if attention_mask is None else attention_mask.bool()
        indices = self.indexer.select(states, self.window_size, is_causal=self.is_causal, padding=padding)
        bias = self.indexer.pair_scores(states, indices)  # [B, S, Hkv, W]
        out = flash_dma_topk_func(query, key, value, indices, bias, is_causal=self.is_causal, backend=self.backend)
        if not return_selection:
            return out, None
        seqlen = query.shape[1]
        return out, {"attn_mask": topk_mask(indices, seqlen) if seqlen else None, "block_mask": None}

    @torch.no_grad()
    def _select_sharded(self, bias: torch.Tensor, attention_mask, context_parallel) -> torch.Tensor | None:
        """This shard's keys of :meth:`select` over every shard's bias: ``[B, 1|Hkv, 1, S_r]`` bool or None."""
        group, layout = context_parallel
        whole_bias = unshard_sequence(bias, group, dim=3, layout=layout)
        padding = None if attention_mask is None else unshard_sequence(attention_mask, group, dim=1, layout=layout)
        selection = self.select(whole_bias, padding)
        seqlen = whole_bias.shape[3]
        mask = effective_mask_rows(selection["attn_mask"], selection["block_mask"], 0, 1, seqlen)
        return None if mask is None else shard_sequence(mask, group, dim=3, layout=layout)

    def _check_cache(self, cache, hidden_states: torch.Tensor, attention_mask) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a KVCache, a PagedKVCache or None, got {type(cache).__name__}")
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: padding is not supported with a cache (every cached sequence holds the same "
                "real tokens); pass None, or run the padded batch without a cache"
            )
        if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise RuntimeError(
                "cache: decoding with a cache is forward only (flash_dma_with_kvcache has no backward); call the "
                "layer under torch.no_grad() or torch.inference_mode(), got gradients enabled"
            )
        expected = (hidden_states.shape[0], self.num_kv_heads, self.head_dim, hidden_states.device)
        actual = (cache.batch_size, cache.num_kv_heads, cache.head_dim, cache.device)
        if actual != expected:
            raise ValueError(
                "cache: expected (batch_size, num_kv_heads, head_dim, device) = "
                f"{expected} (the batch and device of hidden_states, this layer's heads), got {actual}"
            )

    def _attend_cached(self, query, key, value, bias, cache, return_selection: bool):
        """Append the new tokens to ``cache`` and attend over it: ``(out [B, S, H, D], selection or None)``.

        The selection is :meth:`select` over the bias of the L cached keys and the S new ones, as a
        forward over the L + S tokens would make it; its rows for the new queries become the
        ``attn_mask`` of ``flash_dma_with_kvcache``, over the cache's key positions.
        """
        batch, seqlen = query.shape[:2]
        if cache.dtype != key.dtype:
            raise ValueError(f"cache: expected dtype {key.dtype} (that of this layer's keys), got {cache.dtype}")
        past = cache.length
        cache.reserve(seqlen)
        key_len = past + seqlen
        per_query = self.window_size is not None and self.block_size is not None and self.local_blocks > 0
        # Query blocks of a forward over the whole sequence start at multiples of block_size: the
        # selection's queries start with the block that holds the first new token, so they line up.
        offset = past % self.block_size if per_query else 0
        selection = self.select(torch.cat([cache.cached_bias(), bias], dim=-1), None, query_len=offset + seqlen)

        def rows(start: int, stop: int) -> torch.Tensor | None:
            """The keys new queries ``[start, stop)`` may attend: ``[B, Hkv, 1 or stop - start, L + S]``."""
            first, last = (offset + start, offset + stop) if per_query else (0, 1)
            return effective_mask_rows(selection["attn_mask"], selection["block_mask"], first, last, key_len)

        # Causal queries attend only to keys up to their own, so groups of them can go one after the
        # other, each appending its own keys; without causal every query needs every new key.
        split = per_query and self.is_causal
        step = max(1, CACHED_MASK_ELEMENTS // (batch * self.num_kv_heads * cache.capacity)) if split else seqlen
        new_bias = bias[:, :, 0].transpose(1, 2)  # [B, S, Hkv], the layout of the cache's bias
        outs = []
        for start in range(0, seqlen, step):
            stop = min(seqlen, start + step)
            mask = rows(start, stop)
            if mask is not None:
                mask = F.pad(mask, (0, cache.capacity - key_len), value=False)
            outs.append(
                flash_dma_with_kvcache(
                    query[:, start:stop],
                    k=key[:, start:stop],
                    v=value[:, start:stop],
                    bias=new_bias[:, start:stop],
                    attn_mask=mask,
                    is_causal=self.is_causal,
                    backend=self.backend,
                    **cache.kvcache_arguments(),
                )
            )
            cache.advance(stop - start)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out, ({"attn_mask": rows(0, seqlen), "block_mask": None} if return_selection else None)


def _shard_positions(seqlen: int, context_parallel, device) -> torch.Tensor:
    """The global positions of this rank's ``seqlen`` tokens (a collective: the total is gathered)."""
    group, layout = context_parallel
    return shard_positions(sum(gather_lengths(seqlen, group)), group, layout=layout, device=device)
