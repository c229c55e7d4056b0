"""``examples/context_parallel.py``, as docs/distributed.md runs it: 2 processes check themselves,
next to a process that keeps the CPU busy (as other jobs do on a shared machine)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("distributed")

EXAMPLE = Path(__file__).parents[2] / "examples" / "context_parallel.py"
# Matrix products on every core until killed: the ranks' threads are descheduled and resumed at
# random, as under any other load.
BUSY = "import torch\nx = torch.randn(512, 512)\nwhile True:\n    x = torch.tanh(x @ x)\n"


def test_example_runs_next_to_a_busy_process():
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        result = subprocess.run([sys.executable, str(EXAMPLE), "--world", "2"], capture_output=True, text=True, timeout=600)
    finally:
        loaded = busy.poll() is None  # the busy process ran the whole time
        busy.kill()
        busy.wait()
    assert loaded, "the busy process had stopped"
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("match one process") == 2, result.stdout
