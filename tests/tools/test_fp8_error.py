"""tools/fp8_error.py on the CPU: FP8 inputs err by e4m3's rounding, 16-bit inputs far less."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_fp8_error_rows_are_ordered_by_precision():
    run = subprocess.run(
        [sys.executable, "tools/fp8_error.py", "--device", "cpu", "--seqlen", "256", "--heads", "4", "--head-dim", "64"],
        cwd=REPO, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    for window in ("full", "causal"):
        line = next(line for line in run.stdout.splitlines() if line.startswith(f"{window}: "))
        rows = {name: float(value) for name, value in (part.rsplit(" ", 1) for part in line[len(window) + 2:].split("; "))}
        assert list(rows) == ["bfloat16 inputs", "float16 inputs", "FP8 inputs", "FP8, the Hopper forward emulated", "rms(O)"]
        assert rows["float16 inputs"] < rows["bfloat16 inputs"] < rows["FP8 inputs"] < 0.2 * rows["rms(O)"]
        assert 0.5 < rows["FP8, the Hopper forward emulated"] / rows["FP8 inputs"] < 2
