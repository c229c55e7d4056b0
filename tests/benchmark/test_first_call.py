"""The first-call rows' child process: its request, its JSON line, and how the parent runs it."""

import json
import os
import subprocess
import sys
import time

import pytest

from flash_dma.benchmark import first_call
from flash_dma.benchmark.first_call import (
    CHILD_CODE,
    ChildFailed,
    ChildTimes,
    child_main,
    child_request,
    measure_first_call,
    parse_child_output,
    run_child,
)
from flash_dma.benchmark.suites import Case


def _case(cache="warm", **changes) -> Case:
    fields = dict(suite="firstcall", kind="prefill", batch=1, heads=4, kv_heads=2, head_dim=16, seqlen_q=256,
                  seqlen_k=256, keep=1 / 2, methods=("flash-dma-percall",), modes=("fwd", "fwdbwd"), cache=cache)
    return Case(**{**fields, **changes})


def test_the_child_line_carries_its_compilations():
    stdout = '{"before_s": 1.0, "first_s": 2.0, "forward_s": 1.5, "compiles": [["_fwd", 1.5, false], ["_dq", 0.01, true]]}\n'
    times = parse_child_output(stdout)
    assert times.compiles == (("_fwd", 1.5, False), ("_dq", 0.01, True)) and times.compiled == 1


def test_the_result_is_the_last_json_line():
    stdout = ('loading...\n{"before_s": 1.0, "first_s": 9.0, "forward_s": 3.0}\nwarning: {not json\n'
              '{"before_s": 2.5, "first_s": 0.75, "forward_s": 0.5}\n')
    assert parse_child_output(stdout) == ChildTimes(before_s=2.5, first_s=0.75, forward_s=0.5)
    with pytest.raises(ChildFailed, match="no result line"):
        parse_child_output("Traceback (most recent call last):\n")


def test_the_request_holds_the_whole_case():
    case = _case(mask="token", window=64)
    request = json.loads(child_request(case, "flash-dma-percall", "fwdbwd"))
    assert (request["method"], request["mode"], request["device"]) == ("flash-dma-percall", "fwdbwd", "cuda")
    assert first_call._case_from_dict(request["case"]) == case


class FakeRun:
    """Stands in for ``subprocess.run``: records the calls, answers with a canned process."""

    def __init__(self, returncode=0, stdout='{"before_s": 4.0, "first_s": 2.0, "forward_s": 1.0}\n', stderr="", timeout=False):
        self.calls = []
        self.returncode, self.stdout, self.stderr, self.timeout = returncode, stdout, stderr, timeout

    def __call__(self, command, **kwargs):
        self.calls.append((command, kwargs))
        if self.timeout:
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        return subprocess.CompletedProcess(command, self.returncode, self.stdout, self.stderr)


def test_run_child_runs_python_on_the_request():
    fake = FakeRun()
    assert run_child("REQUEST", {"A": "1"}, run=fake) == ChildTimes(before_s=4.0, first_s=2.0, forward_s=1.0)
    ((command, kwargs),) = fake.calls
    assert command == [sys.executable, "-c", CHILD_CODE, "REQUEST"]
    assert kwargs["env"] == {"A": "1"} and kwargs["capture_output"] and kwargs["text"] and kwargs["timeout"] > 0


def test_a_failed_child_says_why():
    stderr = "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory\n\n"
    with pytest.raises(ChildFailed, match="exit status 1: torch.OutOfMemoryError: CUDA out of memory"):
        run_child("REQUEST", run=FakeRun(returncode=1, stdout="", stderr=stderr))
    with pytest.raises(ChildFailed, match="timed out after"):
        run_child("REQUEST", run=FakeRun(timeout=True))


def test_warm_cache_runs_the_child_twice_and_reports_the_second():
    runs = []

    def run(request, env):
        runs.append((request, env))
        return ChildTimes(5.0, 30.0, 20.0) if len(runs) == 1 else ChildTimes(4.0, 2.0, 1.0)

    case = _case("warm")
    m = measure_first_call(case, "flash-dma-percall", "fwdbwd", run=run)
    assert (m.ms, m.setup_s, m.peak_gib) == (2000.0, 4.0, None)
    assert runs == [(child_request(case, "flash-dma-percall", "fwdbwd"), None)] * 2  # this process's environment


def test_cold_caches_give_the_child_fresh_empty_cache_folders():
    runs = []

    def run(request, env):
        folders = [env["TRITON_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"]]
        runs.append(folders)
        assert len(set(folders)) == 2 and not any(os.path.exists(f) for f in folders)
        assert os.path.isdir(os.path.dirname(folders[0]))
        assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is kept
        return ChildTimes(before_s=4.0, first_s=25.0, forward_s=12.0)

    m = measure_first_call(_case("cold"), "flash-dma-percall", "fwd", run=run)
    assert m.ms == 25000.0 and len(runs) == 1
    assert not os.path.exists(os.path.dirname(runs[0][0]))  # removed afterwards


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_the_child_prints_its_times_on_the_cpu(mode, capsys):
    start = time.perf_counter()
    child_main(start, ["-c", child_request(_case(), "flash-dma-percall", mode, device="cpu")])
    times = parse_child_output(capsys.readouterr().out)
    assert times.before_s > 0 and 0 < times.forward_s <= times.first_s
    assert (times.forward_s == times.first_s) == (mode == "fwd")
    assert times.before_s + times.first_s <= time.perf_counter() - start
    assert first_call.triton.knobs.compilation.listener is None  # the child's record is not left installed


def test_a_real_child_process_on_the_cpu():
    times = run_child(child_request(_case(), "flash-dma-percall", "fwd", device="cpu"))
    assert times.before_s > 0 and times.first_s > 0


def test_packed_documents_survive_the_trip_to_the_child():
    from flash_dma.benchmark.first_call import _case_from_dict, child_request
    from flash_dma.benchmark.suites import varlen_cases

    (case,) = varlen_cases()
    request = json.loads(child_request(case, "flash-dma-varlen", "fwd"))
    assert _case_from_dict(request["case"]) == case
