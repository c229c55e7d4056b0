"""The runner's bookkeeping on the CPU, with fake methods and a fake measurement."""

from dataclasses import replace

import pytest
import torch

from flash_dma.benchmark import runner
from flash_dma.benchmark.inputs import make_inputs
from flash_dma.benchmark.measure import Measurement, TimingOptions, make_step
from flash_dma.benchmark.methods import Method, Prepared
from flash_dma.benchmark.metrics import (
    active_pairs,
    attention_flops,
    block_active_pairs,
    document_active_pairs,
    gbps,
    index_active_pairs,
    kv_bytes,
    kvcache_bytes,
    tflops,
)
from flash_dma.benchmark.suites import Case, topk_cases
from flash_dma.benchmark.targets import evaluate


class FakeMethod(Method):
    def __init__(self, name, fail_prepare=None, skip=None, applies_mask=True):
        self.name, self.description = name, name
        self.fail_prepare, self.skip, self.applies_mask = fail_prepare, skip, applies_mask
        self.skips_masked_keys = applies_mask

    def skip_reason(self, case, mode, options):
        return self.skip

    def prepare(self, case, inputs):
        if self.fail_prepare:
            raise self.fail_prepare
        return Prepared(forward=lambda: torch.zeros(1), leaves=())


FAKES = {
    "good": FakeMethod("good"),
    "dense": FakeMethod("dense", applies_mask=False),
    "broken": FakeMethod("broken", fail_prepare=RuntimeError("compile failed\nlong traceback")),
    "skipper": FakeMethod("skipper", skip="not today"),
}


class FakeMeasure:
    """Records ``(mode, cuda_graph)`` per call; calls numbered in ``fail_on`` run out of memory."""

    def __init__(self):
        self.calls = []
        self.fail_on = set()

    def __call__(self, prepared, mode, cuda_graph, options):
        self.calls.append((mode, cuda_graph))
        if len(self.calls) in self.fail_on:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return Measurement(ms=2.0, peak_gib=0.25, setup_s=1.5)


@pytest.fixture
def fake_measure(monkeypatch):
    fake = FakeMeasure()
    monkeypatch.setattr(runner, "measure", fake)
    return fake


def _case(**changes):
    fields = dict(suite="llm", kind="prefill", batch=1, heads=4, kv_heads=2, head_dim=16, seqlen_q=512,
                  seqlen_k=512, keep=1 / 2, methods=tuple(FAKES), modes=("fwd", "fwdbwd"))
    return Case(**{**fields, **changes})


def test_rows_record_numbers_failures_and_skips(fake_measure):
    case = _case()
    fake_measure.fail_on = {2}  # the first method's backward row
    results = runner.run_cases([case], device="cpu", methods=FAKES)
    assert [(r.method, r.mode, r.status) for r in results] == [
        ("good", "fwd", "ok"),
        ("good", "fwdbwd", "skipped"),
        ("dense", "fwd", "ok"),
        ("dense", "fwdbwd", "ok"),
        ("broken", "fwd", "skipped"),
        ("broken", "fwdbwd", "skipped"),
        ("skipper", "fwd", "skipped"),
        ("skipper", "fwdbwd", "skipped"),
    ]
    good, oom, dense_fwd, dense_bwd, broken, _, skipper, _ = results
    assert oom.note == "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB"
    assert broken.note == "RuntimeError: compile failed"
    assert skipper.note == "not today"
    assert all(r.ms is None for r in results if not r.ok)

    mask = make_inputs(case, "cpu").mask  # same seed, same mask as the run's
    sparse_pairs = active_pairs(512, 512, 1, 4, mask)
    dense_pairs = active_pairs(512, 512, 1, 4)
    assert sparse_pairs < dense_pairs
    assert good.active_pairs == sparse_pairs and dense_fwd.active_pairs == dense_pairs
    assert good.tflops == tflops(attention_flops(sparse_pairs, 16, "fwd"), 2.0)
    assert dense_bwd.tflops == tflops(attention_flops(dense_pairs, 16, "fwdbwd"), 2.0)
    assert good.gbps is None  # prefill rows report no bandwidth
    assert good.peak_gib == 0.25
    # Preparation time goes to a method's first row only.
    assert dense_fwd.setup_s >= 1.5 and dense_bwd.setup_s == 1.5
    assert fake_measure.calls == [("fwd", False), ("fwdbwd", False), ("fwd", False), ("fwdbwd", False)]


