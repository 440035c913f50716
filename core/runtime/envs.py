"""Reading environment settings (plugins' kernel switches and thresholds for benchmarks and workarounds),
once at import: a bad value is an error naming the variable, the value and what it takes."""

from __future__ import annotations

import os


def env_int(name: str, default: int, low: int, high: int | None = None) -> int:
    """The integer in ``name`` (``default`` when unset), between ``low`` and ``high`` (inclusive)."""
    text = os.environ.get(name)
    if text is None:
        return default
    valid = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer; it takes {valid}") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value} is out of range; it takes {valid}")
    return value


def env_ints(name: str, count: int) -> tuple[int, ...] | None:
    """``count`` comma-separated non-negative integers in ``name`` (None when unset)."""
    text = os.environ.get(name)
    if text is None:
        return None
    fields = text.split(",")
    if len(fields) != count or not all(f.strip().isdigit() for f in fields):
        raise ValueError(f"{name}={text!r}: it takes {count} comma-separated non-negative integers")
    return tuple(int(f) for f in fields)


def env_flag(name: str, default: bool = True) -> bool:
    """``name`` as a switch: 0 off, 1 on (``default`` when unset)."""
    text = os.environ.get(name)
    if text is None:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}: it takes 0 (off) or 1 (on)")
    return text == "1"
