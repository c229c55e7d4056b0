"""Bounded memos for the host path of a call: what a layout (a hashable record of shapes,
strides, dtypes, devices and settings) decides is worked out once and looked up afterwards."""

from __future__ import annotations

MAX_ENTRIES = 4096  # layouts a memo remembers; past that it starts afresh

_MEMOS: list[Memo] = []


class Memo(dict):
    """A dict of at most :data:`MAX_ENTRIES` entries, cleared when full, so that a process that
    keeps meeting new shapes does not grow it without bound. Values must hold no tensor, so that
    no call's memory outlives the call."""

    def __init__(self):
        super().__init__()
        _MEMOS.append(self)

    def remember(self, key, value):
        """Store and return ``value``."""
        if len(self) >= MAX_ENTRIES:
            self.clear()
        self[key] = value
        return value


def forget_memos() -> None:
    """Empty every memo, so that the next calls decide afresh."""
    for memo in _MEMOS:
        memo.clear()