def test_decode_rows_use_cuda_graphs_and_report_bandwidth(fake_measure):
    case = _case(kind="decode", seqlen_q=1, seqlen_k=1024, keep=1 / 4, modes=("fwd",), methods=("good", "dense"))
    good, dense = runner.run_cases([case], device="cpu", methods=FAKES)
    mask = make_inputs(case, "cpu").mask
    assert good.gbps == gbps(kv_bytes(1024, 1, 2, 16, 2, mask), 2.0)
    assert dense.gbps == gbps(kv_bytes(1024, 1, 2, 16, 2), 2.0) == 4 * good.gbps
    assert fake_measure.calls == [("fwd", True), ("fwd", True)]


def test_describe_error_keeps_type_and_first_line_shortened():
    assert runner.describe_error(ValueError("bad\nworse")) == "ValueError: bad"
    long = runner.describe_error(RuntimeError("x" * 1000))
    assert len(long) == 300 and long.endswith("...")
    assert runner.describe_error(KeyError()) == "KeyError: "


def test_format_row():
    case = _case()
    ok = runner.Result(case, "flex", "fwd", ms=0.0971, tflops=12.3, peak_gib=0.13, setup_s=61.0)
    assert runner.format_row(ok) == (
        "llm prefill S=512 keep=1/2 flex fwd: 0.0971 ms, 12.3 TFLOP/s, peak 0.13 GiB, setup 61.0 s"
    )
    clocked = runner.Result(case, "flex", "fwd", ms=0.0971, setup_s=61.0, sm_clock="1980 MHz (none)")
    assert runner.format_row(clocked) == "llm prefill S=512 keep=1/2 flex fwd: 0.0971 ms, setup 61.0 s, SM 1980 MHz (none)"
    skipped = runner.Result(case, "flex", "fwd", status="skipped", note="why")
    assert runner.format_row(skipped).endswith("flex fwd: skipped (why)")


def test_results_are_handed_over_after_every_case(fake_measure):
    snapshots = []
    cases = [_case(methods=("good",)), _case(methods=("good", "skipper"), seqlen_q=256, seqlen_k=256)]
    results = runner.run_cases(cases, device="cpu", methods=FAKES, on_case_done=lambda r: snapshots.append(len(r)))
    assert snapshots == [2, 6] and len(results) == 6


