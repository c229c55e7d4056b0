"""``hopper/dkdv.column_work``: the work of each dK/dV column, counted on the device so that the
mask's real density picks the query chunks (``_counted_chunks``), against the same count made
from the block states on the host.

Its kernel is plain Triton: it runs in the interpreter here, before every counted Hopper dK/dV
on the GPU (``tests/backends/triton/test_backward_hopper.py`` runs those).
"""

import pytest
import torch

from flash_dma import build_block_mask
from flash_dma.backends.triton import tiles
from flash_dma.backends.triton.hopper.common import launch_band
from flash_dma.backends.triton.hopper.dkdv import TILE, column_work
from flash_dma.integers import cdiv
from tests.helpers import KERNEL_DTYPES, Case, kernel_call, make_inputs

CASES = [
    # A per-key mask per key/value head, causal: the group's heads share one walk.
    Case(batch=2, seqlen_q=700, seqlen_k=700, heads=4, kv_heads=2, head_dim=32, mask="B,Hkv,1,Sk", mask_kind="blocks", causal=True, block_size=(128, 128)),
    # A mask per query head in whole tiles, a window on both sides: each head's walk is counted.
    Case(batch=1, seqlen_q=500, seqlen_k=900, heads=4, kv_heads=2, head_dim=32, mask="B,H,Sq,Sk", mask_kind="tiles", window=(100, 3), block_size=(128, 128)),
    # One mask for every head (broadcast), bottom-right causal with Sq < Sk; summary blocks of 4 query tiles and 2 key tiles.
    Case(batch=1, seqlen_q=600, seqlen_k=1000, heads=3, kv_heads=1, head_dim=32, mask="1,1,Sq,Sk", mask_kind="tiles", causal=True, block_size=(256, 256)),
]


def _expected(call, summary) -> tuple[int, int]:
    """The longest column's work and the sum over columns: for each (entry, key/value head, key
    tile), the query tiles of the band whose summary block is listed, over the group's heads."""
    batch, seqlen_q, heads = call.q.shape[:3]
    seqlen_k, kv_heads = call.k.shape[1], call.k.shape[2]
    block_m, block_n = TILE.kwargs["BLOCK_M"], TILE.kwargs["BLOCK_N"]
    band_lo, band_hi = launch_band(call, seqlen_q, seqlen_k, tiles.SEQ_FIXED)
    state, (list_q, list_k) = summary.state, summary.block_size
    works = []
    for b in range(batch):
        for kv_head in range(kv_heads):
            for key_tile in range(cdiv(seqlen_k, block_n)):
                k_lo, k_hi = key_tile * block_n, min(key_tile * block_n + block_n, seqlen_k) - 1
                work = 0
                for head in range(kv_head * heads // kv_heads, (kv_head + 1) * heads // kv_heads):
                    blocks = state[b % state.shape[0], head * state.shape[1] // heads]  # [NQB, NKB]
                    column = blocks[:, k_lo // list_k if blocks.shape[1] > 1 else 0]
                    for query_tile in range(cdiv(seqlen_q, block_m)):
                        q_lo, q_hi = query_tile * block_m, min(query_tile * block_m + block_m, seqlen_q) - 1
                        in_band = k_hi - q_lo >= band_lo and k_lo - q_hi <= band_hi
                        listed = column[q_lo // list_q if column.shape[0] > 1 else 0] != 0
                        work += int(in_band and listed)
                works.append(work)
    return max(works), sum(works)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_column_work_counts_each_columns_listed_query_tiles(case):
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    summary = build_block_mask(inputs["attn_mask"], block_size=case.block_size)
    window = (case.window[0], 0) if case.causal else case.window
    call = kernel_call(inputs, summary, softmax_scale=0.25, window=window)
    work = torch.zeros(3, dtype=torch.int32, device=call.q.device)
    column_work(call, call.q_lists, work, TILE, ("test_column_work", str(case)))
    longest, total = _expected(call, summary)
    assert total > longest > 0  # the cases have several working columns
    assert work.tolist() == [0, longest, total]
