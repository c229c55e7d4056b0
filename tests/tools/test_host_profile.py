"""tools/host_profile.py on the CPU: the host suite's flash-dma calls with their launches stubbed,
timed and split by where their time goes."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_profile_times_and_splits_every_host_row_with_launches_stubbed():
    run = subprocess.run(
        [sys.executable, "tools/host_profile.py", "--stub", "--calls", "20", "--top", "3"], cwd=REPO,
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"},
    )
    assert f"flash_dma from {REPO / 'flash_dma' / '__init__.py'}" in run.stdout
    rows = re.findall(r"== mask=(\w+) bias=(\w+) (\w+): [\d.]+ us per call", run.stdout)
    assert rows == [("token", "key", "fwd"), ("token", "key", "fwdbwd"), ("none", "none", "fwd"), ("none", "none", "fwdbwd")]
    assert run.stdout.count("Triton backend Python") == 4 and run.stdout.count("validation (inputs.py)") == 4
