"""Kernel cache keys: Triton's keys of a kernel and its callees, computed callees first, so that
every process finds the same key for the same source.

Triton keys a compiled kernel by a hash of its jit function, which folds in each callee's hash and
the global constexprs (``MASK_WORDS = tl.constexpr(1)``) that the function and its callees read.
Triton 3.6 (``DependenciesFinder._update_hash``) reads a callee's globals before computing the
callee's hash: a callee hashed for the first time there contributes its hash but not its globals.
A kernel's key then depends on which kernels were hashed before it, in that process, and in what
order. Measured on the three Hopper kernels: hashed forward, dK/dV, dQ, each gets another key than
hashed dK/dV, dQ, forward, so a kernel compiled by one process (``flash-dma precompile``, or an
earlier run whose compilations on the pool finished in another order) is compiled again by the
next. Hashing every callee before its caller gives each function its callees' globals whatever
the order, and so one key per source.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from types import ModuleType

from triton.runtime.jit import JITFunction

try:  # Triton >= 3.5: the common base of jit and constexpr functions, both hashed into keys
    from triton.runtime.jit import JITCallable
except ImportError:  # pragma: no cover - older Triton
    JITCallable = JITFunction

_HASHING = threading.Lock()
_HASHED: set[int] = set()  # id() of the kernels hashed here, callees first


def cache_key(kernel: JITFunction) -> str:
    """``kernel.cache_key``, with every jit function it calls hashed first (module doc). Call it
    before Triton first hashes ``kernel`` (its first compilation): a key Triton made in another
    order stays as made."""
    with _HASHING:
        if id(kernel) not in _HASHED:
            _hash_callees_first(kernel, set())
            _HASHED.add(id(kernel))
    return kernel.cache_key


def _hash_callees_first(function: JITCallable, visited: set[int]) -> None:
    if id(function) in visited:
        return
    visited.add(id(function))
    for callee in _callees(function):
        _hash_callees_first(callee, visited)
    function.cache_key  # noqa: B018 - computed and memoised by Triton, after its callees


def _callees(function: JITCallable) -> list[JITCallable]:
    """The jit functions that ``function``'s source names: directly, through a module
    (``tiles.helper``), or as a method of an aggregate it names."""
    python = function.fn
    closure = inspect.getclosurevars(python)
    scope = {**python.__globals__, **closure.nonlocals}
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(function.src))):
        value = _resolve(node, scope) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if isinstance(value, JITCallable) and value is not function:
            found.append(value)
        elif getattr(value, "__triton_aggregate__", False):
            found += [attr for attr in value.hash_attrs if isinstance(attr, JITCallable)]
    return found


def _resolve(node: ast.expr, scope: dict):
    """What a name or a dotted name through modules refers to in ``scope``; None otherwise."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
        owner = _resolve(node.value, scope)
        if isinstance(owner, ModuleType) or getattr(owner, "__triton_aggregate__", False):
            return getattr(owner, node.attr, None)
    return None
