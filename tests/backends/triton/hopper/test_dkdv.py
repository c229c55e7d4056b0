"""``hopper/dkdv.count_columns``: the work of each dK/dV column, counted on the device so that the
mask's real density picks the query chunks (``_counted_chunks``), against the same count made
from the block states on the host; the chunk sums' rows that the preprocess zeroes, those the
kernel adds to (``column_live``); and ``write_gradients``, which writes dK and dV from their
chunks' fp32 parts, reading those rows alone.

All are plain Triton: they run in the interpreter here. They run in the backward's preprocess
(``backward._preprocess``) and after the Hopper dK/dV on the GPU
(``tests/backends/triton/test_backward_hopper.py`` runs those).
"""

import pytest
import torch

from flash_dma import build_block_mask
from flash_dma.backends.triton import tiles
from flash_dma.backends.triton.hopper.common import launch_band
from flash_dma.backends.triton.backward import _preprocess, _Workspace
from flash_dma.backends.triton.hopper.dkdv import TILE, live_walk, sums_shape, sums_view, write_gradients
from flash_dma.backends.triton.key_list import build_key_list
from flash_dma.backends.triton.layout import call_signature
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
    delta = _preprocess(call, out, dout, workspace, True, None, ("test_count_columns", str(case)))
    assert workspace[3:].view(torch.float32).tolist() == [0.0] * (workspace.numel() - 3)
    longest, total = _expected(call, summary)
    assert total > longest > 0  # the cases have several working columns
    assert workspace[:3].tolist() == [0, longest, total]
    expected_delta = (out.float() * dout.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    torch.testing.assert_close(delta, expected_delta, rtol=1e-5, atol=1e-5)


def _key_list(batch: int, heads: int, seqlen_k: int, kept: list[int]) -> torch.Tensor:
    """The key list of a per-key mask ``[batch, heads, 1, seqlen_k]`` whose row ``i`` keeps
    ``kept[i]`` keys drawn at random."""
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    mask = torch.zeros(batch * heads, seqlen_k, dtype=torch.bool, device=DEVICE)
    for row, count in enumerate(kept):
        mask[row, torch.randperm(seqlen_k, generator=generator, device=DEVICE)[:count]] = True
    return build_key_list(mask.view(batch, heads, 1, seqlen_k), seqlen_k)


def _zeroed_sums(call) -> torch.Tensor:
    """Which words of the chunk sums ``[2, B, Hkv, Sk, D]`` the preprocess of ``call`` zeroes (the
    others it leaves alone); a part placed after them (a bias gradient's buffer) it zeroes whole."""
    space = _Workspace.of({"sums": (torch.float32, (2, *sums_shape(call))), "dbias": (torch.float32, (1, 1, 2, 1, 999))})
    workspace, parts = space.allocate(call.q.device)
    workspace.fill_(-1)
    out, dout = torch.randn_like(call.q), torch.randn_like(call.q)
    walk = live_walk(call, None)
    _preprocess(call, out, dout, workspace, False, (space.first_word("sums"), walk), call_signature(call))
    sums = parts["sums"].view(torch.int32)
    assert ((sums == 0) | (sums == -1)).all() and (workspace[:32] == 0).all() and (parts["dbias"] == 0).all()
    return sums == 0


def test_the_preprocess_zeroes_the_kept_rows_of_a_key_lists_sums():
    # Runs of 1024 slots x 32 columns, zeroed 128 slots a program. Kept counts that end inside a
    # program, at a program's end, none, and all.
    batch, heads, kv_heads, seqlen_k, head_dim = 2, 4, 2, 1024, 32
    kept = [100, 128, 0, 1024]
    case = Case(batch=batch, seqlen_q=64, seqlen_k=seqlen_k, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    call = kernel_call(make_inputs(case, KERNEL_DTYPES[0]), key_list=_key_list(batch, kv_heads, seqlen_k, kept), softmax_scale=0.25)
    zeroed = _zeroed_sums(call).view(2, batch * kv_heads, seqlen_k, head_dim)
    for run, count in enumerate(kept):
        assert zeroed[:, run, :count].all()  # the kept slots' rows, which the kernel adds to
    # Only programs of dropped slots alone are left out: all but the first of the first two runs', and every one of the third's.
    programs = zeroed.view(2, batch * kv_heads, 8, -1).any(-1)
    assert programs.tolist() == [[[True] + [False] * 7, [True] + [False] * 7, [False] * 8, [True] * 8]] * 2


def test_the_preprocess_zeroes_the_working_columns_of_a_summarys_sums():
    # Key blocks of 128 kept per key/value head, causal: a column works if some query tile of
    # the band lists its block. Two programs of 4096 words per column (128 slots x 64 columns).
    batch, heads, kv_heads, seqlen, head_dim = 1, 4, 2, 1024, 64
    case = Case(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, heads=heads, kv_heads=kv_heads, head_dim=head_dim, causal=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    kept_blocks = torch.tensor([[1, 0, 0, 1, 0, 0, 0, 1], [0, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.bool, device=DEVICE)  # [Hkv, key blocks]
    mask = kept_blocks.repeat_interleave(128, dim=1).view(1, kv_heads, 1, seqlen)
    summary = build_block_mask(mask, block_size=(128, 128))
    call = kernel_call(inputs, summary, softmax_scale=0.25, window=(seqlen, 0))
    zeroed = _zeroed_sums(call).view(2, kv_heads, seqlen // 128, -1)  # [2, Hkv, key tiles, words]
    assert zeroed.all(-1).eq(zeroed.any(-1)).all()  # whole columns
    assert zeroed.any(-1).tolist() == [kept_blocks.tolist()] * 2


@pytest.mark.parametrize("dtype", [KERNEL_DTYPES[-1], torch.float32], ids=str)
@pytest.mark.parametrize("chunks", [None, 1, 3], ids=lambda c: "atomics" if c is None else f"{c}-slices")
def test_write_gradients_sums_the_chunks_in_order(chunks, dtype):
    shape = (2, 37, 3, 16)  # [B, Sk, Hkv, D]: not a multiple of a program's slots
    parts = (2,) if chunks is None else (2, chunks)
    # Parts of mixed magnitudes, so that another order of the additions rounds differently in float32.
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    sums = torch.randn(*parts, *shape, device=DEVICE, generator=generator) * 10.0 ** torch.randint(
        -4, 5, (*parts, *shape), device=DEVICE, generator=generator,
    )
    dk, dv = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    case = Case(batch=shape[0], seqlen_q=8, seqlen_k=shape[1], heads=shape[2], kv_heads=shape[2], head_dim=shape[3])
    call = kernel_call(make_inputs(case, torch.float32), softmax_scale=0.25)
    write_gradients(sums, dk, dv, call, live_walk(call, None), call_signature(call))
    added = sums if chunks is None else sums[:, 0].clone()
    for c in range(1, chunks or 1):  # in chunk order
        added += sums[:, c]
    assert torch.equal(dk, added[0].to(dk.dtype)) and torch.equal(dv, added[1].to(dv.dtype))


@pytest.mark.parametrize("list_heads", [1, 3], ids=lambda h: f"list-heads{h}")
@pytest.mark.parametrize("chunks", [None, 3], ids=lambda c: "atomics" if c is None else f"{c}-slices")
def test_write_gradients_puts_a_key_lists_slots_at_their_keys(chunks, list_heads):
    batch, seqlen_k, kv_heads, head_dim, group = 2, 37, 3, 16, 2
    key_list = _key_list(batch, list_heads, seqlen_k, [5, 0, 37, 32, 1, 17][: batch * list_heads])
    case = Case(batch=batch, seqlen_q=8, seqlen_k=seqlen_k, heads=kv_heads * group, kv_heads=kv_heads, head_dim=head_dim)
    call = kernel_call(make_inputs(case, torch.float32), key_list=key_list, softmax_scale=0.25)
    parts = (2,) if chunks is None else (2, chunks)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    sums = sums_view(torch.randn(*parts, *sums_shape(call), device=DEVICE, generator=generator))  # [2, ., B, Sk, Hkv, D]
    order, rank = key_list[:, :, 0, :seqlen_k], key_list[:, :, 1, seqlen_k]  # [Bm, Hm, Sk], [Bm, Hm]
    expected = torch.zeros(2, batch, seqlen_k, kv_heads, head_dim, device=DEVICE)
    for b in range(batch):
        for h in range(kv_heads):
            row = (b, h * list_heads // kv_heads)
            kept = int(rank[row])
            slot_sums = sums[..., b, :kept, h, :] if chunks is None else sums[:, 0, b, :kept, h, :].clone()
            for c in range(1, chunks or 1):
                slot_sums += sums[:, c, b, :kept, h, :]
            expected[:, b, order[row][:kept].long(), h] = slot_sums
            sums[..., b, kept:, h, :] = float("nan")  # the dropped slots' rows are never read
    dk, dv = (torch.full((batch, seqlen_k, kv_heads, head_dim), float("nan"), device=DEVICE) for _ in range(2))
    write_gradients(sums, dk, dv, call, live_walk(call, None), call_signature(call))
    assert torch.equal(dk, expected[0]) and torch.equal(dv, expected[1])


def test_write_gradients_reads_a_summarys_working_columns_alone():
    batch, heads, kv_heads, seqlen, head_dim = 1, 2, 2, 512, 16
    case = Case(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    kept_blocks = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 1]], dtype=torch.bool, device=DEVICE)  # [Hkv, key blocks]
    mask = kept_blocks.repeat_interleave(128, dim=1).view(1, kv_heads, 1, seqlen)
    call = kernel_call(make_inputs(case, torch.float32), build_block_mask(mask, block_size=(128, 128)), softmax_scale=0.25)
    sums = sums_view(torch.randn(2, *sums_shape(call), device=DEVICE))  # [2, B, Sk, Hkv, D]
    working = kept_blocks.t().repeat_interleave(128, dim=0)[None, :, :, None]  # [1, Sk, Hkv, 1]
    expected = torch.where(working, sums, 0.0)
    sums.masked_fill_(~working, float("nan"))  # the idle columns' rows are never read
    dk, dv = (torch.full((batch, seqlen, kv_heads, head_dim), float("nan"), device=DEVICE) for _ in range(2))
    write_gradients(sums, dk, dv, call, live_walk(call, None), call_signature(call))
    assert torch.equal(dk, expected[0]) and torch.equal(dv, expected[1])
