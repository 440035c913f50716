"""One parsed GGUF file per process, shared by the config, tokenizer and weight loaders.

``gguf.GGUFReader`` parses every metadata field when it opens a file, including the
vocabulary and merges (seconds for SmolLM2, about 25 s for Gemma 3's 262k tokens). The
config and the tokenizer come from transformers, which opens its own reader each time;
inside :func:`shared_gguf_readers` it gets the process's reader instead, so a model is
parsed once however many loaders read it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager


def gguf_reader(path: str | os.PathLike):
    """The parsed ``gguf.GGUFReader`` of ``path`` (reopened if the file changed)."""
    path = os.path.abspath(os.fspath(path))
    stat = os.stat(path)
    return _reader(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int):
    from gguf.gguf_reader import GGUFReader  # the class itself, never the shared() stand-in

    return GGUFReader(path)


@contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """While inside, ``gguf.GGUFReader(path)`` (read-only, as transformers opens it) returns
    :func:`gguf_reader`'s shared reader; other modes open a fresh one."""
    import gguf
    from gguf.gguf_reader import GGUFReader as original

    def shared(path, mode: str = "r"):
        return gguf_reader(path) if mode == "r" else original(path, mode)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original
