"""tools/compile_report.py: PTX kept per variant, and compared instruction by instruction."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compiling_environment

pytest.importorskip("triton.backends.nvidia")
REPO = Path(__file__).resolve().parents[2]


def test_instructions_ignore_register_numbers_parameter_names_and_debug_lines():
    from tools.compile_report import instructions

    ptx = "ld.param.u64 %rd1, [k_param_0];\n.loc 1 2 3\nadd.s32 %r5, %r3, 1;\n$L__BB0_1:\n// note\n.section .debug_info {"
    renumbered = "ld.param.u64 %rd7, [k_param_4];\nadd.s32 %r9, %r2, 1;\n"
    assert instructions(ptx) == instructions(renumbered)
    assert instructions(ptx) != instructions(renumbered.replace("add.s32", "sub.s32"))


def test_a_variant_compared_with_its_own_ptx_is_the_same(tmp_path):
    # Stopped before ptxas, the same PTX; and its empty binary stays out of the process's cache.
    cache, ptx = tmp_path / "cache", tmp_path / "ptx"
    env = {**compiling_environment(), "TRITON_CACHE_DIR": str(cache)}

    def report(*options: str) -> str:
        command = [sys.executable, "-m", "tools.compile_report", "--only", "forward-key-list", *options]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=600).stdout

    report("--ptx-dir", str(ptx))
    assert [path.name for path in ptx.iterdir()] == ["forward-key-list.ptx"]
    (line,) = report("--same-as", str(ptx), "--no-ptxas").splitlines()
    assert line.startswith("forward-key-list ") and line.endswith(" same") and "regs=-" in line
    binaries = list(cache.rglob("*.cubin"))
    assert len(binaries) == 1 and binaries[0].stat().st_size > 0


def test_stores_handed_over_by_one_lane_without_a_barrier_of_the_lanes_are_found():
    from tools.compile_report import unordered_handovers

    stores = "st.shared.v4.b32 [%r1], {%r2, %r3, %r4, %r5};\n"
    arrive = "@%p4 mbarrier.arrive.expect_tx.shared.b64 _, [%r6], 32768;\n"
    assert unordered_handovers(stores + arrive) == 1
    assert unordered_handovers("@%p3 " + stores + arrive + stores + arrive) == 2
    for barrier in ("bar.warp.sync -1;\n", "bar.sync 0, 128;\n", "barrier.sync 1;\n"):
        assert unordered_handovers(stores + barrier + arrive) == 0
    assert unordered_handovers(arrive + "ld.shared.b32 %r1, [%r2];\n" + arrive) == 0  # nothing stored