def test_a_case_whose_inputs_fail_is_skipped_whole(fake_measure, monkeypatch):
    def no_memory(case, device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(runner, "make_inputs", no_memory)
    results = runner.run_cases([_case(methods=("good", "dense"))], device="cpu", methods=FAKES)
    assert [(r.method, r.mode, r.status) for r in results] == [
        ("good", "fwd", "skipped"),
        ("good", "fwdbwd", "skipped"),
        ("dense", "fwd", "skipped"),
        ("dense", "fwdbwd", "skipped"),
    ]
    assert results[0].note == "inputs: OutOfMemoryError: CUDA out of memory"
    assert fake_measure.calls == []


def test_host_rows_measure_host_time_and_count_no_flops(fake_measure, monkeypatch):
    calls = []

    def fake_host(prepared, mode, options):
        calls.append((mode, options.host_calls))
        return Measurement(ms=0.03, peak_gib=None, setup_s=0.2, cpu_ms=0.025)

    monkeypatch.setattr(runner, "measure_host", fake_host)
    case = _case(kind="host", seqlen_q=128, seqlen_k=128, mask="token", window=2048, keep=1.0, methods=("good",))
    fwd, fwdbwd = runner.run_cases([case], device="cpu", methods=FAKES, timing=TimingOptions(host_calls=7))
    assert calls == [("fwd", 7), ("fwdbwd", 7)] and fake_measure.calls == []
    assert (fwd.ms, fwd.cpu_ms, fwd.tflops, fwd.gbps, fwd.peak_gib, fwd.active_pairs) == (0.03, 0.025, None, None, None,
                                                                                          None)
    assert runner.format_row(fwd) == (
        "llm host S=128 top-128 keys good fwd: 0.03 ms, 0.025 ms CPU, setup 0.2 s"
    )


def test_first_call_rows_run_in_a_new_process_without_inputs_or_preparation(fake_measure, monkeypatch):
    calls = []

    def fake_first_call(case, method, mode):
        calls.append((case.cache, method, mode))
        return Measurement(ms=4200.0, peak_gib=None, setup_s=3.5)

    def no_inputs(case, device):
        raise AssertionError("a first-call row makes its inputs in the child")

    monkeypatch.setattr(runner, "measure_first_call", fake_first_call)
    monkeypatch.setattr(runner, "make_inputs", no_inputs)
    case = _case(cache="cold", methods=("broken",))  # its prepare would fail: the child prepares instead
    results = runner.run_cases([case], device="cpu", methods=FAKES)
    assert calls == [("cold", "broken", "fwd"), ("cold", "broken", "fwdbwd")] and fake_measure.calls == []
    assert [(r.status, r.ms, r.tflops) for r in results] == [("ok", 4200.0, None)] * 2
    assert results[0].setup_s >= 3.5 and results[1].setup_s == 3.5


def test_model_rows_count_no_flops(fake_measure):
    case = _case(kind="train", mask="none", bias="none", modes=("fwdbwd",), methods=("good",))
    (step,) = runner.run_cases([case], device="cpu", methods=FAKES)
    assert step.ok and step.ms == 2.0 and step.tflops is None and step.active_pairs is None


def test_query_block_masks_count_the_pairs_their_blocks_keep(fake_measure):
    case = _case(seqlen_q=384, seqlen_k=384, keep=2 / 3, mask="query-block", methods=("good", "dense"))
    good, _, dense, _ = runner.run_cases([case], device="cpu", methods=FAKES)
    block_mask = make_inputs(case, "cpu").block_mask
    assert good.active_pairs == block_active_pairs(block_mask, 384, 384, 1, 4) < dense.active_pairs
    assert dense.active_pairs == active_pairs(384, 384, 1, 4)


def test_varlen_rows_count_each_documents_pairs(fake_measure):
    documents = (100, 300, 156)
    case = _case(suite="varlen", seqlen_q=556, seqlen_k=556, documents=documents, methods=("good", "dense"))
    good, _, dense, _ = runner.run_cases([case], device="cpu", methods=FAKES)
    mask = make_inputs(case, "cpu").mask
    assert good.active_pairs == document_active_pairs(documents, 4, mask) < dense.active_pairs
    assert dense.active_pairs == document_active_pairs(documents, 4)
    assert good.gbps is None and fake_measure.calls[0] == ("fwd", False)


def test_kvcache_rows_use_cuda_graphs_and_count_the_bytes_read(fake_measure):
    case = _case(suite="kvcache", kind="decode", batch=2, seqlen_q=1, seqlen_k=1024, keep=1 / 8, modes=("fwd",),
                 methods=("good",), mask="random", kv_layout="paged")
    (good,) = runner.run_cases([case], device="cpu", methods=FAKES)
    mask = make_inputs(case, "cpu").mask
    assert good.gbps == gbps(kvcache_bytes(mask, 2, 16, 2, 2, 2), 2.0)
    assert good.active_pairs == 2 * 4 * 128
    assert fake_measure.calls == [("fwd", True)]


def test_topk_suite_runs_on_the_cpu_in_tiny_form_and_its_targets_read_its_rows(monkeypatch):
    """The topk suite's cases, shrunk, through the real methods (the reference backend; Flex compiles
    for CUDA only), each pass run once for real; then the full-size targets over the same rows."""
    ran = []

    def run_once(prepared, mode, cuda_graph, options):
        out = make_step(prepared, mode)()
        ran.append((mode, out is None or bool(torch.isfinite(out).all())))
        return Measurement(ms={"fwd": 1.0, "fwdbwd": 3.0}[mode], peak_gib=None, setup_s=0.0)

    monkeypatch.setattr(runner, "measure", run_once)
    full = topk_cases()
    tiny = [
        replace(c, heads=c.heads // 4, kv_heads=2, head_dim=16, seqlen_q=c.seqlen_q // 512, seqlen_k=c.seqlen_k // 512,
                window=8, methods=tuple(m for m in c.methods if m != "flex"))
        for c in full
    ]
    results = runner.run_cases(tiny, device="cpu")
    assert all(r.ok for r in results), [r.note for r in results if not r.ok]
    assert len(ran) == sum(len(c.methods) * len(c.modes) for c in tiny) and all(finite for _, finite in ran)
    for c in tiny:
        indices = make_inputs(c, "cpu").indices
        pairs = index_active_pairs(indices, c.seqlen_q, c.seqlen_k, c.heads)
        assert pairs == (indices >= 0).sum() * (c.heads // 2) > 0  # every listed key is visible: all count
        assert {r.active_pairs for r in results if r.case == c and r.method != "flash-dma-nomask"} == {pairs}

    sizes = dict(zip(tiny, full))
    checks = evaluate([replace(r, case=sizes[r.case], tflops=500.0) for r in results])
    assert {c.name: c.status for c in checks if c.name.startswith("topk")} == {
        "topk S=32K fwd+bwd: flash-dma-topk / flash-dma time": "MISS",
        "topk S=128K fwd+bwd: flash-dma-topk / flash-dma-nomask (dense causal) time": "MISS",
        "topk H=64 S=128K fwd: flash-dma-topk TFLOP/s on kept pairs": "PASS",
        "topk H=64 S=128K bwd: flash-dma-topk TFLOP/s on kept pairs": "MISS",
    }
