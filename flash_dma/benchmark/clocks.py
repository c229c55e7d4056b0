"""The GPU's SM clock while rows are timed, and why it is below the full clock, as ``nvidia-smi``
samples them: a step that reaches the card's power limit runs at a lower clock than one that does
not, so two methods' times can compare different clocks (docs/design-notes.md, "The 16K step, the
host and the power cap").

``with clock_log(): ...`` samples the current GPU every :data:`PERIOD_MS` in a child ``nvidia-smi``
for the block's length; :func:`clocks_between` then describes the samples of a stretch of wall
time, such as a row's timed calls. Without ``nvidia-smi``, or outside such a block, there are none.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
PERIOD_MS = 25

# NVML's clock event reasons (nvmlClocksEventReasons), bit by bit.
REASONS = (
    (0x1, "idle"), (0x2, "application clocks"), (0x4, "power cap"), (0x8, "hardware slowdown"),
    (0x10, "sync boost"), (0x20, "software thermal"), (0x40, "hardware thermal"), (0x80, "power brake"),
    (0x100, "display clock"),
)


class Sample(NamedTuple):
    """One ``nvidia-smi`` reading: when (seconds since the epoch), SM MHz, watts (``nvidia-smi``'s
    average), reason bits."""

    seconds: float
    sm_mhz: int
    watts: float
    reasons: int


def parse_sample(line: str) -> Sample | None:
    """A ``--format=csv,noheader,nounits`` line of :data:`FIELDS`, or None for any other line (a
    field the driver does not report reads ``[N/A]``)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return Sample(stamp, int(fields[1]), float(fields[2]), int(fields[3], 16))
    except ValueError:
        return None


def reason_names(bits: int) -> str:
    names = [name for bit, name in REASONS if bits & bit]
    return ", ".join(names) if names else "none"


def describe(samples: list[Sample]) -> str:
    """``"1800-1815 MHz (power cap)"``: the SM clocks of ``samples`` and every reason any of them
    gives; ``""`` for none."""
    if not samples:
        return ""
    clocks = sorted(sample.sm_mhz for sample in samples)
    span = f"{clocks[0]} MHz" if clocks[0] == clocks[-1] else f"{clocks[0]}-{clocks[-1]} MHz"
    bits = 0
    for sample in samples:
        bits |= sample.reasons
    return f"{span} ({reason_names(bits)})"


_LOG: ContextVar[Path | None] = ContextVar("flash_dma_clock_log", default=None)


@contextmanager
def clock_log(command: tuple[str, ...] = ("nvidia-smi",), gpu: str | None = None) -> Iterator[None]:
    """Sample the clocks of ``gpu`` (``nvidia-smi``'s ``--id``; by default the current CUDA
    device's UUID) while the block runs. ``command`` is the ``nvidia-smi`` to run; where it cannot
    start, the block runs without samples."""
    if gpu is None:
        import torch

        gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "clocks.csv"
        with log.open("w") as out:  # the child writes on through its own copy of the file
            try:
                child = subprocess.Popen(
                    [*command, f"--id={gpu}", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                     f"--loop-ms={PERIOD_MS}"],
                    stdout=out, stderr=subprocess.DEVNULL,
                )
            except OSError:
                child = None
        token = _LOG.set(log if child is not None else None)
        try:
            yield
        finally:
            _LOG.reset(token)
            if child is not None:
                child.terminate()
                child.wait()


def samples_between(start: float, end: float) -> list[Sample]:
    """The samples of the enclosing :func:`clock_log` taken from ``start`` to ``end`` (seconds
    since the epoch, ``time.time()``'s). It waits two periods first, for the last to be written."""
    log = _LOG.get()
    if log is None:
        return []
    time.sleep(2 * PERIOD_MS / 1e3)
    samples = (parse_sample(line) for line in log.read_text().splitlines())
    return [sample for sample in samples if sample is not None and start <= sample.seconds <= end]


def clocks_between(start: float, end: float) -> str:
    """:func:`describe` of :func:`samples_between`."""
    return describe(samples_between(start, end))
