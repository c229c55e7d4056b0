"""The kernels compile for Hopper (sm90) on any machine, GPU or not.

The Triton interpreter runs Python that the compiler rejects (tuple loops, mixed return types),
so CI also compiles each kernel family to machine code with Triton's bundled ptxas. That needs
a process without TRITON_INTERPRET, where ``@triton.jit`` makes compilable functions.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")
ROOT = Path(__file__).resolve().parents[3]


# Shards of the variant list, each a process of its own, so that the suite's workers share the
# minutes of compiling instead of one worker taking all of them at the end of the run.
SHARDS = 4


@pytest.mark.parametrize("shard", range(1, SHARDS + 1), ids=lambda i: f"shard{i}of{SHARDS}")
def test_every_kernel_variant_compiles_for_sm90(shard):
    from flash_dma.backends.triton.variants import VARIANTS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "tools.compile_report", "--arch", "90", "--shard", f"{shard}/{SHARDS}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    compiled = [line.split()[0] for line in result.stdout.splitlines() if "smem=" in line]
    assert compiled == [variant.name for variant in VARIANTS[shard - 1 :: SHARDS]], result.stdout
