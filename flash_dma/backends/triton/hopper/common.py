"""Hopper machinery shared by the warp-specialised Gluon kernels (``forward.py``, ``dq.py``, ``dkdv.py``).

The kernels split their roles as FlashAttention-3 does: a *loader* warp walks each work item's
tiles (the walks of ``tiles.py``) and copies them with TMA into shared-memory rings; two
warpgroups of 64 rows (or keys) each do the math. What they share lives here:

- records (``record``) and the arguments every Hopper kernel begins with (:func:`hopper_tensors`,
  :func:`hopper_arguments`);
- the forms of the mask and the bias (``MASK_*``, ``BIAS_*``) and how each is read: per key,
  staged by the loader with each K tile (``_load_key_tile``); per query row, once per work item
  (``row_epilogue`` in the forward, ``_row_statistics`` in the backward's LSEs); per pair, by the
  math warpgroups on the tiles that need it (``pair_offsets``, ``kept_by_bits``); key intervals, by
  the math warpgroups on PARTIAL tiles (the forward and dQ from row words the loader stages:
  ``_store_row_words``, ``kept_by_row_words``, except on tiles whose keys each keep all of the
  item's rows or none, staged as key scores: ``rows_kept_whole``; dK/dV from its keys' rows, read
  once per item);
- the loader of the kernels that own query rows (forward and dQ: ``load_partition``), its
  barriers and staging slots, and what their math warpgroups read back (``staged_keys``,
  ``wait_for_scores``, ``visible_scores``), take (``taken_item``, ``take_rows``) and store (``store_rows``).

Each partition's persistent loop calls one function per work item (``_load_item`` here,
``_softmax_item``, ``_dq_item``, ``_gradient_item``, ``_load_column``): Triton's front end visits
a loop body twice (once to find its loop-carried values) and a nested loop's four times, a
function's once, which shortens the front ends of a first call's compilations
(docs/design-notes.md, "The first call: the kernels it compiles").
"""

# No `from __future__ import annotations`: the records below need their field types as objects.
import inspect

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from flash_dma.backends.triton import configs, tiles
from flash_dma.backends.triton.key_list import gather_kept_keys
from flash_dma.backends.triton.layout import (
    SEQ_CACHE,
    SEQ_FIXED,
    SEQ_PACKED,
    WALK_BLOCKS,
    WALK_KEYS,
    Call,
    Sequences,
    band,
    broadcast_strides,
    diagonal_band,
    head_divisor,
    input_form,
    kernel_view,
    placeholder,
    walk_kind,
)
from flash_dma.integers import cdiv

# The walk's index arithmetic is shared with the Triton kernels: scalar code runs as Gluon as is.
key_walk = gluon.jit(tiles.key_walk.fn)
query_walk = gluon.jit(tiles.query_walk.fn)
sequence_span = gluon.jit(tiles.sequence_span.fn)
summary_row = gluon.jit(tiles.summary_row.fn)
_summary_list = gluon.jit(tiles.summary_list.fn)
_tile_start = gluon.jit(tiles.tile_start.fn)
# Triton 3.9 renamed the TMA copies (and refuses the old names).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

HEAD_DIMS = (32, 64, 96, 128)  # of every Hopper kernel, with every form of mask
# In tiles of 256 columns: the forward's in tiles of 64 keys with one Q slot, dQ's with one Q/dO
# slot and K/V tiles of 32 keys, dK/dV's in items of 64 keys whose dK and dV two warpgroups keep
# (``dkdv.ROLES``).
WIDE_HEAD_DIMS = (192, 256)
FORWARD_HEAD_DIMS = (*HEAD_DIMS, *WIDE_HEAD_DIMS)


def wide_tiles(head_dim: int) -> bool:
    """Whether ``head_dim`` takes tiles of 256 columns (``WIDE_HEAD_DIMS``), and with them each
    kernel's wide configuration."""
    return head_dim_tile(head_dim) > 128


def head_dim_tile(head_dim: int) -> int:
    """The head dim of the kernels' tiles (their HEAD_DIM): ``head_dim`` rounded up to a power of
    two. The TMA copies fill the columns past ``head_dim`` with zeros, which add nothing to the
    products, and leave them out of the stores."""
    return configs.next_power_of_2(head_dim)

# (query rows, keys) per tile of each pass: 64 per math warpgroup along the axis the pass owns.
TILES = {"forward": (128, 128), "dq": (128, 64), "dkdv": (64, 128)}
# A barrier of the CTA's threads: Gluon's ``thread_barrier`` until triton 3.8 named it ``barrier``.
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# Registers per thread: each math warpgroup 240, the loader 24 (setmaxnreg); a kernel starts with
# MAX_REGISTERS over its 3 warpgroups, and 2 x 128 x 240 + 128 x 24 <= 168 x 384.
MATH_REGISTERS = gl.constexpr(240)
LOADER_REGISTERS = gl.constexpr(24)
MAX_REGISTERS = 168
KEY_BIAS_COLUMNS = gl.constexpr(16)  # a 16-bit product's reduction step: the per-key bias operand's width
PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # rows of small shared arrays
WORD_BITS = gl.constexpr(32)  # bits per word of a BitMask (``bit_mask.py``)

# How a mask or bias varies, which decides who reads it (module doc). A mask per pair is a
# BitMask's words or key intervals (each key's rows); a bool mask per pair takes the Triton kernels
# (``dispatch.py``).
MASK_NONE, MASK_KEYS, MASK_ROWS, MASK_BITS, MASK_INTERVALS = (gl.constexpr(i) for i in range(5))
# Where a KV cache's entries find their keys (the forward's ``CACHE``): entry b in cache row b (or no
# cache), in row ``CacheRows[b]`` (``cache_batch_idx``), or in the pages ``BlockTable[b]`` lists.
CACHE_CONTIGUOUS, CACHE_ROWS, CACHE_PAGES = (gl.constexpr(i) for i in range(3))
BIAS_NONE, BIAS_KEYS, BIAS_ROWS, BIAS_PAIRS = (gl.constexpr(i) for i in range(4))


def record(cls):
    """Triton's ``aggregate`` with a constructor that takes the fields in order (Triton 3.6 wants
    one written out; later versions make the same one)."""
    fields = dict(cls.__annotations__)

    def __init__(self, *values):
        for name, value in zip(fields, values, strict=True):
            setattr(self, name, gl.constexpr(value) if fields[name] is gl.constexpr else value)

    cls.__init__ = gluon.constexpr_function(__init__)
    made = aggregate(cls)
    made.fields = fields
    return made


def jit_with_runtime_scalars(fn):
    """``gluon.jit`` that never specialises the int and float parameters (lower-case, not
    constexpr): a value of 1 would become a constant, which the records' tensor fields do not
    take, and ``launch.Launcher`` wants every int parameter classified."""
    params = inspect.signature(fn).parameters.items()
    return gluon.jit(fn, do_not_specialize=[n for n, p in params if n[0].islower() and p.annotation is inspect.Parameter.empty])


# The kernels' codes of ``layout.input_form``'s forms. A bool mask per pair has none: it takes the
# Triton kernels, or is packed into bits first (``dispatch.hopper_takes_bits``).
MASK_CODES = {
    "none": MASK_NONE.value, "keys": MASK_KEYS.value, "rows": MASK_ROWS.value, "bits": MASK_BITS.value,
    "intervals": MASK_INTERVALS.value,
}
BIAS_CODES = {"none": BIAS_NONE.value, "keys": BIAS_KEYS.value, "rows": BIAS_ROWS.value, "pairs": BIAS_PAIRS.value}


# The pointer parameters every Hopper kernel begins with, in order (``hopper_tensors``).
COMMON_TENSORS = ("Q", "K", "V", "Mask", "Bias", "Walk")


def stages_pair_bias(call: Call, walk_flag: int) -> bool:
    """Whether the loader copies a per-pair bias's tiles with TMA (``pair_descriptor``): a 16-bit,
    contiguous bias of 16-byte rows, keys not gathered, and at D <= 64 (where shared memory has
    room for its ring); otherwise the math warpgroups load it themselves."""
    bias = call.bias
    return (
        input_form(bias) == "pairs" and bias.element_size() == 2 and bias.is_contiguous()
        and bias.data_ptr() % 16 == 0 and bias.shape[3] % 8 == 0 and walk_flag != WALK_KEYS and head_dim_tile(call.q.shape[3]) <= 64
    )


