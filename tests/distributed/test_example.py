"""``examples/context_parallel.py``, as docs/distributed.md runs it: 2 processes check themselves."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("distributed")

EXAMPLE = Path(__file__).parents[2] / "examples" / "context_parallel.py"


def test_example_runs():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--world", "2"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("match one process") == 2, result.stdout
