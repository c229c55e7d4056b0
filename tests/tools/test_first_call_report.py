"""tools/first_call_report.py on the CPU: a cold and a warm child, and the table of their compilations."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_first_call_report_runs_a_cold_and_a_warm_child():
    run = subprocess.run(
        [sys.executable, "tools/first_call_report.py", "--device", "cpu", "--mode", "fwd"], cwd=REPO,
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"},
    )
    lines = run.stdout.splitlines()
    # The interpreter compiles nothing: each child reports its times and zero kernels.
    assert lines[0].startswith("cold caches: before the call ") and lines[0].endswith("0 kernels, 0.00 s compiling, 0.00 s loading from the cache")
    assert lines[1].startswith("warm caches: before the call ")
    assert lines[3].split() == ["kernel", "cold", "(s)", "warm", "(s)"]