def adds_key_bias_by_mma(call: Call, walk_flag: int, cached: bool) -> bool:
    """Whether the forward has the tensor cores add a per-key bias to each ``S`` tile: a product of
    its own, of the bias's row (``_store_key_bias``, in the ring beside K) by weights that carry ``1 /
    softmax_scale`` (``forward._key_bias_weights``), so that the math warpgroups neither read nor
    add it; the operand holds -inf for the keys a per-key mask or a key list drops. For a 16-bit bias
    of Q's dtype (the product's operand as it comes) and a nonzero scale whose inverse the dtype
    holds as a normal number; not with softcap (which caps ``S`` before the bias is added), nor over
    a KV cache (a decode step's few rows spend little on the bias), nor on the per-key-block walk,
    where it measured slower (docs/design-notes.md, "Hopper forward: what a per-key bias costs").
    Otherwise the loader stages the bias as a key score (``_load_key_tile``)."""
    bias = call.bias
    if input_form(bias) != "keys" or bias.shape[3] == 1 or walk_flag == WALK_BLOCKS or cached or call.softcap > 0:
        return False
    if bias.dtype != call.q.dtype or bias.element_size() != 2 or call.softmax_scale == 0:
        return False
    limits = torch.finfo(bias.dtype)
    return limits.tiny <= abs(1 / call.softmax_scale) < limits.max / 2


def hopper_tensors(call: Call, k: torch.Tensor, v: torch.Tensor, walk: torch.Tensor | None) -> list:
    """The pointer parameters every Hopper kernel begins with: ``Q, K, V, Mask, Bias, Walk`` (``k``
    and ``v`` as the kernel copies them: gathered for a key list)."""
    q, mask, bias = call.q, call.mask, call.bias
    device = q.device
    return [
        q, k, v, placeholder(device, torch.uint8) if mask is None else kernel_view(mask),
        placeholder(device, q.dtype) if bias is None else bias, placeholder(device, torch.int32) if walk is None else walk,
    ]


