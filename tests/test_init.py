"""``import flash_dma``: public names resolved on first use, and modules that import in any order."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flash_dma

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves_from_its_module():
    for name in flash_dma.__all__:
        value = getattr(flash_dma, name)
        assert value.__module__.startswith(flash_dma._EXPORTS[name]), name
    assert set(flash_dma.__all__) <= set(dir(flash_dma))


def test_submodules_are_attributes_and_unknown_names_are_not():
    assert flash_dma.masks.create_mask is flash_dma.create_mask
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        flash_dma.no_such_name  # noqa: B018


# The modules that took part in an import cycle: each must import first in a new process, as a
# user's first `from flash_dma.masks import ...` does now that `import flash_dma` imports nothing.
@pytest.mark.parametrize("module", ["flash_dma.masks", "flash_dma.summaries"])
def test_a_module_imports_first(module):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
