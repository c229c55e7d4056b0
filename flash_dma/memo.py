"""Memos for the host path of a call: what a layout (a hashable record of shapes, strides,
dtypes, devices and settings) decides is worked out once and looked up afterwards
(:class:`Memo`); values checked once per tensor version (:class:`CheckedValues`); and tensors
derived from an input, made once per version of it (:class:`DerivedTensors`)."""

from __future__ import annotations

import weakref
from contextvars import ContextVar

import torch

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


# True while a call's host code runs with its kernels handed to the compiler, none launched
# (``backends/triton/launch.py``, "Compiling ahead"): what it derives is never written.
DRY_RUN: ContextVar[bool] = ContextVar("flash_dma_dry_run", default=False)


def dry_running() -> bool:
    """Whether the current host code is a call's dry run (``launch.dry_run``): it launches no
    kernel, and what it derives is never written, so it must not be memoised, nor counted by
    whoever watches for a call's launches."""
    return DRY_RUN.get()


def _traced_or_captured() -> bool:
    """Whether the current call is traced (``torch.compile``) or captured in a CUDA graph: a
    memoised result would then be baked into the graph, and a later replay would not see a change."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def may_memoise() -> bool:
    """Whether what the current call derives may be kept for later calls: not while it is traced,
    captured or dry-run (what it derives is then baked into a graph, or never written)."""
    return not (_traced_or_captured() or dry_running())


class DerivedTensors:
    """Tensors derived from a source tensor (a dense mask's bits and summary), kept while the
    source lives and its version counter stays: a mask that every layer shares, in the forward
    and the backward, is worked on once per step, and one changed in place is worked on again.

    Keyed by identity, held by weak reference (an entry goes with its source). A source without a
    version counter (an inference tensor), or a call being traced, captured or dry-run
    (:data:`DRY_RUN`), is never memoised.
    """

    def __init__(self):
        self._entries: dict[int, tuple] = {}  # id(source) -> (weakref, version, {key: value})

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, source: torch.Tensor, key, make):
        """``make()``, or what it returned for ``source`` and ``key`` as ``source`` is now."""
        if not isinstance(source, torch.Tensor):
            # Keyed by a tensor's version counter: a mask object (BitMask, KeyIntervals) must be
            # turned into its tensors first, or the entry could never see it change.
            raise TypeError(f"source: expected a torch.Tensor, got {type(source).__name__}")
        if source.is_inference() or not may_memoise():
            return make()
        entry = self._entries.get(id(source))
        version = source._version
        if entry is None or entry[0]() is not source or entry[1] != version:
            if entry is None or entry[0]() is not source:
                weakref.finalize(source, self._entries.pop, id(source), None)
            entry = self._entries[id(source)] = (weakref.ref(source), version, {})
        values = entry[2]
        if key not in values:
            values[key] = make()
        return values[key]
