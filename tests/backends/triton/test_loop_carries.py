"""No kernel carries a value through a ``for`` loop that only a nested loop's bounds read.

Triton 3.6, the pinned release, drops such a value from the loop: its front end's TTIR carries it,
its TTGIR does not, and the nested loop's bounds then read the value from before the loop (3.9
keeps it). A Hopper dK/dV loader that walked a column's heads so stalled the GPU
(docs/design-notes.md, "dK/dV: the queue, timed item by item"). A ``while`` loop, or a value
assigned afresh before the nested loop in each turn, is safe. This test reads every jit function of
the backends and names each such value.
"""

import ast
from pathlib import Path

import pytest

BACKENDS = Path(__file__).resolve().parents[3] / "flash_dma" / "backends"


def _names(node: ast.AST, context: type) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, context)}


def _is_kernel(function: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in function.decorator_list)


def carried_into_nested_bounds(source: str) -> list[str]:
    """``"function:line name"`` for each ``for`` loop of a jit function in ``source`` that carries
    ``name`` (assigned in its body, and not afresh earlier in the same turn) into the bounds of a
    ``for`` loop nested in its body."""
    found = []

    def scan(function: str, body: list, assigned: set[str], fresh: set[str]) -> None:
        fresh = set(fresh)
        for statement in body:
            if isinstance(statement, ast.For):
                carried = (_names(statement.iter, ast.Load) & assigned) - fresh
                found.extend(f"{function}:{statement.lineno} {name}" for name in sorted(carried))
            for field in ("body", "orelse"):  # compound statements: their own statements, in order
                if isinstance(getattr(statement, field, None), list):
                    scan(function, getattr(statement, field), assigned, fresh)
            fresh |= _names(statement, ast.Store)

    for function in ast.walk(ast.parse(source)):
        if isinstance(function, ast.FunctionDef) and _is_kernel(function):
            for outer in (node for node in ast.walk(function) if isinstance(node, ast.For)):
                scan(function.name, outer.body, set().union(*(_names(statement, ast.Store) for statement in outer.body)), set())
    return found


def test_the_check_names_a_value_carried_into_nested_bounds():
    carried = '''
@gluon.jit
def walk(n, lo):
    first = 0
    for g in range(n):
        for j in range(lo - first, n):
            pass
        first += g
'''
    assert carried_into_nested_bounds(carried) == ["walk:6 first"]
    assert carried_into_nested_bounds(carried.replace("        first += g", "        first = g")) == ["walk:6 first"]
    fresh = carried.replace("    for g in range(n):\n", "    for g in range(n):\n        first = g\n")
    assert carried_into_nested_bounds(fresh) == []
    assert carried_into_nested_bounds(carried.replace("@gluon.jit\n", "")) == []  # host code


@pytest.mark.parametrize("path", sorted(BACKENDS.rglob("*.py")), ids=lambda path: str(path.relative_to(BACKENDS)))
def test_no_kernel_carries_a_value_into_nested_loop_bounds(path):
    assert carried_into_nested_bounds(path.read_text()) == []
