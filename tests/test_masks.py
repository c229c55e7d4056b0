"""Dynamic mask builders: token top-k/relu masks, block top-k summaries, and the attended fraction."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_dma import flash_dma_func, flash_dma_topk_func, masks
from flash_dma.backends.reference import visible_positions
from flash_dma.block_mask import EMPTY, FULL, PARTIAL
from flash_dma.masks import attended_fraction, chunked_topk_indices, create_mask, topk_block_mask, topk_indices, topk_mask
from tests.helpers import DEVICE


def brute_force_topk(bias: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the k allowed entries with the largest bias, ties to the lower index, one row at a time."""
    bias, allowed = torch.broadcast_tensors(bias.cpu(), allowed.cpu())
    keep = torch.zeros(bias.shape, dtype=torch.bool)
    for index in torch.nonzero(torch.ones(bias.shape[:-1])):
        row, ok = bias[tuple(index)].tolist(), allowed[tuple(index)].tolist()
        ranked = sorted((j for j in range(len(row)) if ok[j]), key=lambda j: (-row[j], j))
        keep[tuple(index)][ranked[:k]] = True
    return keep


def brute_force_fraction(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> float:
    """Attended causal pairs over causal pairs, from a mask expanded to [Bm, Hm, Sq, Sk]."""
    mask = mask.cpu().expand(*mask.shape[:2], seqlen_q, seqlen_k)
    causal = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
    return ((mask & causal).sum(dim=(2, 3)).double().mean() / causal.sum()).item()


def expand_blocks(summary, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """The block states as elements, [Bm, Hm, Sq or 1, Sk] int8."""
    rows = seqlen_q if summary.mask_shape[2] > 1 else 1
    return summary.dense_rows(0, rows, seqlen_k)


def random_bias(*shape, seed: int = 0, levels: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(*shape, generator=gen)
    if levels is not None:  # few distinct values: many ties
        bias = torch.randint(0, levels, shape, generator=gen).float()
    return bias.to(DEVICE)


class TestCreateMask:
    @pytest.mark.parametrize("bias_shape", [(2, 3, 1, 37), (1, 2, 5, 37), (2, 1, 5, 37)], ids=str)
    @pytest.mark.parametrize("levels", [None, 3], ids=["distinct", "ties"])
    @pytest.mark.parametrize("window", [1, 7, 36])
    def test_topk_matches_brute_force(self, bias_shape, levels, window):
        bias = random_bias(*bias_shape, levels=levels)
        padding = torch.rand(2, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
        mask = create_mask(bias, padding, 2, 5, 37, window)
        assert mask.dtype == torch.bool
        assert mask.shape == torch.broadcast_shapes(bias.shape, (2, 1, 1, 37))
        assert torch.equal(mask.cpu(), brute_force_topk(bias, padding[:, None, None, :], window))

    def test_what_is_not_given_is_inferred_from_the_bias_and_the_mask(self):
        bias = random_bias(2, 3, 5, 37)
        assert torch.equal(create_mask(bias, window_size=7), create_mask(bias, None, 2, 5, 37, 7))
        padding = torch.rand(4, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
        per_key = random_bias(1, 3, 1, 37)
        inferred = create_mask(per_key, padding, window_size=7)  # the batch comes from the padding mask
        assert inferred.shape == (4, 3, 1, 37) and torch.equal(inferred, create_mask(per_key, padding, 4, 1, 37, 7))

    def test_ties_go_to_the_lower_key_index(self):
        bias = torch.zeros(1, 1, 1, 10, device=DEVICE)
        expected = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
        assert torch.equal(create_mask(bias, None, 1, 1, 10, 4)[0, 0, 0].cpu(), expected)
        bias[..., 6:] = 1.0
        expected = torch.tensor([1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
        assert torch.equal(create_mask(bias, None, 1, 1, 10, 6)[0, 0, 0].cpu(), expected)

    @pytest.mark.parametrize("window", [5, 6, 100])
    def test_window_at_least_key_len_keeps_every_allowed_key(self, window):
        bias = random_bias(2, 2, 1, 5)
        padding = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool, device=DEVICE)
        mask = create_mask(bias, padding, 2, 5, 5, window)
        assert torch.equal(mask, padding[:, None, None, :].expand(2, 2, 1, 5))

    def test_masked_keys_are_never_selected(self):
        bias = torch.arange(8.0, device=DEVICE).view(1, 1, 1, 8)  # the largest bias is last
        padding = torch.ones(1, 8, dtype=torch.bool, device=DEVICE)
        padding[0, 5:] = False
        mask = create_mask(bias, padding, 1, 1, 8, 3)
        assert mask[0, 0, 0].nonzero().flatten().tolist() == [2, 3, 4]

    def test_padding_mask_of_query_length_covers_the_newest_keys(self):
        # Decoding with a cache: 3 new queries, 7 keys; the 2-D mask covers the last 3 keys.
        bias = torch.zeros(1, 1, 1, 7, device=DEVICE)
        padding = torch.tensor([[0, 1, 1]], device=DEVICE)
        mask = create_mask(bias, padding, 1, 3, 7, 7)
        assert mask[0, 0, 0].int().tolist() == [1, 1, 1, 1, 0, 1, 1]

    def test_integer_padding_mask_equals_bool(self):
        bias = random_bias(2, 2, 1, 20)
        padding = torch.rand(2, 20, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.5
        assert torch.equal(create_mask(bias, padding.int(), 2, 1, 20, 6), create_mask(bias, padding, 2, 1, 20, 6))

    def test_4d_mask_is_intersected(self):
        bias = random_bias(1, 2, 1, 12)
        mask_4d = torch.ones(1, 1, 3, 12, dtype=torch.bool, device=DEVICE).tril(9)
        mask = create_mask(bias, mask_4d, 1, 3, 12, 4)
        assert mask.shape == (1, 2, 3, 12)
        assert torch.equal(mask.cpu(), brute_force_topk(bias, mask_4d, 4))

    def test_min_dtype_marks_masked_bias_entries(self):
        min_value = torch.finfo(torch.float32).min
        bias = torch.tensor([[[[5.0, min_value, 1.0, min_value]]]], device=DEVICE)
        mask = create_mask(bias, None, 1, 1, 4, 3, min_dtype=min_value)
        assert mask[0, 0, 0].int().tolist() == [1, 0, 1, 0]

    def test_relu_keeps_positive_allowed_bias(self):
        bias = torch.tensor([[[[0.5, -1.0, 0.0, 2.0, 3.0]]]], device=DEVICE)
        padding = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool, device=DEVICE)
        mask = create_mask(bias, padding, 1, 1, 5, 0, kind="relu")
        assert mask[0, 0, 0].int().tolist() == [1, 0, 0, 1, 0]

    def test_block_smoothing_keeps_majority_blocks_and_never_masked_keys(self):
        # top-5 keeps keys 0, 1, 2, 5, 6 (ties broken low); blocks of 3: {0,1,2} 3/3, {3,4,5} 1/3, {6,7} 1/2.
        bias = torch.tensor([[[[4.0, 4.0, 4.0, 0.0, 0.0, 3.0, 3.0, 0.0]]]], device=DEVICE)
        assert create_mask(bias, None, 1, 1, 8, 5, block_size=3)[0, 0, 0].int().tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
        # A block kept by majority does not bring back its masked key.
        padding = torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool, device=DEVICE)
        bias = torch.tensor([[[[4.0, 4.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0]]]], device=DEVICE)
        mask = create_mask(bias, padding, 1, 1, 8, 3, block_size=3)
        assert mask[0, 0, 0].int().tolist() == [1, 0, 1, 0, 0, 0, 0, 0]

    def test_selection_is_detached_and_inputs_untouched(self):
        bias = random_bias(2, 2, 1, 16).requires_grad_()
        padding = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
        before = (bias.detach().clone(), padding.clone())
        mask = create_mask(bias, padding, 2, 1, 16, 4)
        assert not mask.requires_grad and mask.grad_fn is None
        assert torch.equal(bias.detach(), before[0]) and torch.equal(padding, before[1])

    def test_nan_bias_is_never_selected(self):
        bias = torch.tensor([[[[float("nan"), 1.0, 2.0, float("nan")]]]], device=DEVICE)
        assert create_mask(bias, None, 1, 1, 4, 3)[0, 0, 0].int().tolist() == [0, 1, 1, 0]

    @pytest.mark.parametrize(
        "kwargs, error, message",
        [
            (dict(kind="soft"), ValueError, r"kind: expected one of 'topk', 'relu', got 'soft'"),
            (dict(window_size=-1), ValueError, r"window_size: expected an int >= 1, got -1"),
            (dict(window_size=0), ValueError, r"window_size: expected an int >= 1, got 0"),
            (dict(window_size=2.5), TypeError, r"window_size: expected an int, got float 2.5"),
            (dict(key_len=9), ValueError, r"attention_bias: expected shape \[1\|2, heads, 1\|3, 9\]"),
            (dict(batch_size=1, query_len=1, key_len=9), ValueError, r"attention_bias: expected shape \[1, heads, 1, 9\]"),
            (dict(attention_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, r"length key_len = 8 or query_len = 3"),
            (dict(attention_mask=torch.ones(2, 8)), TypeError, r"attention_mask: expected a bool .* got torch.float32"),
            (dict(attention_mask=torch.ones(3, 8, dtype=torch.bool)), ValueError, r"expected batch size 2"),
            (dict(attention_bias=torch.zeros(2, 1, 8)), ValueError, r"attention_bias: expected a 4-D tensor"),
            (dict(block_size=0), ValueError, r"block_size: expected an int >= 1, got 0"),
            (dict(min_dtype="low"), TypeError, r"min_dtype: expected a float or None, got str 'low'"),
            (
                dict(attention_bias=torch.zeros(2, 1, 1, 8, device="meta"), attention_mask=torch.ones(2, 8, dtype=torch.bool)),
                ValueError,
                r"attention_mask: expected device meta \(the device of attention_bias\), got cpu",
            ),
        ],
        ids=[
            "kind", "window", "window-0", "window-float", "bias-shape", "bias-shape-1", "mask-length", "mask-float", "mask-batch", "bias-3d", "block",
            "min-dtype", "mask-device",
        ],
    )
    def test_bad_arguments_are_named(self, kwargs, error, message):
        arguments = dict(
            attention_bias=torch.zeros(2, 1, 1, 8),
            attention_mask=None,
            batch_size=2,
            query_len=3,
            key_len=8,
            window_size=4,
        )
        arguments.update(kwargs)
        with pytest.raises(error, match=message):
            create_mask(**arguments)


def brute_force_block_selection(bias, allowed, block_k: int, k_blocks: int, reduce: str) -> torch.Tensor:
    """[..., NKB] bool: the per-key layout's choice, block by block in plain Python."""
    bias, allowed = torch.broadcast_tensors(bias.cpu().float(), allowed.cpu())
    key_len = bias.shape[-1]
    starts = range(0, key_len, block_k)
    scores = torch.full((*bias.shape[:-1], len(starts)), float("-inf"))
    eligible = torch.zeros(scores.shape, dtype=torch.bool)
    for b, start in enumerate(starts):
        values, ok = bias[..., start : start + block_k], allowed[..., start : start + block_k]
        eligible[..., b] = ok.any(-1)
        if reduce == "max":
            scores[..., b] = values.masked_fill(~ok, float("-inf")).amax(-1)
        else:
            scores[..., b] = (values * ok).sum(-1) / ok.sum(-1).clamp(min=1)
    return brute_force_topk(scores, eligible, k_blocks)


class TestTopkBlockMask:
    @pytest.mark.parametrize("reduce", ["max", "mean"])
    @pytest.mark.parametrize("levels", [None, 2], ids=["distinct", "ties"])
    @pytest.mark.parametrize("block_k", [16, 32])
    def test_per_key_selection_matches_brute_force(self, reduce, levels, block_k):
        bias = random_bias(2, 3, 1, 150, levels=levels)
        padding = torch.ones(2, 150, dtype=torch.bool, device=DEVICE)
        padding[0, :40] = False  # batch 0: blocks wholly and partly padded
        summary = topk_block_mask(bias, 50, padding, block_size=(64, block_k), reduce=reduce)
        nkb = -(-150 // block_k)
        assert summary.mask_shape == (2, 3, 1, 150) and summary.state.shape == (2, 3, 1, nkb)
        expected = brute_force_block_selection(bias, padding[:, None, None, :], block_k, -(-50 // block_k), reduce)
        assert torch.equal(summary.state.cpu() != EMPTY, expected)
        # Kept blocks holding padding are PARTIAL; all others FULL.
        partial = torch.zeros_like(expected)
        partial[0, :, :, : -(-40 // block_k)] = True
        expected_state = torch.where(expected, torch.where(partial, PARTIAL, FULL), EMPTY).to(torch.int8)
        assert torch.equal(summary.state.cpu(), expected_state)
        assert summary.needs_mask  # a padding mask may make kept blocks PARTIAL

    def test_without_a_padding_mask_no_block_is_partial(self):
        summary = topk_block_mask(random_bias(2, 3, 1, 150), 50, block_size=(64, 16), sink_blocks=1)
        assert not summary.needs_mask and not (summary.state == PARTIAL).any()

    @pytest.mark.skipif(DEVICE.type != "cuda", reason="host-device synchronisation needs a GPU")
    def test_selection_never_waits_for_the_gpu(self):
        # A model selects keys in every layer: a wait for the GPU there would stall its launches.
        bias = random_bias(1, 4, 1, 4096)
        torch.cuda.set_sync_debug_mode("error")
        try:
            topk_block_mask(bias, 512, block_size=(128, 128), sink_blocks=1)
            topk_block_mask(bias, 512, block_size=(128, 128), query_len=4096, is_causal=True, local_blocks=1)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def test_max_and_mean_choose_differently(self):
        # Block 0 has one large key among small ones; block 1 is uniformly medium.
        bias = torch.zeros(1, 1, 1, 32, device=DEVICE)
        bias[..., 3] = 10.0
        bias[..., 16:] = 1.0
        by_max = topk_block_mask(bias, 16, block_size=(16, 16), reduce="max")
        by_mean = topk_block_mask(bias, 16, block_size=(16, 16), reduce="mean")
        assert by_max.state.flatten().tolist() == [FULL, EMPTY]
        assert by_mean.state.flatten().tolist() == [EMPTY, FULL]

    def test_sink_blocks_are_kept_on_top_of_the_window(self):
        bias = torch.arange(64.0, device=DEVICE).view(1, 1, 1, 64)  # later blocks score higher
        summary = topk_block_mask(bias, 16, block_size=(16, 16), sink_blocks=1)
        assert summary.state.flatten().tolist() == [FULL, EMPTY, EMPTY, FULL]

    def test_a_window_of_0_keeps_only_the_sink_and_local_blocks(self):
        bias = torch.arange(64.0, device=DEVICE).view(1, 1, 1, 64)
        sink_only = topk_block_mask(bias, 0, block_size=(16, 16), sink_blocks=1)
        assert sink_only.state.flatten().tolist() == [FULL, EMPTY, EMPTY, EMPTY]
        local = topk_block_mask(bias, 0, block_size=(16, 16), query_len=64, is_causal=True, local_blocks=1)
        assert torch.equal(local.state[0, 0].cpu(), torch.where(torch.eye(4, dtype=torch.bool), FULL, EMPTY).to(torch.int8))

    @pytest.mark.parametrize("backend", ["reference", "triton"])
    def test_attention_with_summary_equals_attention_with_expanded_mask(self, backend):
        gen = torch.Generator().manual_seed(5)
        batch, seqlen, heads, kv_heads, dim = 2, 80, 4, 2, 16
        q = torch.randn(batch, seqlen, heads, dim, generator=gen).to(DEVICE)
        k, v = (torch.randn(batch, seqlen, kv_heads, dim, generator=gen).to(DEVICE) for _ in range(2))
        bias = torch.randn(batch, kv_heads, 1, seqlen, generator=gen).to(DEVICE)
        bias[1, :, :, 64:70] += 10.0  # batch 1 keeps the block that padding cuts
        padding = torch.ones(batch, 1, 1, seqlen, dtype=torch.bool, device=DEVICE)
        padding[1, ..., 70:] = False
        summary = topk_block_mask(bias, 32, padding, block_size=(16, 16), sink_blocks=1)
        assert summary.needs_mask  # the block holding keys 64..79 of batch 1 is cut by padding
        mask = (expand_blocks(summary, seqlen, seqlen) != EMPTY) & padding
        expected = flash_dma_func(q, k, v, mask, bias, is_causal=True, backend="reference")
        actual = flash_dma_func(q, k, v, padding, bias, block_mask=summary, is_causal=True, backend=backend)
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)

    def test_per_query_block_layout_respects_causal_budget_and_locality(self):
        seqlen, block = 160, 16
        bias = random_bias(2, 2, 1, seqlen)
        budget_blocks = 3
        summary = topk_block_mask(
            bias, budget_blocks * block, block_size=(block, block), query_len=seqlen, is_causal=True, local_blocks=2
        )
        state = summary.state.cpu()
        nqb = nkb = seqlen // block
        assert summary.mask_shape == (2, 2, seqlen, seqlen) and state.shape == (2, 2, nqb, nkb)
        qb, kb = torch.arange(nqb)[:, None], torch.arange(nkb)[None, :]
        assert not (state != EMPTY)[..., kb > qb].any(), "a block wholly in the causal future was kept"
        assert (state == FULL)[..., (kb == qb) | (kb == qb - 1)].all(), "a local block is missing"
        kept = (state != EMPTY).sum(-1)
        visible = torch.arange(nqb) + 1
        assert torch.equal(kept, torch.minimum(visible, torch.full_like(visible, budget_blocks + 2)).expand_as(kept))
        # Beyond the local blocks, each query block keeps its best visible blocks.
        for row in range(2, nqb):
            choosable = brute_force_block_selection(bias[..., : (row - 1) * block], torch.ones(1, dtype=torch.bool), block, budget_blocks, "max")
            assert torch.equal((state[:, :, row, : row - 1] != EMPTY), choosable[:, :, 0])

    def test_per_query_block_layout_without_causal_may_look_ahead(self):
        # 40 queries, 64 keys, bottom-right aligned: query rows 0..31 have diagonals 24..55 (key
        # blocks 1..3, all local), rows 32..39 have 56..63 (block 3). One more block by bias each.
        bias = torch.zeros(1, 1, 1, 64, device=DEVICE)
        bias[..., 40] = 1.0  # block 2 is the best non-local choice of query block 1
        summary = topk_block_mask(bias, 16, block_size=(32, 16), query_len=40, local_blocks=1)
        assert summary.state.shape == (1, 1, 2, 4)
        assert (summary.state[0, 0] != EMPTY).int().tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]

    def test_selection_is_detached(self):
        bias = random_bias(1, 2, 1, 64).requires_grad_()
        summary = topk_block_mask(bias, 16, block_size=(16, 16))
        assert summary.state.grad_fn is None and not summary.state.requires_grad

    def test_per_key_memory_stays_linear_in_key_blocks(self):
        """The per-key summary holds O(Sk / block) elements per (batch, head), and so does every temporary
        beyond one pass over the bias: nothing quadratic in the sequence is ever allocated."""
        batch, heads, seqlen, block = 1, 2, 1 << 16, 128
        bias = random_bias(batch, heads, 1, seqlen)
        largest = []

        class LargestAllocation(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        largest.append(t.numel() * t.element_size())  # bytes: the interpreter copies tensors as bytes
                return out

        with LargestAllocation():
            summary = topk_block_mask(bias, seqlen // 8, block_size=(block, block), sink_blocks=1)
        nkb = seqlen // block
        summary_elements = sum(t.numel() for t in (summary.state, summary.kv_lists, summary.q_lists))
        assert summary.state.shape == (batch, heads, 1, nkb)
        assert summary_elements <= 16 * batch * heads * (nkb + 1)
        assert max(largest) <= 2 * bias.numel() * bias.element_size()  # one pass over the bias, never [Sq, Sk]

    @pytest.mark.parametrize(
        "kwargs, error, message",
        [
            (dict(attention_bias=torch.zeros(1, 1, 4, 64)), ValueError, r"expected a per-key bias .* got shape \(1, 1, 4, 64\)"),
            (dict(is_causal=True), ValueError, r"is_causal: only the per-query-block layout uses it"),
            (dict(local_blocks=1), ValueError, r"local_blocks: only the per-query-block layout uses it"),
            (dict(reduce="sum"), ValueError, r"reduce: expected one of 'max', 'mean', got 'sum'"),
            (dict(block_size=(16, 24)), ValueError, r"block_size: expected a pair of values"),
            (dict(window_size=-3), ValueError, r"window_size: expected an int >= 1, got -3"),
            (dict(window_size=0), ValueError, r"window_size: expected an int >= 1, got 0"),
            (dict(attention_mask=torch.ones(1, 1, 3, 64, dtype=torch.bool)), ValueError, r"expected a per-key mask"),
            (dict(attention_mask=torch.ones(2, 64, dtype=torch.bool)), ValueError, r"does not broadcast with attention_bias"),
            (
                dict(attention_bias=torch.zeros(3, 1, 1, 64, device="meta"), attention_mask=torch.ones(3, 64, dtype=torch.bool)),
                ValueError,
                r"attention_mask: expected device meta \(the device of attention_bias\), got cpu",
            ),
        ],
        ids=["bias-rows", "causal", "local", "reduce", "block", "window", "window-0", "mask-rows", "mask-batch", "mask-device"],
    )
    def test_bad_arguments_are_named(self, kwargs, error, message):
        arguments = dict(attention_bias=torch.zeros(3, 1, 1, 64), window_size=16, block_size=(16, 16))
        arguments.update(kwargs)
        with pytest.raises(error, match=message):
            topk_block_mask(**arguments)


class TestAttendedFraction:
    def test_no_mask_attends_everything_visible(self):
        assert attended_fraction(30, 50, is_causal=True) == 1.0

    @pytest.mark.parametrize("seqlen_q, seqlen_k", [(40, 40), (17, 63)])
    def test_token_mask_matches_brute_force(self, seqlen_q, seqlen_k):
        mask = torch.rand(2, 3, 1, seqlen_k, generator=torch.Generator().manual_seed(2)).to(DEVICE) < 0.3
        expected = brute_force_fraction(mask, seqlen_q, seqlen_k)
        assert attended_fraction(seqlen_q, seqlen_k, mask, is_causal=True) == pytest.approx(expected)

    def test_block_mask_counts_what_the_kernels_attend(self):
        seqlen = 96
        padding = torch.ones(1, 1, 1, seqlen, dtype=torch.bool, device=DEVICE)
        padding[..., 90:] = False
        summary = topk_block_mask(random_bias(1, 2, 1, seqlen), 32, padding, block_size=(16, 16), query_len=seqlen, is_causal=True, local_blocks=1)
        expected = brute_force_fraction((expand_blocks(summary, seqlen, seqlen) != EMPTY) & padding, seqlen, seqlen)
        assert attended_fraction(seqlen, seqlen, padding, summary, is_causal=True) == pytest.approx(expected)
        assert expected < 0.75

    def test_partial_blocks_need_their_mask(self):
        padding = torch.ones(1, 1, 1, 40, dtype=torch.bool, device=DEVICE)
        padding[..., 35:] = False
        summary = topk_block_mask(random_bias(1, 1, 1, 40), 40, padding, block_size=(16, 16))
        with pytest.raises(ValueError, match="block_mask: it may hold partial blocks"):
            attended_fraction(40, 40, block_mask=summary)


class TestTopkIndices:
    @pytest.mark.parametrize("levels", [None, 3], ids=["distinct", "ties"])
    @pytest.mark.parametrize(("width", "causal", "window"), [(1, False, (-1, -1)), (5, True, (-1, -1)), (64, False, (4, 2))], ids=["W1", "W5-causal", "W64-win4,2"])
    def test_matches_brute_force(self, levels, width, causal, window, monkeypatch):
        monkeypatch.setattr(masks, "_COUNT_CHUNK_ELEMENTS", 2 * 3 * 37 * 4)  # chunks of 4 query rows
        scores = random_bias(2, 3, 17, 37, levels=levels)
        scores[0, 0, 2, 5] = float("nan")
        indices = topk_indices(scores, width, is_causal=causal, window_size=window)
        assert indices.shape == (2, 17, 3, width) and indices.dtype == torch.int32
        visible = visible_positions(torch.arange(17), 17, 37, (window[0], 0) if causal else window)
        keep = brute_force_topk(scores.nan_to_num(float("-inf")), visible & ~scores.isnan().cpu(), width)
        for b, h, i in torch.nonzero(torch.ones(2, 3, 17)).tolist():
            chosen = torch.nonzero(keep[b, h, i]).flatten().tolist()
            assert indices[b, i, h].tolist() == chosen + [-1] * (width - len(chosen))

    def test_scores_made_chunk_by_chunk_select_as_the_whole_matrix(self, monkeypatch):
        monkeypatch.setattr(masks, "_COUNT_CHUNK_ELEMENTS", 2 * 3 * 37 * 4)  # chunks of 4 query rows
        scores = random_bias(2, 3, 17, 37, levels=3)
        asked = []

        def score_rows(start, stop):
            asked.append((start, stop))
            return scores[:, :, start:stop]

        chunked = chunked_topk_indices(score_rows, (2, 3, 17, 37), 6, is_causal=True, window_size=(9, -1), device=DEVICE)
        assert asked == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 17)]
        assert torch.equal(chunked, topk_indices(scores, 6, is_causal=True, window_size=(9, -1)))

    def test_mask_of_the_indices_attends_as_flash_dma_topk_func(self):
        scores = random_bias(1, 2, 40, 40)
        indices = topk_indices(scores, 8, is_causal=True)
        mask = topk_mask(indices, 40, block_size=(16, 32))
        assert mask.shape == (1, 2, 40, 40)
        assert torch.equal(mask.dense().sum(-1).transpose(1, 2), (indices >= 0).sum(-1))
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 40, 4, 16, generator=gen).to(DEVICE)
        k, v = (torch.randn(1, 40, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
        expected = flash_dma_topk_func(q, k, v, indices, is_causal=True, backend="reference")
        torch.testing.assert_close(flash_dma_func(q, k, v, mask, is_causal=True, backend="reference"), expected)

    @pytest.mark.parametrize(
        ("call", "error", "message"),
        [
            (lambda: topk_indices(torch.zeros(2, 8, 8), 2), ValueError, r"scores: expected a 4-D tensor \[B, Hkv, Sq, Sk\]"),
            (lambda: topk_indices(torch.zeros(1, 1, 2, 2, dtype=torch.int32), 2), TypeError, r"scores: expected a floating-point"),
            (lambda: topk_indices(torch.zeros(1, 1, 2, 2), 0), ValueError, r"width: expected an int >= 1, got 0"),
            (lambda: topk_indices(torch.zeros(1, 1, 2, 2), 1, is_causal=1), TypeError, r"is_causal: expected a bool"),
            (lambda: topk_mask(torch.zeros(1, 2, 3, dtype=torch.int32), 4), ValueError, r"indices: expected a 4-D tensor \[B, Sq, Hkv, W\]"),
            (lambda: topk_mask(torch.full((1, 1, 1, 1), 9, dtype=torch.int32), 4), ValueError, r"indices: every entry must be < key_len"),
            (lambda: chunked_topk_indices(lambda a, b: torch.zeros(1, 1, b - a, 3), (1, 1, 2), 1, device="cpu"),
             ValueError, r"shape: expected \(B, Hkv, Sq, Sk\), got \(1, 1, 2\)"),
            (lambda: chunked_topk_indices(lambda a, b: torch.zeros(1, 1, b - a, 3), (1, 1, 2, 4), 1, device="cpu"),
             ValueError, r"score_rows: expected rows 0:2 of shape \(1, 1, 2, 4\), got \(1, 1, 2, 3\)"),
        ],
        ids=["scores-3d", "scores-int", "width-0", "causal-int", "mask-3d", "mask-out-of-range", "rows-shape", "rows-wrong"],
    )
    def test_bad_arguments_are_named(self, call, error, message):
        with pytest.raises(error, match=message):
            call()
