"""``hopper/dq``'s configuration: which key tiles a call takes (``_tile``), and the rings
(``RINGS``) that each tile's shared memory holds.

Plain Python: it runs on the CPU. The kernels themselves run in
``tests/backends/triton/test_backward_hopper.py`` (sm90).
"""

import pytest
import torch

from flash_dma import build_block_mask
from flash_dma.backends.triton.hopper.common import FORWARD_HEAD_DIMS, head_dim_tile
from flash_dma.backends.triton.hopper.dq import RINGS, SMALL_TILE, STAGED_BIAS_RINGS, TILE, WIDE_TILE, _rings, _tile
from flash_dma.backends.triton.layout import SEQ_CACHE, SEQ_PACKED, Sequences
from flash_dma.backends.triton.tiles import WALK_BLOCKS, WALK_DENSE
from tests.helpers import Case, kernel_call, make_inputs

SHARED_MEMORY = 232_448  # bytes a block may have on sm90
PER_KEY = "B,Hkv,1,Sk"


def _call(case: Case, softcap: float = 0.0):
    inputs = make_inputs(case, torch.float16)
    summary = build_block_mask(inputs["attn_mask"], block_size=case.block_size) if case.block_size else None
    return kernel_call(inputs, summary, softmax_scale=0.125, softcap=softcap)


def _sequences(kind: int) -> Sequences:
    lengths = torch.tensor([0, 100, 250], dtype=torch.int32)
    return Sequences(kind, lengths, lengths, 2, 150, 150)


BLOCKS = Case(seqlen_q=300, seqlen_k=400, head_dim=128, mask=PER_KEY, bias=PER_KEY, mask_kind="blocks", causal=True, block_size=(128, 128))


@pytest.mark.parametrize(
    "case, softcap, sequences, expected",
    [
        (BLOCKS, 0.0, None, TILE),
        (BLOCKS.with_(head_dim=64), 0.0, None, TILE),
        (Case(seqlen_q=300, seqlen_k=400, head_dim=128, bias=PER_KEY), 0.0, None, TILE),
        (BLOCKS.with_(block_size=(128, 64)), 0.0, None, SMALL_TILE),
        (BLOCKS, 5.0, None, SMALL_TILE),
        (Case(seqlen_q=300, seqlen_k=400, head_dim=64, bias="B,H,Sq,Sk"), 0.0, None, TILE),
        (Case(seqlen_q=300, seqlen_k=400, head_dim=64, bias="B,H,Sq,Sk", bias_fp32=True), 0.0, None, SMALL_TILE),
        (Case(seqlen_q=300, seqlen_k=400, head_dim=128, bias="B,H,Sq,Sk"), 0.0, None, SMALL_TILE),
        (BLOCKS, 0.0, _sequences(SEQ_PACKED), SMALL_TILE),
        (BLOCKS, 0.0, _sequences(SEQ_CACHE), TILE),
        (BLOCKS.with_(head_dim=256), 0.0, None, WIDE_TILE),
        (BLOCKS.with_(head_dim=192), 5.0, _sequences(SEQ_PACKED), WIDE_TILE),
    ],
    ids=[
        "per-key-blocks", "d64", "dense", "64-key-summary", "softcap", "pair-bias-staged", "pair-bias-fp32", "pair-bias-d128",
        "packed", "cache", "d256", "d192",
    ],
)
def test_the_tile_fits_the_calls_form(case, softcap, sequences, expected):
    call = _call(case, softcap)
    assert _tile(call, case.head_dim, sequences, WALK_BLOCKS if case.block_size else WALK_DENSE) is expected


def test_key_intervals_take_tiles_of_128_keys():
    call = _call(BLOCKS)._replace(mask_kind="intervals")
    assert _tile(call, 128, None, WALK_BLOCKS) is TILE


@pytest.mark.parametrize("head_dim", [32, 64])
def test_a_staged_pair_bias_takes_two_stages_of_128_keys_that_fit_shared_memory(head_dim):
    """The loader's [BLOCK_M, BLOCK_N] 16-bit bias tile beside each K/V stage, in the rings of
    ``STAGED_BIAS_RINGS``."""
    call = _call(Case(seqlen_q=300, seqlen_k=400, head_dim=head_dim, bias="B,H,Sq,Sk"))
    stages, slots = _rings(call, head_dim, None, WALK_DENSE)
    assert (stages, slots) == STAGED_BIAS_RINGS
    rows, keys, columns = TILE.kwargs["BLOCK_M"], TILE.kwargs["BLOCK_N"], head_dim_tile(head_dim)
    assert 2 * columns * 2 * (slots * rows + stages * keys) + stages * rows * keys * 2 + 4096 <= SHARED_MEMORY


TILES_OF_HEAD_DIMS = [
    pytest.param(head_dim, tile, id=f"d{head_dim}-{name}")
    for head_dim in FORWARD_HEAD_DIMS
    for name, tile in ((("wide", WIDE_TILE),) if head_dim_tile(head_dim) > 128 else (("128-keys", TILE), ("64-keys", SMALL_TILE)))
]


@pytest.mark.parametrize("head_dim, tile", TILES_OF_HEAD_DIMS)
def test_every_tile_a_head_dim_takes_has_rings_that_fit_shared_memory(head_dim, tile):
    """Q and dO slots of BLOCK_M rows, K and V stages of BLOCK_N keys, 16-bit, with 4 KB left for
    the small rings and barriers (``dq._Buffers``)."""
    columns = head_dim_tile(head_dim)
    stages, slots = RINGS[columns, tile.kwargs["BLOCK_N"]]
    rows, keys = tile.kwargs["BLOCK_M"], tile.kwargs["BLOCK_N"]
    bytes_ = 2 * columns * 2 * (slots * rows + stages * keys)
    assert bytes_ + 4096 <= SHARED_MEMORY
