"""Custom ops that count their calls, for tests that check which fused ops a model used."""

from __future__ import annotations

from collections.abc import Callable


def counted(ops: dict[str, Callable], calls: dict[str, int]) -> dict[str, Callable]:
    """``ops`` wrapped so that each call adds one to ``calls[name]`` (and a call with ``gated=True``
    to ``calls[name + "(gated)"]`` too)."""

    def wrap(name, fn):
        def op(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if kwargs.get("gated"):
                calls[f"{name}(gated)"] = calls.get(f"{name}(gated)", 0) + 1
            return fn(*args, **kwargs)

        return op

    return {name: wrap(name, fn) for name, fn in ops.items()}
