"""``hopper/dkdv.count_columns``: the work of each dK/dV column, counted on the device so that the
mask's real density picks the query chunks (``_counted_chunks``), against the same count made
from the block states on the host; and ``write_gradients``, which writes dK and dV from their
chunks' fp32 parts.

Both are plain Triton: they run in the interpreter here. ``count_columns`` runs in the backward's
preprocess (``backward._preprocess``), before every counted Hopper dK/dV on the GPU
(``tests/backends/triton/test_backward_hopper.py`` runs those).
"""

import pytest
import torch

from flash_dma import build_block_mask
from flash_dma.backends.triton import tiles
from flash_dma.backends.triton.hopper.common import launch_band
from flash_dma.backends.triton.backward import _preprocess, _Workspace
from flash_dma.backends.triton.hopper.dkdv import TILE, write_gradients
from flash_dma.integers import cdiv
from tests.helpers import DEVICE, KERNEL_DTYPES, Case, kernel_call, make_inputs

CASES = [
    # A per-key mask per key/value head, causal: the group's heads share one walk.
    Case(batch=2, seqlen_q=700, seqlen_k=700, heads=4, kv_heads=2, head_dim=32, mask="B,Hkv,1,Sk", mask_kind="blocks", causal=True, block_size=(128, 128)),
    # A mask per query head in whole tiles, a window on both sides: each head's walk is counted.
    Case(batch=1, seqlen_q=500, seqlen_k=900, heads=4, kv_heads=2, head_dim=32, mask="B,H,Sq,Sk", mask_kind="tiles", window=(100, 3), block_size=(128, 128)),
    # One mask for every head (broadcast), bottom-right causal with Sq < Sk; summary blocks of 4 query tiles and 2 key tiles.
    Case(batch=1, seqlen_q=600, seqlen_k=1000, heads=3, kv_heads=1, head_dim=32, mask="1,1,Sq,Sk", mask_kind="tiles", causal=True, block_size=(256, 256)),
    # 432 columns: ``count_columns`` counts them in two rounds of ``_WORK_COLUMNS``.
    Case(batch=3, seqlen_q=200, seqlen_k=4500, heads=4, kv_heads=4, head_dim=16, mask="B,Hkv,1,Sk", mask_kind="blocks", block_size=(128, 128)),
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
def test_the_preprocess_counts_each_columns_listed_query_tiles(case):
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    summary = build_block_mask(inputs["attn_mask"], block_size=case.block_size)
    window = (case.window[0], 0) if case.causal else case.window
    call = kernel_call(inputs, summary, softmax_scale=0.25, window=window)
    out, dout = torch.randn_like(call.q), torch.randn_like(call.q)
    workspace, _ = _Workspace.of({"sums": (torch.float32, (5, 7))}).allocate(call.q.device)
    workspace.fill_(-1)  # every word is the preprocess's to write
    delta = _preprocess(call, out, dout, workspace, True, ("test_count_columns", str(case)))
    longest, total = _expected(call, summary)
    assert total > longest > 0  # the cases have several working columns
    assert workspace[:3].tolist() == [0, longest, total]
    assert (workspace[3:] == 0).all()
    expected_delta = (out.float() * dout.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    torch.testing.assert_close(delta, expected_delta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [KERNEL_DTYPES[-1], torch.float32], ids=str)
@pytest.mark.parametrize("chunks", [None, 1, 3], ids=lambda c: "atomics" if c is None else f"{c}-slices")
def test_write_gradients_sums_the_chunks_in_order(chunks, dtype):
    shape = (2, 37, 3, 16)  # [B, Sk, Hkv, D]: not a multiple of a program's elements
    parts = (2,) if chunks is None else (2, chunks)
    # Parts of mixed magnitudes, so that another order of the additions rounds differently in float32.
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    sums = torch.randn(*parts, *shape, device=DEVICE, generator=generator) * 10.0 ** torch.randint(
        -4, 5, (*parts, *shape), device=DEVICE, generator=generator,
    )
    dk, dv = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    write_gradients(sums, dk, dv)
    added = sums if chunks is None else sums[:, 0].clone()
    for c in range(1, chunks or 1):  # in chunk order
        added += sums[:, c]
    assert torch.equal(dk, added[0].to(dk.dtype)) and torch.equal(dv, added[1].to(dv.dtype))
