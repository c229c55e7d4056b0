"""tests/helpers.py: what the suite's own machinery promises."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# In a new process: the suite's processes have run kernels, and Triton's interpreter leaves some
# patches of its device calls in place after a launch.
_COMPARE = """
from triton.runtime import interpreter
from tests.helpers import scan_interpreter_builtins_once

scan_interpreter_builtins_once()
listed = interpreter._patch_builtin
assert listed.listed and all(listed.listed.values())
def patched(patch, pkg):
    scope = interpreter._LangPatchScope()
    patch(pkg, interpreter.interpreter_builder, scope)
    names = sorted(name for _, name, _ in scope._changes)
    scope.restore()
    return names
for pkg in listed.listed:
    assert patched(listed.scan, pkg) == patched(listed, pkg) != [], pkg
    outer = interpreter._LangPatchScope()  # as inside a launch: patched already
    listed.scan(pkg, interpreter.interpreter_builder, outer)
    assert patched(listed.scan, pkg) == patched(listed, pkg), pkg
    outer.restore()
print("same")
"""


def test_the_interpreter_patches_what_its_own_scan_would():
    """``scan_interpreter_builtins_once`` lists each module's builtins once; patching through the
    list sets the same attributes as Triton's scan of the module, before a launch and inside one."""
    result = _interpreted(_COMPARE)
    assert result.stdout.split() == ["same"], result.stderr[-3000:]


# In a new process, first without the suite's patches: a product past int32's range in a kernel.
_OVERFLOW = """
import torch
import triton
import triton.language as tl

@triton.jit
def square(x_ptr, out_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, x * x)

def run():
    x, out = torch.tensor([70000], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    square[(1,)](x, out)
    return out.item()

plain = run()
from tests.helpers import skip_dropped_overflow_checks
skip_dropped_overflow_checks()
print(plain, run())
"""


def test_the_skipped_overflow_checks_report_nothing_on_the_installed_triton():
    """``skip_dropped_overflow_checks`` rests on the interpreter dropping an overflow check's
    verdict: an int32 product that overflows runs, and wraps, with Triton's own check as with none."""
    result = _interpreted(_OVERFLOW)
    wrapped = str((70000 * 70000 + 2**31) % 2**32 - 2**31)
    assert result.stdout.split() == [wrapped, wrapped], result.stderr[-3000:]


def _interpreted(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new Python process under the interpreter, the repository on its path."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
