"""Result rows, and selecting them by method, pass and case fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flash_dma.benchmark.suites import Case


@dataclass(frozen=True)
class Result:
    """One (case, method, mode) row. A skipped row has ``status="skipped"``, no numbers, and the
    reason (or the error it raised) in ``note``.

    ``ms`` is the time of one call: on the GPU (the median), on the host (host rows: the mean over
    many calls, with ``cpu_ms`` the CPU time per call), or the first call in a new process
    (first-call rows). ``tflops`` is effective (over ``active_pairs``) and given for attention
    rows timed on the GPU; ``gbps`` counts the K/V bytes the method reads and is given for decode
    rows only; ``tokens_per_s`` is the generated tokens per second of serving rows; ``peak_gib`` excludes the inputs; ``setup_s`` is the wall time spent before timing
    (block masks, compilation, autotuning; a new process's imports and inputs); ``sm_clock`` the
    SM clock while a GPU row was timed and why it was lowered, e.g. ``"1800-1815 MHz (power cap)"``
    (``""`` where not sampled: host and first-call rows, no ``nvidia-smi``, or timed calls
    shorter than its sampling period).
    """

    case: Case
    method: str
    mode: str
    status: str = "ok"
    ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    peak_gib: float | None = None
    setup_s: float | None = None
    active_pairs: int | None = None
    cpu_ms: float | None = None
    tokens_per_s: float | None = None
    sm_clock: str = ""
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


def select(results: list[Result], method: str | None = None, mode: str | None = None, ok_only: bool = True,
           **case_fields) -> list[Result]:
    """Rows of ``method`` in ``mode`` whose case has the given field values (None: any)."""
    return [
        r
        for r in results
        if (method is None or r.method == method)
        and (mode is None or r.mode == mode)
        and (r.ok or not ok_only)
        and all(value is None or getattr(r.case, name) == value for name, value in case_fields.items())
    ]
