"""A kernel's cache key is the same in every process, whatever order its kernels were hashed in
(``backends/triton/kernel_keys.py``): a kernel one process compiled, another finds in the cache."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compiling_environment

ROOT = Path(__file__).resolve().parents[3]
# Kernels sharing callees and global constexprs (the Hopper ones share hopper/common.py and tiles.py).
KERNELS = {
    "forward-hopper": "flash_dma.backends.triton.hopper.forward:_attn_fwd_hopper_kernel",
    "dkdv-hopper": "flash_dma.backends.triton.hopper.dkdv:_dkdv_hopper_kernel",
    "dq-hopper": "flash_dma.backends.triton.hopper.dq:_dq_hopper_kernel",
    "forward": "flash_dma.backends.triton.forward:_attn_fwd_kernel",
}
# In a new process, each kernel hashed in the given order; prints {name: key}.
CHILD = """
import importlib, json, sys
from flash_dma.backends.triton.kernel_keys import cache_key
kernels = json.loads(sys.argv[1])
keys = {}
for name, where in kernels.items():
    module, _, attribute = where.partition(":")
    keys[name] = cache_key(getattr(importlib.import_module(module), attribute))
print(json.dumps(keys))
"""


def _keys_hashed_in(order: list[str]) -> dict[str, str]:
    ordered = json.dumps({name: KERNELS[name] for name in order})
    result = subprocess.run([sys.executable, "-c", CHILD, ordered], cwd=ROOT, env=compiling_environment(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_a_kernels_key_does_not_depend_on_the_order_kernels_were_hashed_in():
    pytest.importorskip("triton.backends.nvidia")
    first = _keys_hashed_in(list(KERNELS))
    second = _keys_hashed_in(list(reversed(KERNELS)))
    assert first == second
    assert len(set(first.values())) == len(KERNELS)
