"""Run the same suite on the CPU (kernels under the Triton interpreter) and on a CUDA GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton is first imported; the Makefile sets it too.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.helpers import speed_up_interpreter

    speed_up_interpreter()

SLOW_ON_CPU = os.environ.get("FLASH_DMA_SLOW_TESTS", "0") == "1"

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # xdist's workers share the cores: each takes its share of threads, and so do the processes its
    # tests start (OMP_NUM_THREADS). With more threads than cores, an operation waits for threads
    # that another worker has descheduled: on 2 busy cores, -n 2 took half the wall time with one
    # thread a worker as with two (measured).
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _threads = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


def pytest_report_header(config):
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    return f"flash-dma tests on {device}: torch {torch.__version__}, triton {triton.__version__} ({mode})"


# The newest releases' run (`make test-latest`, `-m latest`) takes a slice of the suite, the pinned
# run all of it. The slice guards what a new torch, triton, numpy or transformers can break: every
# case of LATEST_EVERY_CASE (the docs' blocks, the transformers integrations); the first case of
# each test under LATEST_FIRST_CASE (each test checks one behaviour, and its first case runs it):
# the sm90 compile of each kernel's first variant, the kernel families under the interpreter, and what
# calls torch's APIs (the reference, Flex, torch.compile, the layer, gloo), matplotlib and tqdm;
# and of the tests that sweep a kernel family's input forms, the first case of each form in
# LATEST_FORMS (a text in the case's id). A new kernel family joins by a line here.
LATEST_EVERY_CASE = ("tests/test_docs.py", "tests/integrations/")
LATEST_FIRST_CASE = (
    "tests/backends/triton/test_compiles_for_gpu.py",
    "tests/backends/triton/test_forward.py",
    "tests/backends/triton/test_backward.py",
    "tests/backends/triton/topk/",
    "tests/backends/triton/test_varlen.py",
    "tests/backends/triton/test_kvcache.py",
    "tests/backends/triton/test_key_list.py",
    "tests/backends/triton/test_key_intervals.py",
    "tests/backends/triton/test_block_summary.py",
    "tests/backends/triton/test_block_topk.py",
    "tests/backends/triton/test_bit_pack.py",
    "tests/backends/triton/test_compile.py",
    "tests/backends/test_reference.py",
    "tests/backends/test_flex.py",
    "tests/test_interface.py",
    "tests/modules/",
    "tests/distributed/test_merge.py",
    "tests/distributed/test_attention.py::test_matches_single_process",
    "tests/demo/",
    "tests/benchmark/test_plots.py",
)
_KERNEL_FORMS = ("mask[B,Hkv,1,Sk]blocks", "rows", "packed", "listed", "win", "cap", "fp16")
LATEST_FORMS = {
    "tests/backends/triton/test_forward.py::test_forward_matches_reference": (*_KERNEL_FORMS, "H8-Hkv2-D16-causal"),
    "tests/backends/triton/test_backward.py::test_gradients_match_reference": _KERNEL_FORMS,
    "tests/backends/triton/topk/test_forward_backward.py::test_topk_matches_reference": (
        "per-query-", "union-", "split-", "packed-B", "packed-forward-", "packed-backward-", "fp16",
    ),
    "tests/backends/triton/test_varlen.py::test_varlen_matches_reference": ("sequence", "keys", "summary", "topk", "cap"),
    "tests/backends/triton/test_kvcache.py::test_kvcache_matches_reference": ("rows", "paged", "splits", "listed"),
    "tests/distributed/test_attention.py::test_matches_single_process": ("triton", "contiguous"),
}


def _mark_latest(config, items) -> None:
    """Mark the ``latest`` slice; where it is chosen (``-m latest``), a path of the slice that names
    no file, or a form of LATEST_FORMS that no collected case of its test holds, is an error (a
    renamed file or case must not leave the slice unseen)."""
    seen_tests, found = set(), set()
    for item in items:
        test = item.nodeid.split("[")[0]
        case = item.callspec.id if hasattr(item, "callspec") else ""
        forms = [form for form in LATEST_FORMS.get(test, ()) if form in case and (test, form) not in found]
        first = test not in seen_tests and test.startswith(LATEST_FIRST_CASE)
        if item.nodeid.startswith(LATEST_EVERY_CASE) or first or forms:
            item.add_marker(pytest.mark.latest)
        seen_tests.add(test)
        found.update((test, form) for form in forms)
    if "latest" not in config.option.markexpr:
        return
    collected = {test.split("::")[0] for test in seen_tests}
    missing = [f"{path}: no such file" for path in {p.split("::")[0] for p in (*LATEST_EVERY_CASE, *LATEST_FIRST_CASE, *LATEST_FORMS)}
               if not (config.rootpath / path).exists()]
    missing += [f"{test}: no case holds {form!r}" for test, forms in LATEST_FORMS.items() for form in forms
                if (test, form) not in found and test.split("::")[0] in collected]
    if missing:
        raise pytest.UsageError("tests/conftest.py, the latest slice: " + "; ".join(sorted(missing)))


# Tests that each run whole processes of a tool, tens of seconds apiece. xdist hands tests out in
# the order they were collected: one of these started last would keep a worker busy while the
# other has nothing left, so they start first.
FIRST_TO_RUN = ("tests/tools/",)


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: the slice is chosen from the whole collection
def pytest_collection_modifyitems(config, items):
    _mark_latest(config, items)
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST_TO_RUN))  # stable: the order within each part stays
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="long lengths run on the GPU (or set FLASH_DMA_SLOW_TESTS=1)")
    for item in items:
        if "gpu_only" in item.keywords:
            item.add_marker(skip_gpu)
        elif "slow" in item.keywords and not SLOW_ON_CPU:
            item.add_marker(skip_slow)


_GROUPS_LOST = pytest.StashKey[str]()


def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` (the README's command) an xdist worker's tests of a group carry
    the group in their node id, which is how the controller keeps them on one worker. Where this
    pytest and pytest-xdist no longer agree on how (pytest 9.2's node ids and xdist 3.8,
    pytest-dev/pytest-xdist#1386), the groups would be spread over the workers, each starting its
    own process groups: those tests fail instead, saying why (``pytest_runtest_setup``)."""
    config = session.config
    if not (hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False)):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rpartition("]")[2]]
    if lost:
        config.stash[_GROUPS_LOST] = (
            f"--dist loadgroup: the {len(lost)} tests marked xdist_group carry no group in their node id, so they are not kept "
            "on one worker (pytest-dev/pytest-xdist#1386, pytest >= 9.2 with pytest-xdist 3.8): install the test extra's pytest"
        )


def pytest_runtest_setup(item):
    lost = item.config.stash.get(_GROUPS_LOST, None)
    if lost and item.get_closest_marker("xdist_group"):
        pytest.fail(lost, pytrace=False)


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
