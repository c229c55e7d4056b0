"""The first call in a new process: how long a user waits for a first result.

Each row runs a child Python process (``python -c CHILD_CODE REQUEST``). The child imports
flash_dma, makes the case's inputs, prepares the method (for a Llama method: builds the model),
then times its first call, forward or forward + backward, synchronised (the forward alone too),
and prints one JSON line, which the parent parses. Compilation and autotuning in the child are
what is measured; a flash-dma call compiles its kernels side by side ("Compiling ahead" in
``backends/triton/launch.py``) unless the child's environment sets ``FLASH_DMA_COMPILE_AHEAD=0``.

- Warm cache: the child runs twice with the default compiler caches, and the second run is
  reported; the first fills the caches (or finds them full already).
- Cold caches: one child with ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` pointing at
  fresh, empty folders, so that every kernel is compiled (and autotuned) from scratch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton

from flash_dma.benchmark.inputs import make_inputs
from flash_dma.benchmark.measure import Measurement
from flash_dma.benchmark.methods import METHODS, Prepared
from flash_dma.benchmark.suites import Case
from flash_dma.precompile import CompileRecord

# The clock starts before any import: importing flash_dma (torch, triton) is part of the wait.
CHILD_CODE = (
    "import time; start = time.perf_counter(); "
    "from flash_dma.benchmark.first_call import child_main; child_main(start)"
)
CHILD_TIMEOUT_S = 300  # 10x the cold-cache target: a hung child must not take the whole run
COMPILER_CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@dataclass(frozen=True)
class ChildTimes:
    """``before_s``: from the child's start to its first call (imports, inputs, the model);
    ``first_s``: the first call, synchronised; ``forward_s``: its forward alone (all of it for a
    forward); ``compiles``: each Triton compilation of the child, as ``(kernel name, seconds,
    cache hit)``, in the order they finished (``flash_dma.precompile.CompileRecord``)."""

    before_s: float
    first_s: float
    forward_s: float
    compiles: tuple[tuple[str, float, bool], ...] = ()

    @property
    def compiled(self) -> int:
        """The kernels the child compiled (found in no cache)."""
        return sum(not hit for _, _, hit in self.compiles)


class ChildFailed(RuntimeError):
    """The child exited with an error, ran out of time, or printed no result."""


def child_request(case: Case, method: str, mode: str, device: str = "cuda") -> str:
    """The child's one argument: what to run, as JSON."""
    return json.dumps({"case": asdict(case), "method": method, "mode": mode, "device": device})


def _case_from_dict(fields: dict) -> Case:
    documents = None if fields.get("documents") is None else tuple(fields["documents"])
    return Case(**{**fields, "methods": tuple(fields["methods"]), "modes": tuple(fields["modes"]),
                   "documents": documents})


def first_call_seconds(prepared: Prepared, mode: str, synchronize: Callable[[], None]) -> tuple[float, float]:
    """Wall times of the first forward (``"fwd"``) or forward and backward (``"fwdbwd"``), and of its forward alone.

    The backward is a scalar loss's (``out.sum()``), as a training step's: a gradient tensor passed
    to ``backward`` makes torch import ``torch.fx.experimental.symbolic_shapes`` (and sympy) on its
    first call, about 3 s on the H100 machine, whatever the attention."""
    start = time.perf_counter()
    out = prepared.forward()
    synchronize()
    forward_s = time.perf_counter() - start
    if mode != "fwdbwd":
        return forward_s, forward_s
    out.sum().backward()
    synchronize()
    return time.perf_counter() - start, forward_s


def child_main(start: float, argv: list[str] | None = None) -> None:
    """The child's body: runs the request in ``argv[1]`` and prints ``{"before_s": .., "first_s": ..,
    "forward_s": .., "compiles": [..]}``."""
    request = json.loads((sys.argv if argv is None else argv)[1])
    case = _case_from_dict(request["case"])
    device = torch.device(request["device"])

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    record, listening = CompileRecord(), triton.knobs.compilation.listener
    triton.knobs.compilation.listener = record
    try:
        prepared = METHODS[request["method"]].prepare(case, make_inputs(case, device))
        synchronize()
        before_s = time.perf_counter() - start
        first_s, forward_s = first_call_seconds(prepared, request["mode"], synchronize)
    finally:
        triton.knobs.compilation.listener = listening
    print(json.dumps({"before_s": before_s, "first_s": first_s, "forward_s": forward_s, "compiles": record.compiles}), flush=True)


def parse_child_output(stdout: str) -> ChildTimes:
    """The child's result: its last line that is a JSON object (anything printed before it is ignored)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            fields = json.loads(line)
            compiles = tuple((str(name), float(seconds), bool(hit)) for name, seconds, hit in fields.get("compiles", ()))
            return ChildTimes(before_s=float(fields["before_s"]), first_s=float(fields["first_s"]),
                              forward_s=float(fields["forward_s"]), compiles=compiles)
    raise ChildFailed(f"no result line in the child's output ({len(stdout)} characters)")


def run_child(request: str, env: dict[str, str] | None = None, run=subprocess.run) -> ChildTimes:
    """Run one child on ``request`` with the environment ``env`` (None: this process's)."""
    try:
        completed = run([sys.executable, "-c", CHILD_CODE, request], capture_output=True, text=True, env=env,
                        timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"timed out after {CHILD_TIMEOUT_S} s") from None
    if completed.returncode != 0:
        lines = [line for line in completed.stderr.splitlines() if line.strip()]
        raise ChildFailed(f"exit status {completed.returncode}: {lines[-1] if lines else 'no error output'}")
    return parse_child_output(completed.stdout)


def fresh_cache_environment(folder: str) -> dict[str, str]:
    """This process's environment with every compiler cache in its own new folder under ``folder``."""
    return {**os.environ, **{name: os.path.join(folder, name.lower()) for name in COMPILER_CACHE_VARIABLES}}


def measure_first_call(case: Case, method: str, mode: str, run: Callable[..., ChildTimes] = run_child) -> Measurement:
    """The first call of ``method`` on ``case`` in a new process, with ``case.cache`` caches."""
    request = child_request(case, method, mode)
    if case.cache == "warm":
        run(request, None)
        times = run(request, None)
    else:
        with tempfile.TemporaryDirectory(prefix="flash-dma-cold-") as folder:
            times = run(request, fresh_cache_environment(folder))
    return Measurement(ms=times.first_s * 1e3, peak_gib=None, setup_s=times.before_s)
