"""Run the same suite on the CPU (kernels under the Triton interpreter) and on a CUDA GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton is first imported; the Makefile sets it too.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SLOW_ON_CPU = os.environ.get("FLASH_DMA_SLOW_TESTS", "0") == "1"


def pytest_report_header(config):
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    return f"flash-dma tests on {device}: torch {torch.__version__}, triton {triton.__version__} ({mode})"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="long lengths run on the GPU (or set FLASH_DMA_SLOW_TESTS=1)")
    for item in items:
        if "gpu_only" in item.keywords:
            item.add_marker(skip_gpu)
        elif "slow" in item.keywords and not SLOW_ON_CPU:
            item.add_marker(skip_slow)


@pytest.fixture
def poison_outputs(monkeypatch):
    """Kernels' output buffers start as NaN, so an element a kernel fails to write shows up."""
    from tests.helpers import poisoned_empty

    monkeypatch.setattr(torch, "empty", poisoned_empty(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned_empty(torch.empty_like))


# flash_dma_topk_func on the Triton backend walks, in each pass, its indices or the packed mask
# (dispatch.topk_plan; a split only with unique_indices and no per-pair bias, else both passes take
# the forward's walk); its index backward walks per query or over each query block's union of keys,
# block by block by the union's size (topk.union.UNION_SHARE). Each walk: (the forward's and the
# backward's, the union share, None for the default).
TOPK_WALKS = {
    "per-query": ("indices", "indices", -1.0), "union": ("indices", "indices", 1.0), "split": ("indices", "indices", None),
    "packed": ("packed", "packed", None), "packed-forward": ("packed", "indices", None), "packed-backward": ("indices", "packed", None),
}


@pytest.fixture(params=TOPK_WALKS)
def topk_walk(request, monkeypatch):
    """Each way a top-k call runs on the Triton backend, in turn."""
    from flash_dma.backends.triton import dispatch
    from flash_dma.backends.triton.topk import union

    forward, backward, share = TOPK_WALKS[request.param]
    monkeypatch.setattr(dispatch, "TOPK_FORCED_PLAN", dispatch.TopkPlan(forward, backward))
    if share is not None:
        monkeypatch.setattr(union, "UNION_SHARE", share)
    return request.param
