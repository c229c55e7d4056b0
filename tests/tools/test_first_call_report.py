"""tools/first_call_report.py on the CPU: a cold and a warm child, and the table of their compilations."""

from tests.helpers import run_tool_on_cpu


def test_first_call_report_runs_a_cold_and_a_warm_child():
    run = run_tool_on_cpu("first_call_report.py", "--mode", "fwd", "--length", "128")
    lines = run.stdout.splitlines()
    # The interpreter compiles nothing: each child reports its times and zero kernels.
    assert lines[0].startswith("cold caches: before the call ") and lines[0].endswith("0 kernels, 0.00 s compiling, 0.00 s loading from the cache")
    assert lines[1].startswith("warm caches: before the call ")
    assert lines[3].split() == ["kernel", "cold", "(s)", "warm", "(s)"]
