"""Integer arithmetic shared by the mask types, the kernels' launchers and the benchmark."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)
