"""The kernels compile for Hopper (sm90) on any machine, GPU or not.

The Triton interpreter runs Python that the compiler rejects (tuple loops, mixed return types),
so CI also compiles every kernel variant for sm90: each kernel's first variant to machine code
with Triton's bundled ptxas, the others to PTX (the front end and LLVM, where such errors show;
ptxas, a third of the time, assembles every variant on the GPU runs). That needs a process
without TRITON_INTERPRET, where ``@triton.jit`` makes compilable functions.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compiling_environment

pytest.importorskip("triton.backends.nvidia")
ROOT = Path(__file__).resolve().parents[3]


# Each kernel's first variant (one case a kernel family: the newest releases' slice runs this case
# alone, tests/conftest.py), then the other variants in shards, each a process of its own, so that
# the suite's workers share the minutes of compiling.
PARTS = [("first", "1/1"), *(("others", f"{i}/3") for i in range(1, 4))]


@pytest.mark.parametrize("kernels, shard", PARTS, ids=lambda p: p.replace("/", "of"))
def test_every_kernel_variant_compiles_for_sm90(kernels, shard):
    # Compiling is the check: the registers' count would be a second ptxas run, a quarter more time.
    command = ["--arch", "90", "--kernels", kernels, "--shard", shard, "--no-registers" if kernels == "first" else "--no-ptxas"]
    result = subprocess.run(
        [sys.executable, "-m", "tools.compile_report", *command],
        cwd=ROOT, env=compiling_environment(), capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    compiled = [line.split()[0] for line in result.stdout.splitlines() if "smem=" in line]
    assert compiled == [variant.name for variant in _part(kernels, shard)], result.stdout


def _part(kernels: str, shard: str) -> list:
    from tools.compile_report import chosen_variants

    index, count = (int(n) for n in shard.split("/"))
    return chosen_variants(kernels)[index - 1 :: count]


def test_the_parts_cover_every_variant_once():
    from flash_dma.backends.triton.variants import VARIANTS

    names = [variant.name for part in PARTS for variant in _part(*part)]
    assert sorted(names) == sorted(variant.name for variant in VARIANTS)
