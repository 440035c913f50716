"""Small helpers shared by the launchers: Triton detection and tile arithmetic."""

from __future__ import annotations

import functools
import os
import importlib.util

INSTALL_HINT = "install it with `pip install triton` (or `pip install runtime-kernels[triton]`)"


@functools.cache
def has_triton() -> bool:
    """Whether Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def require_triton(what: str) -> None:
    """Raise a clear error when a kernel is launched on a machine without Triton."""
    if not has_triton():
        raise RuntimeError(f"{what} needs Triton, which is not installed; {INSTALL_HINT}")


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def check_last_dim_contiguous(name: str, tensor) -> None:
    """Kernels index the last dimension with stride 1; anything else is a caller bug."""
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(tensor.stride())}")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter (Triton 3.x) computes ``tl.dot`` of bfloat16 inputs wrongly, so
    kernels upcast those operands to float32 when it is on; compiled kernels keep
    bfloat16 dots.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
