"""The ring's merge of partial results, each backend's ``merge_partial``, against the float64
formula: rows that saw keys on one side, on both or on neither; views of rows of larger buffers;
a running result in float32 or in the output's dtype, merged into itself or into the output."""

from __future__ import annotations

import pytest
import torch

from flash_dma.backends import reference
from flash_dma.backends import triton as triton_backend
from tests.helpers import DEVICE, DTYPE_IDS, KERNEL_DTYPES

BACKENDS = {"reference": reference, "triton": triton_backend}
BATCH, LENGTH, HEADS, HEAD_DIM = 2, 50, 3, 40
ROWS = slice(5, 42)  # the merged rows of buffers of LENGTH rows


def _lse(gen: torch.Generator, empty: torch.Tensor) -> torch.Tensor:
    """``[B, H, LENGTH]`` float32, -inf where ``empty``."""
    lse = 3 * torch.randn(BATCH, HEADS, LENGTH, generator=gen)
    return lse.masked_fill(empty, float("-inf")).to(DEVICE)


def _rows(gen: torch.Generator, dtype: torch.dtype, lse: torch.Tensor) -> torch.Tensor:
    """``[B, LENGTH, H, D]``; 0 where ``lse`` is -inf, as a call's rows that saw no key."""
    out = torch.randn(BATCH, LENGTH, HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    return out.masked_fill(torch.isinf(lse).transpose(1, 2).unsqueeze(-1), 0.0).to(dtype)


@pytest.mark.parametrize("into", ("running", "output"))
@pytest.mark.parametrize("running_fp32", (False, True), ids=("running-in-dtype", "running-fp32"))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_partial(backend, dtype, running_fp32, into):
    gen = torch.Generator().manual_seed(len(backend) + 7 * running_fp32 + 3 * (into == "output"))
    side = torch.randint(0, 4, (BATCH, HEADS, LENGTH), generator=gen)  # 0: both sides saw keys; 1, 2: one; 3: neither
    lse = _lse(gen, (side == 1) | (side == 3))
    part_lse = _lse(gen, (side == 2) | (side == 3))
    running = _rows(gen, torch.float32 if running_fp32 else dtype, lse)
    part_out = _rows(gen, dtype, part_lse)[:, ROWS]

    top = torch.maximum(lse, part_lse).double()[..., ROWS]
    shift = torch.where(torch.isinf(top), 0.0, top)
    keep, take = torch.exp(lse[..., ROWS].double() - shift), torch.exp(part_lse[..., ROWS].double() - shift)
    total = torch.where(torch.isinf(top), 1.0, keep + take)
    expected_lse = torch.where(torch.isinf(top), float("-inf"), shift + torch.log(total))
    weights = [(w / total).transpose(1, 2).unsqueeze(-1) for w in (keep, take)]
    expected = running[:, ROWS].double() * weights[0] + part_out.double() * weights[1]

    output = running if into == "running" else torch.full_like(running, float("nan"), dtype=dtype)
    before = output.clone()
    BACKENDS[backend].merge_partial(running[:, ROWS], lse[..., ROWS], part_out, part_lse[..., ROWS], output[:, ROWS])

    # Rounded once to the output's dtype; float32 outputs carry the float32 weights' few ulps.
    eps = max(torch.finfo(output.dtype).eps, 1e-6)
    torch.testing.assert_close(output[:, ROWS].double(), expected, atol=eps, rtol=2 * eps)
    torch.testing.assert_close(lse[..., ROWS].double(), expected_lse, atol=1e-5, rtol=1e-6)
    outside = torch.ones(LENGTH, dtype=torch.bool)
    outside[ROWS] = False
    assert torch.equal(output[:, outside].isnan(), before[:, outside].isnan())  # other rows untouched
    assert torch.equal(output[:, outside].nan_to_num(), before[:, outside].nan_to_num())
