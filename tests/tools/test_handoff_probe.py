"""tools/handoff_probe.py: the hand-over probe compiles for sm90, and only its control leaves the
loader's stores unordered before the arrive (what racecheck cannot tell apart: docs/reliability.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compiling_environment

pytest.importorskip("triton.backends.nvidia")
REPO = Path(__file__).resolve().parents[2]


def test_only_the_control_hands_stores_over_unordered():
    # Outside the interpreter, where Gluon compiles: Triton lowers mbarrier.expect to one lane's
    # arrive with no barrier of the lanes before it, which the synced form adds.
    code = ("from tools.handoff_probe import ptx; from tools.compile_report import unordered_handovers as u; "
            "print(u(ptx(True)), u(ptx(False)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=compiling_environment(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["0", "1"]
