"""A compiler for the grammar sandbox's tests (unpickled in the sandbox's child processes): the
spec ``"<action>:<argument>"`` says what the compile does."""

from __future__ import annotations

import os
import time


class Panic(BaseException):
    """Like pyo3's PanicException (a Rust panic in an extension): not an Exception."""


class ScriptedCompiler:
    def __init__(self, ballast: int = 0):
        self.ballast = b"x" * ballast  # memory the child holds once the compiler is loaded

    def __call__(self, kind: str, spec: str):
        action, _, argument = spec.partition(":")
        if action == "echo":
            return (kind, argument, os.getpid())
        if action == "sleep":
            time.sleep(float(argument))
            return os.getpid()
        if action == "invalid":
            raise ValueError(f"bad spec {argument}")
        if action == "error":
            raise KeyError(argument)
        if action == "panic":
            raise Panic(argument)
        if action == "grow":  # Python objects until MemoryError
            chunks = []
            while True:
                chunks.append(bytearray(16 << 20))
        if action == "abort":  # a native allocator failing ends the process so
            os.abort()
        if action == "exit":
            os._exit(int(argument))
        if action == "big":  # an artifact of ``argument`` MiB
            return b"y" * (int(argument) << 20)
        raise AssertionError(f"unknown action {action!r}")
