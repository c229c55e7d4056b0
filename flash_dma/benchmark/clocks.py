"""The GPU's SM clock while rows are timed, and why it is below the full clock, as ``nvidia-smi``
samples them: a step that reaches the card's power limit runs at a lower clock than one that does
not, so two methods' times can compare different clocks (docs/design-notes.md, "The 16K step, the
host and the power cap").

``with clock_log(): ...`` samples the current GPU every :data:`PERIOD_MS` in a child ``nvidia-smi``
for the block's length; :func:`clocks_between` then describes the samples of a stretch of wall
time, such as a row's timed calls. Without ``nvidia-smi``, or outside such a block, there are none.
``nvidia-smi`` stamps its samples in local time, as ``time.time()`` is compared with them: the hour
a daylight-saving clock goes back is ambiguous (GPU machines keep UTC).
"""

from __future__ import annotations

import bisect
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
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


class ClockLog:
    """The samples a child ``nvidia-smi`` prints, read from its pipe by a daemon thread as they come.

    The pipe closes with this process: should it die without ending the child, the child's next
    line gets SIGPIPE rather than growing a file nobody reads.
    """

    def __init__(self, child: subprocess.Popen):
        self.child = child
        self.samples: list[Sample] = []  # in the order taken
        self.other: list[str] = []  # lines that are no sample (an error of nvidia-smi's)
        self.warned = False
        self.reader = threading.Thread(target=self._read, name="flash_dma_clock_log", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.child.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)
            elif len(self.other) < 3:
                self.other.append(line.strip())

    def between(self, start: float, end: float) -> list[Sample]:
        """The samples taken from ``start`` to ``end`` (seconds since the epoch, ``time.time()``'s),
        after waiting two periods for the last of them to be read; a warning, once, if the child
        has ended."""
        time.sleep(2 * PERIOD_MS / 1e3)
        code = self.child.poll()
        if code is not None and not self.warned:
            self.warned = True
            said = f": {self.other[0]}" if self.other else ""
            warnings.warn(f"nvidia-smi ended (exit code {code}{said}); no SM clock is recorded after {time.ctime()}",
                          stacklevel=3)
        return within(self.samples, start, end)  # appended to, never changed: a slice is safe to take

    def close(self) -> None:
        self.child.terminate()
        self.child.wait()
        self.child.stdout.close()
        self.reader.join()


def within(samples: list[Sample], start: float, end: float) -> list[Sample]:
    """The samples, in the order taken, from ``start`` to ``end``."""
    def when(sample: Sample) -> float:
        return sample.seconds

    return samples[bisect.bisect_left(samples, start, key=when):bisect.bisect_right(samples, end, key=when)]


# The log of the enclosing clock_log block. A thread started inside the block does not see it
# (the benchmark times its rows on the thread that opened it).
_LOG: ContextVar[ClockLog | None] = ContextVar("flash_dma_clock_log", default=None)


@contextmanager
def clock_log(command: tuple[str, ...] = ("nvidia-smi",), gpu: str | None = None) -> Iterator[None]:
    """Sample the clocks of ``gpu`` (``nvidia-smi``'s ``--id``; by default the current CUDA
    device's UUID) while the block runs. ``command`` is the ``nvidia-smi`` to run; where it cannot
    start, the block runs without samples."""
    if gpu is None:
        import torch

        gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    try:
        child = subprocess.Popen(
            [*command, f"--id={gpu}", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", f"--loop-ms={PERIOD_MS}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
    except OSError:
        yield
        return
    log = ClockLog(child)
    token = _LOG.set(log)
    try:
        yield
    finally:
        _LOG.reset(token)
        log.close()


def samples_between(start: float, end: float) -> list[Sample]:
    """The samples of the enclosing :func:`clock_log` taken from ``start`` to ``end`` (seconds since
    the epoch, ``time.time()``'s); none outside such a block."""
    log = _LOG.get()
    return [] if log is None else log.between(start, end)


def clocks_between(start: float, end: float) -> str:
    """:func:`describe` of :func:`samples_between`."""
    return describe(samples_between(start, end))