def hopper_arguments(
    call: Call, k: torch.Tensor, v: torch.Tensor, walk: torch.Tensor | None, walk_flag: int, seq: int = SEQ_FIXED,
    key_bias_by_mma: bool = False,
) -> tuple[list, list]:
    """``(runtime, constexprs)``: the parameters every Hopper kernel begins with after
    :func:`hopper_tensors`' pointers.

    ``runtime`` are their strides (mask and bias as ``b, h, q, k``, zero where broadcast), the
    rows (all but the last axis) and columns of mask and bias,
    ``batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, group``, the head divisors of mask,
    bias and walk, the summary's block sizes, the band (``launch_band``: ``seq`` is the kernel's SEQ) and
    ``scale, scale_log2``; ``constexprs`` ``MASK, BIAS, WALK, HEAD_DIM, COLUMNS, STAGED_BIAS, SOFTCAP``.
    STAGED_BIAS: the loader stages the bias in shared memory beside K: a per-pair bias's tiles by
    TMA (``stages_pair_bias``) or, where the caller found it (``key_bias_by_mma``), a per-key bias
    as the tensor cores' operand (``adds_key_bias_by_mma``).
    """
    q, mask, bias = call.q, call.mask, call.bias
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    runtime = [
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *broadcast_strides(mask), *broadcast_strides(bias),
        *broadcast_strides(walk)[:3], 0 if walk is None else walk.shape[-1],
        *((0, 0) if mask is None else (mask.numel() // mask.shape[-1], mask.shape[-1])),
        *((0, 0) if bias is None else (bias.numel() // bias.shape[-1], bias.shape[-1])),
        batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, num_heads // num_kv_heads,
        head_divisor(mask, num_heads), head_divisor(bias, num_heads), head_divisor(walk, num_heads),
        call.list_block_q, call.list_block_k, *launch_band(call, seqlen_q, seqlen_k, seq),
        call.softmax_scale, call.softmax_scale * tiles.LOG2E.value,
        call.softcap * tiles.LOG2E.value, call.softmax_scale / call.softcap if call.softcap > 0 else 0.0,
    ]
    constexprs = [
        MASK_CODES[input_form(mask, call.mask_kind)], BIAS_CODES[input_form(bias)], walk_flag, head_dim_tile(head_dim), head_dim,
        stages_pair_bias(call, walk_flag) or key_bias_by_mma, call.softcap > 0,
    ]
    return runtime, constexprs


def launch_band(call: Call, seqlen_q: int, seqlen_k: int, seq: int) -> tuple[int, int]:
    """The band the kernels get: on the bottom-right diagonal of the whole tensors, or where each
    entry has lengths of its own (packed sequences, a KV cache's entries) on none (each entry
    moves it onto its own: ``entry_span``), its unbounded sides out of the longest entries' reach."""
    if seq == SEQ_FIXED:
        return diagonal_band(call.window_left, call.window_right, seqlen_q, seqlen_k)
    if seq == SEQ_PACKED:
        seqlen_q, seqlen_k = call.max_seqlen_q, call.max_seqlen_k
    return band(call.window_left, call.window_right, seqlen_q, seqlen_k)


def entry_tables(call: Call, sequences: Sequences | None) -> tuple[int, int, int, list, int]:
    """``(entries, seqlen_q, seqlen_k, pointers, SEQ)`` of a call's batch entries: the tensors' own,
    or ``sequences``' (packed sequences, a KV cache's entries: their count and longest lengths), and
    the ``SeqQ, SeqK`` pointers of ``entry_span`` (``sequences``' tables, or placeholders)."""
    q, k = call.q, call.k
    none = placeholder(q.device, torch.int32)
    if sequences is None:
        return q.shape[0], q.shape[1], k.shape[1], [none, none], SEQ_FIXED
    pointers = [none if sequences.seq_q is None else sequences.seq_q, sequences.seq_k]
    return sequences.batch, sequences.max_seqlen_q, sequences.max_seqlen_k, pointers, sequences.kind


def work_items(call: Call, block_m: int, sequences: Sequences | None) -> tuple[int, int, list, int]:
    """``(row_blocks, items, pointers, SEQ)`` of the kernels that own query rows: work items are
    the row blocks of each (entry, head); packed sequences get those of the longest, and the blocks
    past a shorter one's end have no tiles (``_item``). ``pointers``, ``SEQ``: ``entry_tables``'."""
    entries, seqlen_q, _, pointers, seq = entry_tables(call, sequences)
    row_blocks = cdiv(seqlen_q, block_m)
    return row_blocks, row_blocks * entries * call.q.shape[2], pointers, seq


def kept_keys(call: Call, sequences: Sequences | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` as the Hopper kernels read them: with a key list, its kept keys gathered
    (``key_list.gather_kept_keys``; a KV cache's entries' keys up to their lengths); else the
    call's own. A backward gathers them once for dK/dV and dQ."""
    if call.key_list is None:
        return call.k, call.v
    lengths = sequences.seq_k if sequences is not None and sequences.kind == SEQ_CACHE else None
    return gather_kept_keys(call.k, call.v, call.key_list, lengths)


def walked_keys(call: Call, pass_walk: torch.Tensor | None, kept: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """``(k, v, walk, WALK)`` as a Hopper kernel reads them: ``kept`` (``kept_keys``), and with a
    key list the list walked; else the summary's lists ``pass_walk`` (or none)."""
    if call.key_list is None:
        return *kept, pass_walk, walk_kind(pass_walk, None)
    return *kept, call.key_list, WALK_KEYS


@record
class Problem:
    """What every partition of the kernels that own query rows reads (the forward, and the dQ
    kernel: its output is ``Out``, ``o_desc`` the descriptor of one warpgroup's rows of it, and
    with GRADIENT its loader also reads ``do_desc`` and ``Delta``). With FP8 (the forward), ``v_desc``
    copies tiles of V transposed (``transpose.transposed_values``) and ``Descale`` holds the inputs' descale
    factors ``[B, Hkv, 3]``."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    o_desc: tma.tensor_descriptor
    words_desc: tma.tensor_descriptor
    bias_desc: tma.tensor_descriptor
    Out: gl.tensor
    Delta: gl.tensor
    Lse: gl.tensor
    Mask: gl.tensor
    Bias: gl.tensor
    Walk: gl.tensor
    Descale: gl.tensor
    Queue: gl.tensor  # [1] int32, zeroed: with QUEUED, the count of items taken
    SeqQ: gl.tensor
    SeqK: gl.tensor
    CacheRows: gl.tensor  # [B] int32 with CACHE_ROWS
    BlockTable: gl.tensor  # [B, max_pages] int32 with CACHE_PAGES
    stride_table: gl.tensor
    page_size: gl.tensor
    cache_last: gl.tensor  # the last cache row, or page: rows and pages are clamped to it
    stride_ob: gl.tensor
    stride_os: gl.tensor
    stride_oh: gl.tensor
    stride_lse_b: gl.tensor
    stride_lse_h: gl.tensor
    stride_mb: gl.tensor
    stride_mh: gl.tensor
    stride_mq: gl.tensor
    stride_mk: gl.tensor
    stride_bb: gl.tensor
    stride_bh: gl.tensor
    stride_bq: gl.tensor
    stride_bk: gl.tensor
    stride_wb: gl.tensor
    stride_wh: gl.tensor
    stride_wr: gl.tensor
    walk_width: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    num_heads: gl.tensor
    group: gl.tensor
    items: gl.tensor
    row_blocks: gl.tensor
    mask_head_div: gl.tensor
    bias_head_div: gl.tensor
    walk_head_div: gl.tensor
    list_block_q: gl.tensor
    list_block_k: gl.tensor
    band_lo: gl.tensor
    band_hi: gl.tensor
    scale: gl.tensor
    scale_log2: gl.tensor
    softcap_log2: gl.tensor
    scale_over_cap: gl.tensor
    MASK: gl.constexpr
    BIAS: gl.constexpr
    WALK: gl.constexpr
    HEAD_DIM: gl.constexpr  # the tiles' head dim (``head_dim_tile(COLUMNS)``)
    COLUMNS: gl.constexpr  # the inputs' head dim
    STAGED_BIAS: gl.constexpr
    SOFTCAP: gl.constexpr
    KV_STAGES: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    GRADIENT: gl.constexpr
    FP8: gl.constexpr
    SEQ: gl.constexpr  # ``tiles.SEQ_*``: ``SeqQ`` and ``SeqK`` are cu_seqlens (packed) or a cache's lengths (``SeqK``)
    CACHE: gl.constexpr  # ``CACHE_*``: where a cache's entries find their keys
    QUEUED: gl.constexpr  # programs take items off ``Queue`` as they free (``_first_item``), not in turn


@record
class Span:
    """Where a batch entry lies (``tiles.sequence_span``): ``tokens`` indexes the batch axis of the
    token tensors (Q, K, V, O, LSE), whose rows of the entry start at ``q_start`` and ``k_start``;
    its lengths, and the band of visible offsets ``key - query`` on its own bottom-right diagonal."""

    tokens: gl.tensor
    q_start: gl.tensor
    seqlen_q: gl.tensor
    k_start: gl.tensor
    seqlen_k: gl.tensor
    band_lo: gl.tensor
    band_hi: gl.tensor


@gluon.jit
def entry_span(p, batch):
    """The :class:`Span` of batch entry ``batch``: the whole tensors, one packed sequence, or a KV
    cache's entry (its keys in cache row ``batch``, as many as its length says), whose band the
    kernel moves onto its own diagonal (the launch's is on none: ``launch_band``)."""
    tokens, q_start, seqlen_q, k_start, seqlen_k = sequence_span(p.SeqQ, p.SeqK, batch, p.seqlen_q, p.seqlen_k, p.SEQ)
    band_lo = p.band_lo
    band_hi = p.band_hi
    if p.SEQ != tiles.SEQ_FIXED:
        band_lo += seqlen_k - seqlen_q
        band_hi += seqlen_k - seqlen_q
    return Span(tokens, q_start, seqlen_q, k_start, seqlen_k, band_lo, band_hi)


@record
class Item:
    """One work item: a row block of one (batch, head), and where its key tiles lie in its walk
    (``tiles.key_walk``): PARTIAL tiles at positions ``[partial_lo, partial_hi)`` of the summary's
    PARTIAL list, the others at ``[lo, hi)`` of the FULL list (or of every tile, dense, or of the
    key list's first ``key_limit`` slots)."""

    row_block: gl.tensor
    batch: gl.tensor
    head: gl.tensor
    lists: gl.tensor
    tiles_per_block: gl.tensor
    key_limit: gl.tensor
    partial_lo: gl.tensor
    partial_hi: gl.tensor
    lo: gl.tensor
    hi: gl.tensor


@gluon.jit
def let_next_kernel_start():
    """Programmatic dependent launch: the stream's next kernel, if launched with ``launch_pdl``,
    may start its programs once every program of this one has run this (or ended), on the
    multiprocessors that this one's ending programs free (PTX ``griddepcontrol.launch_dependents``;
    without ``launch_pdl`` it does nothing)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait_for_previous_kernel():
    """Programmatic dependent launch: wait until the kernel before this one in the stream has
    ended and its writes are visible (PTX ``griddepcontrol.wait``). A kernel that starts beside
    the one before it runs this before it ends, so that its own end still means theirs: the
    kernels after it, the caching allocator's reuse of the memory they freed, rely on that."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def put(slot, value):
    """Store scalar ``value`` in a one-element shared slot."""
    slot.store(gl.full([1], value, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))


@gluon.jit
def get(slot):
    """The scalar in a one-element shared slot."""
    return gl.max(slot.load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), 0)


@gluon.jit
def expect_after_stores(barrier, nbytes: gl.constexpr):
    """Arrive on ``barrier``, expecting ``nbytes`` of copies, once the warp's lanes have met: the
    loader hands the stores it made to shared memory (a slot's numbers and rows) over with the
    copies. Triton lowers ``mbarrier.expect`` to one lane's ``arrive.expect_tx``, with no barrier
    of the lanes before it (its plain ``arrive`` has one), and that arrive releases only its own
    lane's stores; a barrier of the lanes orders theirs before it (PTX's ``bar.warp.sync``:
    docs/reliability.md, "Racecheck and the mbarrier hand-over")."""
    cta_barrier()
    mbarrier.expect(barrier, nbytes)


@gluon.jit
def tile_descriptor(
    T, batch, length, heads, COLUMNS: gl.constexpr, stride_b, stride_s, stride_h,
    ROWS: gl.constexpr, LAYOUT_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):
    """The TMA descriptor of a whole ``[B, S, heads, COLUMNS]`` tensor, in tiles of ``ROWS`` rows of
    one head and HEAD_DIM (``head_dim_tile``) columns, laid out in shared memory as tiles of
    ``LAYOUT_ROWS`` rows are (``store_rows`` writes a warpgroup's half of a Q tile)."""
    return tma.make_tensor_descriptor(
        T, [batch, length, heads, COLUMNS], [stride_b, stride_s, stride_h, 1], [1, ROWS, 1, HEAD_DIM],
        gl.NVMMASharedLayout.get_default_for([1, LAYOUT_ROWS, 1, HEAD_DIM], T.dtype.element_ty),
    )


@gluon.jit
def staged_buffers(
    words_desc, bias_desc, Bias, MASK: gl.constexpr, BIAS: gl.constexpr, STAGED_BIAS: gl.constexpr, STAGES: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr = 0,
):
    """``(words, bias)``: shared-memory rings of ``STAGES`` tiles of a BitMask's words
    (``words_staged``), or with ``BLOCK_M`` of key intervals' row words (``_store_row_words``: the
    forward's and dQ's), and of the bias the loader stages (a per-pair bias's tiles, a per-key
    bias's operand ``[BLOCK_N, KEY_BIAS_COLUMNS]``, ``_store_key_bias``; one word each where there
    is none)."""
    words = gl.allocate_shared_memory(gl.int32, [1, 1], PLAIN)
    bias = gl.allocate_shared_memory(gl.int32, [1, 1], PLAIN)
    if words_staged(MASK, BLOCK_N):
        words = gl.allocate_shared_memory(words_desc.dtype, [STAGES] + words_desc.block_type.shape, words_desc.layout)
    if MASK == MASK_INTERVALS and BLOCK_M > 0:
        rows_of_words: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        words = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M // WORD_BITS, BLOCK_N], rows_of_words)
    if key_bias_staged(BIAS, STAGED_BIAS):
        dtype: gl.constexpr = Bias.dtype.element_ty
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, KEY_BIAS_COLUMNS], dtype)
        bias = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, KEY_BIAS_COLUMNS], layout)
    if pair_bias_staged(BIAS, STAGED_BIAS):
        bias = gl.allocate_shared_memory(bias_desc.dtype, [STAGES] + bias_desc.block_type.shape, bias_desc.layout)
    return words, bias


@gluon.jit
def init_barriers(bufs, KV_STAGES: gl.constexpr):
    """The barriers of the Q slots and of the K/V ring (the forward's and the dQ kernel's): the
    loader's copies fill a slot, and both math warpgroups release it."""
    Q_SLOTS: gl.constexpr = bufs.q.shape[0]
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(bufs.q_ready.index(i), count=1)
        mbarrier.init(bufs.q_empty.index(i), count=2)
    for i in gl.static_range(KV_STAGES):
        mbarrier.init(bufs.k_ready.index(i), count=1)
        mbarrier.init(bufs.v_ready.index(i), count=1)
        mbarrier.init(bufs.k_empty.index(i), count=2)
        mbarrier.init(bufs.v_empty.index(i), count=2)


# -- how the inputs are read ---------------------------------------------------------------------


@gluon.jit
def input_base(T, stride_b, stride_h, head_div, batch, head):
    """Where a ``[1|B, 1|Hkv|H, ., .]`` input's rows of (``batch``, query head ``head``) start."""
    return T + batch.to(gl.int64) * stride_b + (head // head_div).to(gl.int64) * stride_h


@gluon.jit
def pair_offsets(rows, keys, stride_q, KEYS_FIRST: gl.constexpr):
    """Offsets of a tile of (query ``rows``, ``keys``) pairs in a ``[., ., Sq, Sk]`` input whose
    keys are consecutive (``dispatch.form_of``: so each thread's offsets differ by constants):
    ``[rows, keys]``, or ``[keys, rows]`` with KEYS_FIRST (the dK/dV kernel's tiles)."""
    row_offsets = rows.to(gl.int64) * stride_q
    if KEYS_FIRST:
        offsets = keys[:, None] + row_offsets[None, :]
    else:
        offsets = row_offsets[:, None] + keys[None, :]
    return offsets


@gluon.jit
def pair_inside(p, rows, keys, KEYS_FIRST: gl.constexpr):
    """Which pairs of a tile (oriented as in ``pair_offsets``) lie inside the inputs."""
    if KEYS_FIRST:
        inside = (keys < p.seqlen_k)[:, None] & (rows < p.seqlen_q)[None, :]
    else:
        inside = (rows < p.seqlen_q)[:, None] & (keys < p.seqlen_k)[None, :]
    return inside


@gluon.jit
def pair_bias(p, batch, head, rows, keys, KEYS_FIRST: gl.constexpr):
    """(``batch``, ``head``)'s per-pair bias tile for ``rows`` and ``keys`` in log2 units (0
    outside the inputs), in the layout ``rows`` and ``keys`` slice."""
    base = input_base(p.Bias, p.stride_bb, p.stride_bh, p.bias_head_div, batch, head)
    offsets = pair_offsets(rows, keys, p.stride_bq, KEYS_FIRST)
    return gl.load(base + offsets, mask=pair_inside(p, rows, keys, KEYS_FIRST), other=0.0).to(gl.float32) * tiles.LOG2E


@gluon.constexpr_function
def key_bias_staged(BIAS, STAGED_BIAS):
    """Whether the loader stages a per-key bias's operand with each K tile, for the tensor cores to
    add (``adds_key_bias_by_mma``)."""
    return BIAS == BIAS_KEYS and STAGED_BIAS


@gluon.constexpr_function
def pair_bias_staged(BIAS, STAGED_BIAS):
    """Whether the loader copies a per-pair bias's tiles with TMA beside K (``stages_pair_bias``)."""
    return BIAS == BIAS_PAIRS and STAGED_BIAS


@gluon.constexpr_function
def keys_scored(BIAS, MASK, WALK, STAGED_BIAS):
    """Whether the loader stages key scores with each K tile (``_load_key_tile``) for the math
    warpgroups to add: a bias or a mask per key, a key list (its slots past the kept count score
    -inf) or key intervals (a tile whose keys keep all of the item's rows or none is applied as
    scores, ``rows_kept_whole``); not where it stages the bias as an operand, which carries the
    -inf too."""
    KEY_WISE = BIAS == BIAS_KEYS or MASK == MASK_KEYS or MASK == MASK_INTERVALS or WALK == tiles.WALK_KEYS
    return KEY_WISE and not key_bias_staged(BIAS, STAGED_BIAS)


@gluon.constexpr_function
def tests_pairs(MASK):
    """Whether the mask is tested per pair, on the tiles the walk marks PARTIAL (the loader hands
    the mark to the math warpgroups): a BitMask's bits or key intervals."""
    return MASK == MASK_BITS or MASK == MASK_INTERVALS


@gluon.constexpr_function
def words_staged(MASK, BLOCK_N):
    """Whether the loader copies a BitMask's words with TMA: tiles of 128 keys or more, whose
    words start on 16 bytes (a dQ tile of 64 keys reads its words itself)."""
    return MASK == MASK_BITS and BLOCK_N >= 4 * WORD_BITS


@gluon.jit
def kept_by_bits(p, s, words, batch, head, first_row, first_key, KEYS_FIRST: gl.constexpr, HALF: gl.constexpr = 0):
    """``s`` with -inf where (``batch``, ``head``)'s BitMask bits drop the pair.

    ``s`` is ``[rows, keys]`` from ``first_row`` and ``first_key`` (a multiple of 32), or
    ``[keys, rows]`` with KEYS_FIRST; ``words`` is the shared-memory view of the words that hold
    its bits, ``[rows, keys / 32]`` (with KEYS_FIRST: both warpgroups' keys, ``HALF`` saying
    which are this one's), when the loader staged them (``words_staged``), else None: then they
    are read here (rows past the end read none). The
    tile is viewed with its keys split into (word, bit): each thread loads the words of its own
    rows once, and tests each of its elements' bit.
    """
    if KEYS_FIRST:
        KEYS: gl.constexpr = s.shape[0]
        ROWS: gl.constexpr = s.shape[1]
        split = s.reshape([KEYS // WORD_BITS, WORD_BITS, ROWS])
        words_layout: gl.constexpr = gl.SliceLayout(1, split.type.layout)  # [words, rows]
        bit = 1 << gl.arange(0, WORD_BITS, gl.SliceLayout(0, gl.SliceLayout(2, split.type.layout)))
    else:
        ROWS: gl.constexpr = s.shape[0]
        KEYS: gl.constexpr = s.shape[1]
        split = s.reshape([ROWS, KEYS // WORD_BITS, WORD_BITS])
        words_layout: gl.constexpr = gl.SliceLayout(2, split.type.layout)  # [rows, words]
        bit = 1 << gl.arange(0, WORD_BITS, gl.SliceLayout(0, gl.SliceLayout(1, split.type.layout)))
    if words is None:
        base = input_base(p.Mask, p.stride_mb, p.stride_mh, p.mask_head_div, batch, head)
        ROW_AXIS: gl.constexpr = 0 if KEYS_FIRST else 1
        rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(ROW_AXIS, words_layout))
        word_idx = first_key // WORD_BITS + gl.arange(0, KEYS // WORD_BITS, gl.SliceLayout(1 - ROW_AXIS, words_layout))
        inside = (rows < p.seqlen_q)[None, :] if KEYS_FIRST else (rows < p.seqlen_q)[:, None]
        held = gl.load(base + pair_offsets(rows, word_idx, p.stride_mq, KEYS_FIRST), mask=inside, other=0)
    elif KEYS_FIRST:
        # The staged tile is [rows, 2 x KEYS / 32]: both warpgroups' words. It is read whole, as
        # stored, and this warpgroup's half taken and turned in registers (a view of the shared
        # tile sliced along its words and permuted read wrong words on the H100).
        WIDTH: gl.constexpr = words.shape[1]
        stored: gl.constexpr = gl.BlockedLayout([1, WIDTH], [32, 1], [gl.num_warps(), 1], [1, 0])
        halves = gl.permute(words.load(stored).reshape([ROWS, 2, WIDTH // 2]), (0, 2, 1))  # [rows, word, half]
        lower, upper = gl.split(halves)
        held = gl.convert_layout(gl.permute(upper if HALF else lower, (1, 0)), words_layout)
    else:
        held = words.load(words_layout)
    if KEYS_FIRST:
        kept = (held[:, None, :] & bit[None, :, None]) != 0
    else:
        kept = (held[:, :, None] & bit[None, None, :]) != 0
    kept = gl.where(kept, split, float("-inf"))
    return gl.convert_layout(kept.reshape(s.shape), s.type.layout)


@gluon.jit
def staged_pair_row(T, stride_b, stride_h, stride_q, head_div, batch, head, row):
    """The row of a 2-D ``[Bm * Hm * Sq, columns]`` descriptor (``pair_descriptor``) that holds
    (``batch``, ``head``)'s query row ``row``; strides as the kernels take them (0 where broadcast)."""
    return ((batch.to(gl.int64) * stride_b + (head // head_div).to(gl.int64) * stride_h) // stride_q).to(gl.int32) + row


@gluon.jit
def staged_descriptors(Mask, Bias, fallback, mask_rows, mask_cols, bias_rows, bias_cols, stride_mq, stride_bq,
                       MASK: gl.constexpr, BIAS: gl.constexpr, STAGED_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr):
    """``(words_desc, bias_desc)``: TMA descriptors of a BitMask's words (``words_staged``) and of
    a staged per-pair bias, in tiles of a work item's rows and one key tile (``fallback`` where
    there is none)."""
    words_desc = fallback
    bias_desc = fallback
    if words_staged(MASK, BLOCK_N):
        words_desc = pair_descriptor(Mask, mask_rows, mask_cols, stride_mq, BLOCK_M, BLOCK_N // WORD_BITS)
    if pair_bias_staged(BIAS, STAGED_BIAS):
        bias_desc = pair_descriptor(Bias, bias_rows, bias_cols, stride_bq, BLOCK_M, BLOCK_N)
    return words_desc, bias_desc


@gluon.jit
def pair_descriptor(T, rows, columns, stride_q, BLOCK_ROWS: gl.constexpr, BLOCK_COLUMNS: gl.constexpr):
    """The TMA descriptor of a contiguous per-pair input ``[Bm, Hm, Sq, columns]`` as ``[rows =
    Bm * Hm * Sq, columns]``, in tiles of ``[BLOCK_ROWS, BLOCK_COLUMNS]``: rows past a query
    block's end read the next (batch, head)'s, which no result uses; columns past the end read 0."""
    return tma.make_tensor_descriptor(
        T, [rows, columns], [stride_q, 1], [BLOCK_ROWS, BLOCK_COLUMNS],
        gl.NVMMASharedLayout.get_default_for([BLOCK_ROWS, BLOCK_COLUMNS], T.dtype.element_ty),
    )


@gluon.jit
def row_values(p, T, stride_q, rows, other):
    """One value per query row of a ``[., ., Sq, 1]`` input at ``T`` (``other`` past the end)."""
    return gl.load(T + rows.to(gl.int64) * stride_q, mask=rows < p.seqlen_q, other=other)


@gluon.jit
def row_statistics(p, row_offset, rows, bias_base, seqlen_q):
    """LSEs (log2 units; +inf for rows that see no key, or past the entry's ``seqlen_q``: their
    gradients are 0) and deltas of query rows ``rows`` of one (batch, head), for the backward
    kernels. A bias per query row is taken back out of the LSE: the kernels' scores leave it out."""
    row_ok = rows < seqlen_q
    lse = gl.load(p.Lse + row_offset + rows, mask=row_ok, other=float("inf"))
    sees_nothing = lse == float("-inf")  # tested first: a row bias of -inf would make it NaN
    if p.BIAS == BIAS_ROWS:
        lse = lse - row_values(p, bias_base, p.stride_bq, rows, 0.0).to(gl.float32)
    lse = gl.where(sees_nothing, float("inf"), lse) * tiles.LOG2E
    return lse, gl.load(p.Delta + row_offset + rows, mask=row_ok, other=0.0)


# -- the loader of the kernels that own query rows -------------------------------------------------


@gluon.jit
def _item_position(p, index):
    """``(row_block, batch, head)`` of work item ``index``: row blocks from the last, (batch, head) fastest."""
    batch_heads = p.items // p.row_blocks
    return p.row_blocks - 1 - index // batch_heads, (index % batch_heads) // p.num_heads, index % p.num_heads


@gluon.jit
def _item(p, index):
    """Work item ``index`` and its walk (the Triton forward's ``tiles.key_walk``, one split): ``(item, span)``."""
    row_block, batch, head = _item_position(p, index)
    span = entry_span(p, batch)
    q_lo = row_block * p.BLOCK_M
    walk = input_base(p.Walk, p.stride_wb, p.stride_wh, p.walk_head_div, batch, head)
    row_offset = summary_row(row_block, p.list_block_q, p.BLOCK_M).to(gl.int64) * p.stride_wr
    lists, tiles_per_block, key_limit, partial_lo, partial_hi, lo, _, _, hi = key_walk(
        walk, p.walk_width, row_offset, span.seqlen_k, q_lo, gl.minimum(q_lo + p.BLOCK_M, span.seqlen_q) - 1,
        span.band_lo, span.band_hi, p.list_block_k, 0, 1, p.WALK, p.BLOCK_N,
    )
    if p.SEQ == tiles.SEQ_PACKED:  # a row block past its sequence's end (the items span the longest): no tiles
        past = q_lo >= span.seqlen_q
        partial_hi = gl.where(past, partial_lo, partial_hi)
        hi = gl.where(past, lo, hi)
    return Item(row_block, batch, head, lists, tiles_per_block, key_limit, partial_lo, partial_hi, lo, hi), span


@gluon.jit
def tile_count(it):
    return (it.partial_hi - it.partial_lo) + (it.hi - it.lo)


@gluon.jit
def tile_at(p, it, j):
    """The j-th tile (of ``BLOCK`` positions) of a work item, PARTIAL ones first: ``(tile,
    partial)``. Without a summary every tile is PARTIAL: a mask is read on each."""
    partials = it.partial_hi - it.partial_lo
    partial = j < partials
    position = gl.where(partial, it.partial_lo + j, it.lo + j - partials)
    tile = position
    if p.WALK == tiles.WALK_BLOCKS:
        tile = _tile_start(_summary_list(it.lists, p.walk_width, partial == 0, 0), position, it.tiles_per_block, p.WALK)
    if p.WALK == tiles.WALK_DENSE:
        partial = j >= 0
    return tile, partial


@gluon.jit
def _cache_row(p, batch, span):
    """The batch index of K and V (and of a cache's per-key bias, stored with its keys) for entry
    ``batch``: the token tensors' own, its ``cache_batch_idx`` row, or 0 in a pool of pages. Rows
    are clamped to the cache (as ``tiles.page_rows`` clamps pages): a bad index captured in a CUDA
    graph, unchecked, reads wrong keys, never outside the cache."""
    row = span.tokens
    if p.CACHE == CACHE_ROWS:
        row = gl.minimum(gl.maximum(gl.load(p.CacheRows + batch), 0), p.cache_last)
    if p.CACHE == CACHE_PAGES:
        row = span.tokens * 0
    return row


@gluon.jit
def interval_rows(p, mask_row, keys, read):
    """``(start, end)``: the query rows ``[start, end)`` for which key intervals at ``mask_row`` (the
    rows of a batch entry and head) keep ``keys`` (``tiles.MASK_INTERVALS``' layout), 0 where not
    ``read``; in ``keys``' layout."""
    at = mask_row + (2 * keys).to(gl.int64) * p.stride_mk
    return gl.load(at, mask=read, other=0), gl.load(at + p.stride_mk, mask=read, other=0)


@gluon.jit
def _ones_below(n):
    """int32 words with their ``n`` lowest bits set, ``0 <= n <= 32``."""
    return gl.where(n >= WORD_BITS, -1, (1 << gl.minimum(n, WORD_BITS - 1)) - 1)


@gluon.constexpr_function
def _row_words_layout(BLOCK_N):
    """The loader's layout of one row of row words ``[1, BLOCK_N]`` (``_store_row_words``)."""
    return gl.BlockedLayout([1, BLOCK_N // 32], [1, 32], [1, 1], [1, 0])


@gluon.jit
def _store_row_words(p, bufs, stage, start, end, first_row):
    """Key intervals' rows as bits, for the math warpgroups (``kept_by_row_words``): for each key
    of the tile, ``BLOCK_M / 32`` words whose bit ``r`` of word ``w`` says whether the key is kept
    for the work item's row ``first_row + 32 w + r``, into ring position ``stage``. ``start`` and
    ``end`` ``[BLOCK_N]`` (in ``_row_words_layout``'s keys) are the keys' rows. A thread of the math
    warpgroups then tests its elements as against a BitMask's words (one word a key holds both of
    its rows), where the rows themselves would take two registers a key and two comparisons an
    element."""
    for w in gl.static_range(p.BLOCK_M // WORD_BITS):
        lo = gl.minimum(gl.maximum(start - (first_row + w * WORD_BITS), 0), WORD_BITS)
        hi = gl.minimum(gl.maximum(end - (first_row + w * WORD_BITS), 0), WORD_BITS)
        bufs.words.index(stage).slice(w, 1).store((_ones_below(hi) & ~_ones_below(lo))[None, :])


@gluon.jit
def kept_by_row_words(s, words):
    """``s`` ``[ROWS, keys]`` with -inf where the row words ``words`` ``[ROWS / 32, keys]`` (shared
    memory, ``_store_row_words``) leave the pair out. The tile is viewed with its rows split into
    (word, bit), as ``kept_by_bits`` splits keys."""
    ROWS: gl.constexpr = s.shape[0]
    KEYS: gl.constexpr = s.shape[1]
    split = s.reshape([ROWS // WORD_BITS, WORD_BITS, KEYS])
    words_layout: gl.constexpr = gl.SliceLayout(1, split.type.layout)  # [row words, keys]
    bit = 1 << gl.arange(0, WORD_BITS, gl.SliceLayout(0, gl.SliceLayout(2, split.type.layout)))
    held = words.load(words_layout)
    kept = gl.where((held[:, None, :] & bit[None, :, None]) != 0, split, float("-inf"))
    return gl.convert_layout(kept.reshape(s.shape), s.type.layout)


@gluon.jit
def rows_kept_whole(start, end, first_row, last_row):
    """``(whole, none)`` of key intervals ``[start, end)`` ``[keys]`` over the rows ``[first_row,
    last_row)``: whether each key keeps all of the rows or none of them, and which keys keep none.
    Where ``whole``, a PARTIAL tile of those keys and rows is per key, not per pair (its dropped
    keys score -inf, and nobody tests its pairs): a causal top-k of per-key scores mostly is at long
    lengths, a key's run seldom starting or ending inside a tile's rows."""
    none = (end <= first_row) | (start >= last_row) | (end <= start)
    every = (start <= first_row) & (end >= last_row)
    return gl.min((every | none).to(gl.int32), 0) != 0, none


@gluon.jit
def _load_key_tile(p, bufs, it, span, j, loaded, bias_row, mask_row, kv_head, kv_batch):
    """The j-th key tile of work item ``it`` into ring position ``loaded``: the span of its keys'
    positions (with a key list also the positions), whether its pair bits are read, its key scores
    (bias per key in log2 units, -inf for keys masked out or past the end) or its per-key bias as
    the tensor cores' operand (``_store_key_bias``, -inf for those keys), K and V (from batch row ``kv_batch``,
    ``_cache_row``)."""
    KEYS: gl.constexpr = p.WALK == tiles.WALK_KEYS
    SCORED: gl.constexpr = keys_scored(p.BIAS, p.MASK, p.WALK, p.STAGED_BIAS)
    STAGES_KEY_BIAS: gl.constexpr = key_bias_staged(p.BIAS, p.STAGED_BIAS)
    key_layout: gl.constexpr = gl.BlockedLayout([p.BLOCK_N // 32], [32], [1], [0])
    tile, partial = tile_at(p, it, j)
    first_key = tile * p.BLOCK_N
    key_row = span.k_start + first_key  # the row of K and V that holds the tile's first key
    if p.CACHE == CACHE_PAGES:  # the tile lies within one page: ``dispatch.form_of`` wants pages of whole tiles
        page = gl.load(p.BlockTable + it.batch.to(gl.int64) * p.stride_table + key_row // p.page_size)
        key_row = gl.minimum(gl.maximum(page, 0), p.cache_last) * p.page_size + key_row % p.page_size
    first_row = it.row_block * p.BLOCK_M
    if p.MASK == MASK_INTERVALS:  # the keys' rows, for a PARTIAL tile; read before the wait, as the scores
        row_keys = first_key + gl.arange(0, p.BLOCK_N, gl.SliceLayout(0, _row_words_layout(p.BLOCK_N)))
        start, end = interval_rows(p, mask_row, row_keys, (row_keys < span.seqlen_k) & partial)
        # A tile whose keys each keep all of the item's rows or none: -inf in the dropped keys' scores.
        last_row = gl.minimum(first_row + p.BLOCK_M, span.seqlen_q)
        whole, none = rows_kept_whole(start, end, first_row, last_row)
        whole = partial & whole
        dropped = none & whole
        partial = partial & ~whole
    if SCORED or STAGES_KEY_BIAS:  # read before waiting for the buffer: the loads overlap the wait
        keys = first_key + gl.arange(0, p.BLOCK_N, key_layout)  # [BLOCK_N]
        key_ok = keys < span.seqlen_k
        if KEYS:  # slots of the key list: kept positions (ascending) up to its kept count
            key_ok = keys < it.key_limit
            keys = gl.load(it.lists + keys, mask=key_ok, other=0)
            first_key = gl.min(gl.where(key_ok, keys, span.seqlen_k), 0)
        bias_keys = keys
        if p.CACHE == CACHE_PAGES:  # a paged cache's bias lies in the pool, beside its keys
            bias_keys = key_row + gl.arange(0, p.BLOCK_N, key_layout)
        # The key scores (the bias in log2 units), or the bias in its own dtype as the operand; -inf
        # for a dropped key, in place of its bias, which may be inf or NaN.
        scores = gl.full([p.BLOCK_N], 0.0, gl.float32, key_layout)  # [BLOCK_N]
        if p.BIAS == BIAS_KEYS:
            scores = gl.load(bias_row + bias_keys * p.stride_bk, mask=key_ok, other=0.0)
            if not STAGES_KEY_BIAS:
                scores = scores.to(gl.float32) * tiles.LOG2E
        if p.MASK == MASK_KEYS:
            key_ok = key_ok & (gl.load(mask_row + keys * p.stride_mk, mask=key_ok & partial, other=1) != 0)
        if p.MASK == MASK_INTERVALS:
            key_ok = key_ok & ~gl.convert_layout(dropped, key_layout)
        scores = gl.where(key_ok, scores, float("-inf"))
    stage = loaded % p.KV_STAGES
    phase = (loaded // p.KV_STAGES) & 1 ^ 1
    # K (with the tile's number and key scores) and V have rings of their own: K is free once
    # S = Q K^T is done, a tile before V.
    kv_bytes: gl.constexpr = p.k_desc.block_type.nbytes
    mbarrier.wait(bufs.k_empty.index(stage), phase)
    # The span of the tile's key positions: a key list's first and last kept ones, else the tile number.
    put(bufs.spans.index(stage), first_key if KEYS else tile)
    if KEYS:
        put(bufs.spans.index(p.KV_STAGES + stage), gl.max(keys, 0))
        bufs.positions.index(stage).store(keys)
    if p.MASK == MASK_INTERVALS:
        if partial:
            _store_row_words(p, bufs, stage, start, end, first_row)
    if tests_pairs(p.MASK):
        put(bufs.partial.index(stage), partial.to(gl.int32))
    if SCORED:
        bufs.key_scores.index(stage).store(scores)
    if STAGES_KEY_BIAS:
        _store_key_bias(bufs.bias.index(stage), scores)
    # A BitMask's words and a per-pair bias come with K: the math warpgroups read them with S.
    words_bytes: gl.constexpr = p.words_desc.block_type.nbytes if words_staged(p.MASK, p.BLOCK_N) else 0
    bias_bytes: gl.constexpr = p.bias_desc.block_type.nbytes if pair_bias_staged(p.BIAS, p.STAGED_BIAS) else 0
    k_bytes: gl.constexpr = kv_bytes + words_bytes + bias_bytes
    expect_after_stores(bufs.k_ready.index(stage), k_bytes)
    tma_load(p.k_desc, [kv_batch, key_row, kv_head, 0], bufs.k_ready.index(stage), bufs.k.index(stage))
    if words_staged(p.MASK, p.BLOCK_N):
        row = staged_pair_row(p.Mask, p.stride_mb, p.stride_mh, p.stride_mq, p.mask_head_div, it.batch, it.head, first_row)
        tma_load(p.words_desc, [row, tile * (p.BLOCK_N // WORD_BITS)], bufs.k_ready.index(stage), bufs.words.index(stage))
    if pair_bias_staged(p.BIAS, p.STAGED_BIAS):
        row = staged_pair_row(p.Bias, p.stride_bb, p.stride_bh, p.stride_bq, p.bias_head_div, it.batch, it.head, first_row)
        tma_load(p.bias_desc, [row, tile * p.BLOCK_N], bufs.k_ready.index(stage), bufs.bias.index(stage))
    mbarrier.wait(bufs.v_empty.index(stage), phase)
    mbarrier.expect(bufs.v_ready.index(stage), kv_bytes)
    if p.FP8:  # V transposed: [B * Hkv, D, Sk]
        v_tile = [span.tokens * (p.num_heads // p.group) + kv_head, 0, key_row]
    else:
        v_tile = [kv_batch, key_row, kv_head, 0]
    tma_load(p.v_desc, v_tile, bufs.v_ready.index(stage), bufs.v.index(stage))


@gluon.jit
def _store_key_bias(slot, key_bias):
    """A K tile's per-key bias ``[BLOCK_N]`` into its ring slot as the B operand of the product
    that adds it to ``S`` (``adds_key_bias_by_mma``), ``[BLOCK_N, KEY_BIAS_COLUMNS]``: each key's
    bias in columns 0 and 1, which meet the weights' two parts (``forward._key_bias_weights``),
    zeros elsewhere. Fenced: the tensor cores read it through the async proxy, once the barrier
    that the loader arrives on next hands it over (``expect_after_stores``)."""
    BLOCK_N: gl.constexpr = key_bias.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32, KEY_BIAS_COLUMNS], [32, 1], [1, 1], [1, 0])
    columns = gl.arange(0, KEY_BIAS_COLUMNS, gl.SliceLayout(0, layout))  # [KEY_BIAS_COLUMNS]
    key_bias = gl.convert_layout(key_bias, gl.SliceLayout(1, layout))  # the same lanes and registers
    zeros = gl.zeros([BLOCK_N, KEY_BIAS_COLUMNS], key_bias.dtype, layout)
    slot.store(gl.where(columns[None, :] < 2, key_bias[:, None], zeros))  # [BLOCK_N, KEY_BIAS_COLUMNS]
    fence_async_shared()


@gluon.jit
def _load_item(p, bufs, index, items_done, loaded):
    """Work item ``index``, the program's ``items_done``-th, for ``load_partition``: its tile count
    and Q (and the gradient's rows), then its key tiles from ring position ``loaded``. Returns the
    ring position after it."""
    q_bytes: gl.constexpr = p.q_desc.block_type.nbytes * (2 if p.GRADIENT else 1)
    Q_SLOTS: gl.constexpr = bufs.q.shape[0]  # two, so that the next item's Q loads during this one; one at D = 256
    row_layout: gl.constexpr = gl.BlockedLayout([p.BLOCK_M // 32], [32], [1], [0])

    it, span = _item(p, index)
    kv_batch = _cache_row(p, it.batch, span)
    bias_batch = it.batch
    if p.SEQ == tiles.SEQ_CACHE:  # a cache's bias is stored with its keys
        bias_batch = kv_batch
    bias_row = input_base(p.Bias, p.stride_bb, p.stride_bh, p.bias_head_div, bias_batch, it.head)
    mask_row = input_base(p.Mask, p.stride_mb, p.stride_mh, p.mask_head_div, it.batch, it.head)
    count = tile_count(it)
    q_slot = items_done % Q_SLOTS
    if p.GRADIENT:
        rows = it.row_block * p.BLOCK_M + gl.arange(0, p.BLOCK_M, row_layout)  # [BLOCK_M]
        # LSE and delta are [B, H, Sq] (packed: [1, H, total]); the entry's rows start at q_start.
        row_offset = (span.tokens * p.num_heads + it.head).to(gl.int64) * p.seqlen_q + span.q_start
        lse, delta = row_statistics(p, row_offset, rows, bias_row, span.seqlen_q)
    mbarrier.wait(bufs.q_empty.index(q_slot), (items_done // Q_SLOTS) & 1 ^ 1)
    put(bufs.indices.index(q_slot), index)
    put(bufs.counts.index(q_slot), count)
    if p.GRADIENT:
        bufs.lse.index(q_slot).store(lse)
        bufs.delta.index(q_slot).store(delta)
    expect_after_stores(bufs.q_ready.index(q_slot), q_bytes)
    row_tile = [span.tokens, span.q_start + it.row_block * p.BLOCK_M, it.head, 0]
    tma_load(p.q_desc, row_tile, bufs.q_ready.index(q_slot), bufs.q.index(q_slot))
    if p.GRADIENT:
        tma_load(p.do_desc, row_tile, bufs.q_ready.index(q_slot), bufs.do.index(q_slot))
    kv_head = it.head // p.group
    for j in range(count):
        _load_key_tile(p, bufs, it, span, j, loaded, bias_row, mask_row, kv_head, kv_batch)
        loaded += 1
    return loaded


@gluon.jit
def _first_item(p):
    """The program's first work item: in turn, its own number; QUEUED, the queue's next. A queue
    serves a kernel whose programs start at different times, as dQ's do behind dK/dV
    (``dq.hopper_dq``): each takes items while it runs, and none is left a fixed share to finish
    after the others."""
    index = gl.program_id(0)
    if p.QUEUED:
        index = gl.atomic_add(p.Queue, 1)
    return index


@gluon.jit
def _next_item(p, index):
    """The program's work item after ``index`` (``_first_item``)."""
    if p.QUEUED:
        index = gl.atomic_add(p.Queue, 1)
    else:
        index += gl.num_programs(0)
    return index


@gluon.jit
def load_partition(p, bufs):
    """One warp: for each work item its number, tile count and Q (with GRADIENT also dO, and the
    rows' LSEs in log2 units and deltas), then its key tiles (``_load_key_tile``); after the last,
    a slot whose number is ``p.items`` (``taken_item``)."""
    Q_SLOTS: gl.constexpr = bufs.q.shape[0]
    loaded = 0  # K/V tiles so far: the ring position
    items_done = 0
    index = _first_item(p)
    while index < p.items:
        loaded = _load_item(p, bufs, index, items_done, loaded)
        items_done += 1
        index = _next_item(p, index)
    q_slot = items_done % Q_SLOTS
    mbarrier.wait(bufs.q_empty.index(q_slot), (items_done // Q_SLOTS) & 1 ^ 1)
    put(bufs.indices.index(q_slot), p.items)
    mbarrier.arrive(bufs.q_ready.index(q_slot), count=1)


# -- what the math warpgroups of the forward and dQ kernels read back ------------------------------


@gluon.jit
def taken_item(bufs, items_done):
    """The number of the program's ``items_done``-th work item, once the loader has staged it
    (``load_partition``; ``p.items``: there are no more)."""
    Q_SLOTS: gl.constexpr = bufs.q.shape[0]
    q_slot = items_done % Q_SLOTS
    mbarrier.wait(bufs.q_ready.index(q_slot), (items_done // Q_SLOTS) & 1)
    return get(bufs.indices.index(q_slot))


@gluon.jit
def take_rows(p, bufs, index, items_done, HALF: gl.constexpr, rows_layout: gl.constexpr):
    """Work item ``index`` for warpgroup ``HALF``, staged in Q slot ``items_done`` modulo the
    slots (``taken_item``): ``(batch, head, first_row, rows, q_slot, count, span)``, ``rows`` its
    64 rows in ``rows_layout`` (positions in the entry), ``count`` its key tiles and ``span`` its
    entry's :class:`Span`."""
    ROWS: gl.constexpr = p.BLOCK_M // 2
    Q_SLOTS: gl.constexpr = bufs.q.shape[0]
    row_block, batch, head = _item_position(p, index)
    span = entry_span(p, batch)
    first_row = row_block * p.BLOCK_M + HALF * ROWS
    rows = first_row + gl.arange(0, ROWS, rows_layout)  # [ROWS]
    q_slot = items_done % Q_SLOTS
    return batch, head, first_row, rows, q_slot, get(bufs.counts.index(q_slot)), span


@gluon.jit
def store_rows(p, bufs, q_slot, HALF: gl.constexpr, span, first_row, head, values):
    """A warpgroup's output rows, ``values`` ``[ROWS, D]`` from its entry's row ``first_row`` on,
    into ``p.Out`` ``[B, Sq, H, D]`` (rows past the entry's end are left alone), then its half of Q
    slot ``q_slot`` released.

    They leave through shared memory and a TMA store: stored from registers, the rows took about
    4 us per work item at D = 128, a fifth of a 16K keep-1/8 item (docs/design-notes.md, "Hopper
    forward"). Rows of Q's dtype go through the warpgroup's half of the Q tile, whose last product
    is done (the loader refills the slot once the store has read it); FP8 inputs' bfloat16 rows,
    wider than the e4m3 Q tile, through the forward's own output tile (``bufs.out_tile``). The TMA store
    clips rows only at the tensor's end: a packed sequence's last rows, which the next sequence
    follows, are stored from registers, as is a float32 dQ (summed over several calls).
    """
    ROWS: gl.constexpr = p.BLOCK_M // 2
    if p.Out.dtype.element_ty == p.q_desc.dtype or p.FP8:
        if p.FP8:
            tile = bufs.out_tile  # [1, BLOCK_M, 1, D]
        else:
            tile = bufs.q.index(q_slot)  # [1, BLOCK_M, 1, D]
        if p.SEQ == tiles.SEQ_PACKED:
            if first_row + ROWS <= span.seqlen_q:
                _store_rows_tma(p, tile, HALF, span, first_row, head, values)
            else:
                _store_rows_registers(p, span, first_row, head, values)
        else:
            _store_rows_tma(p, tile, HALF, span, first_row, head, values)
    else:
        _store_rows_registers(p, span, first_row, head, values)
    mbarrier.arrive(bufs.q_empty.index(q_slot), count=1)


@gluon.jit
def _store_rows_tma(p, tile, HALF: gl.constexpr, span, first_row, head, values):
    """``store_rows`` through the warpgroup's half of ``tile`` ``[1, BLOCK_M, 1, D]`` and a TMA store."""
    ROWS: gl.constexpr = p.BLOCK_M // 2
    tile.reshape([p.BLOCK_M, p.HEAD_DIM]).slice(HALF * ROWS, ROWS).store(values.to(p.o_desc.dtype))
    fence_async_shared()
    tma_store(p.o_desc, [span.tokens, span.q_start + first_row, head, 0], tile.slice(HALF * ROWS, ROWS, dim=1))
    tma.store_wait(0)


@gluon.jit
def _store_rows_registers(p, span, first_row, head, values):
    """``store_rows`` from registers, rows past the entry's end and columns past the head dim left out."""
    ROWS: gl.constexpr = p.BLOCK_M // 2
    layout: gl.constexpr = values.type.layout
    rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, p.HEAD_DIM, gl.SliceLayout(0, layout))
    ptrs = (
        p.Out + span.tokens.to(gl.int64) * p.stride_ob + head.to(gl.int64) * p.stride_oh
        + ((span.q_start + rows).to(gl.int64) * p.stride_os)[:, None] + cols[None, :]
    )
    gl.store(ptrs, values.to(p.Out.dtype.element_ty), mask=(rows < span.seqlen_q)[:, None] & (cols < p.COLUMNS)[None, :])


@gluon.jit
def staged_keys(p, bufs, stage, keys_layout: gl.constexpr):
    """What the loader staged with the K tile at ring position ``stage``: ``(first_key, last_key,
    key_scores)``, the span of its key positions and its key scores ``[BLOCK_N]``."""
    KEYS: gl.constexpr = p.WALK == tiles.WALK_KEYS
    if KEYS:
        first_key = get(bufs.spans.index(stage))
        last_key = get(bufs.spans.index(p.KV_STAGES + stage))
    else:  # the tile's own BLOCK_N keys
        first_key = get(bufs.spans.index(stage)) * p.BLOCK_N
        last_key = first_key + p.BLOCK_N - 1
    key_scores = gl.zeros([p.BLOCK_N], gl.float32, keys_layout)  # unread where there are none
    if keys_scored(p.BIAS, p.MASK, p.WALK, p.STAGED_BIAS):
        key_scores = bufs.key_scores.index(stage).load(keys_layout)
    return first_key, last_key, key_scores


@gluon.jit
def wait_for_scores(p, bufs, qk, pending: gl.constexpr, stage, keys_layout: gl.constexpr, READ_KEYS_EARLY: gl.constexpr):
    """Wait for the product ``qk`` (``pending`` later products may still run) and read what the
    loader staged with its K tile (``staged_keys``): ``(qk, staged)``. With ``READ_KEYS_EARLY``
    the shared-memory reads are issued before the wait, so their latency overlaps the product;
    whether that pays depends on where ptxas then places them (the callers say)."""
    if READ_KEYS_EARLY:
        staged = staged_keys(p, bufs, stage, keys_layout)
    qk = warpgroup_mma_wait(pending, deps=[qk])
    if not READ_KEYS_EARLY:
        staged = staged_keys(p, bufs, stage, keys_layout)
    return qk, staged


@gluon.jit
def _tanh(x, APPROXIMATE: gl.constexpr):
    """tanh of a float32 tile. APPROXIMATE: the hardware's ``tanh.approx.f32`` (relative error
    2^-11, one special-function instruction, as FlashAttention-3 and FlexAttention's examples use it);
    else as ``tiles.tanh`` (the Triton kernels'), odd-symmetric, neither overflowing nor losing
    precision near 0, its division approximate (2 ulp): two special-function instructions and five
    others, which set the softmax warpgroups' pace (docs/design-notes.md, "Softcap on the Hopper
    kernels")."""
    if APPROXIMATE:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)
    else:
        e = gl.exp2(gl.abs(x) * (-2.0 * tiles.LOG2E))
        t = gl.fdiv(1.0 - e, 1.0 + e, ieee_rounding=False)
        t = gl.where(x < 0, -t, t)
    return t


@gluon.jit
def _approximate_tanh(p):
    """Whether softcap takes the hardware tanh: for bfloat16 inputs, whose rounding of the
    probabilities (2^-9) exceeds the tanh's error; float16 (2^-12) keeps the exact form."""
    return p.q_desc.dtype == gl.bfloat16


@gluon.jit
def log2_scores(p, qk):
    """Log2-domain scores of a product tile ``qk``: ``scale * qk``, or with SOFTCAP
    ``softcap * tanh(scale * qk / softcap)`` (``tiles.scores_log2``)."""
    if p.SOFTCAP:
        s = _tanh(qk * p.scale_over_cap, _approximate_tanh(p)) * p.softcap_log2
    else:
        s = qk * p.scale_log2
    return s


@gluon.jit
def softcap_slope(p, qk):
    """The derivative of the capped score by the uncapped one at ``qk``, ``1 - tanh²``: dS times it
    is the gradient of ``scale * q.k`` (the bias, added after the cap, takes dS itself)."""
    t = _tanh(qk * p.scale_over_cap, _approximate_tanh(p))
    return 1.0 - t * t


@gluon.jit
def visible_scores(
    p, bufs, qk, staged, stage, batch, head, span, first_row, rows, keys_layout: gl.constexpr, ROWS: gl.constexpr,
    HALF: gl.constexpr,
):
    """Log2-domain scores of (``batch``, ``head``)'s product tile ``qk`` ``[ROWS, BLOCK_N]``, rows
    ``HALF`` of the work item's two halves (of an entry whose :class:`Span` is ``span``): the tile's staged key scores added, a per-pair bias
    added (staged by the loader, or loaded here) and a BitMask's bits or key intervals applied
    (only on the tiles the loader marked), and -inf where the band or the end of the keys cuts it (only edge tiles
    are checked: those whose span of key positions the band or the end cuts). ``staged`` is
    ``staged_keys(p, bufs, stage, keys_layout)``."""
    KEYS: gl.constexpr = p.WALK == tiles.WALK_KEYS
    first_key, last_key, key_scores = staged
    s = log2_scores(p, qk)
    if keys_scored(p.BIAS, p.MASK, p.WALK, p.STAGED_BIAS):
        s = s + key_scores[None, :]
    if pair_bias_staged(p.BIAS, p.STAGED_BIAS):
        s = s + bufs.bias.index(stage).slice(HALF * ROWS, ROWS).load(qk.type.layout).to(gl.float32) * tiles.LOG2E
    elif p.BIAS == BIAS_PAIRS:
        if KEYS:
            keys = bufs.positions.index(stage).load(keys_layout)  # [BLOCK_N]
        else:
            keys = first_key + gl.arange(0, p.BLOCK_N, keys_layout)
        s = s + pair_bias(p, batch, head, rows, keys, False)
    if p.MASK == MASK_BITS:
        if get(bufs.partial.index(stage)) != 0:
            words = None
            if words_staged(p.MASK, p.BLOCK_N):
                words = bufs.words.index(stage).slice(HALF * ROWS, ROWS)
            s = kept_by_bits(p, s, words, batch, head, first_row, first_key, False)
    if p.MASK == MASK_INTERVALS:
        if get(bufs.partial.index(stage)) != 0:
            WORDS: gl.constexpr = ROWS // WORD_BITS
            s = kept_by_row_words(s, bufs.words.index(stage).slice(HALF * WORDS, WORDS))
    edge = (first_key - first_row - ROWS + 1 < span.band_lo) | (last_key - first_row > span.band_hi) | (last_key >= span.seqlen_k)
    if edge:
        if KEYS:
            keys = bufs.positions.index(stage).load(keys_layout)  # [BLOCK_N]
        else:
            keys = first_key + gl.arange(0, p.BLOCK_N, keys_layout)
        offset = keys[None, :] - rows[:, None]
        visible = (keys < span.seqlen_k)[None, :] & (offset >= span.band_lo) & (offset <= span.band_hi)
        s = gl.where(visible, s, float("-inf"))
    return s

