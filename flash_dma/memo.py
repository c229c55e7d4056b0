"""Bounded memos for the host path of a call: what a layout (a hashable record of shapes,
strides, dtypes, devices and settings) decides is worked out once and looked up afterwards."""

from __future__ import annotations

import weakref

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


class CheckedValues:
    """Device tensors whose values passed a host check, by identity and version counter: the
    check reads them (a device-to-host copy, which waits for the GPU) once per version and
    context, not on every call. A model's layers all get the same ``cu_seqlens`` or cache
    lengths, so one read per step is enough. Holds weak references only."""

    def __init__(self, max_entries: int = 64):
        self._entries: dict = {}
        self._max_entries = max_entries

    @staticmethod
    def _key(tensors) -> tuple:
        return tuple(None if t is None else id(t) for t in tensors)

    @staticmethod
    def _versions(tensors) -> tuple | None:
        """The tensors' version counters, or None if one has none (an inference tensor, which
        may change in place unseen: checked on every call)."""
        if any(t is not None and t.is_inference() for t in tensors):
            return None
        return tuple(None if t is None else t._version for t in tensors)

    def passed(self, tensors: tuple, context: tuple) -> bool:
        """Whether ``tensors`` (None entries allowed), as they are now, passed with ``context``."""
        entry = self._entries.get(self._key(tensors))
        versions = self._versions(tensors)
        if entry is None or versions is None:
            return False
        refs, checked_versions, checked_context = entry
        return (
            all((ref is None and t is None) or (ref is not None and ref() is t) for ref, t in zip(refs, tensors))
            and checked_versions == versions
            and checked_context == context
        )

    def remember(self, tensors: tuple, context: tuple) -> None:
        versions = self._versions(tensors)
        if versions is None:
            return
        if len(self._entries) >= self._max_entries:
            self._entries.clear()
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self._entries[self._key(tensors)] = (refs, versions, context)


def forget_memos() -> None:
    """Empty every memo, so that the next calls decide afresh."""
    for memo in _MEMOS:
        memo.clear()
