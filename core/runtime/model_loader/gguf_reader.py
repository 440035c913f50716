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

_KEPT_FROM_BYTES = 16 << 20  # smaller files (tests' tiny models) parse in milliseconds


def cached_per_file(maxsize: int):
    """Decorate ``f(path)`` to run once per version (mtime and size) of the file at ``path``, keeping the last
    ``maxsize`` results. Files under 16 MiB are worked out afresh each call: they cost milliseconds, and kept
    they would push a real model's entry out (the test suite's tiny GGUFs made it parse Gemma's three times)."""

    def decorate(f):
        cached = functools.lru_cache(maxsize=maxsize)(lambda path, mtime_ns, size: f(path))

        @functools.wraps(f)
        def per_file(path: str | os.PathLike):
            path = os.path.abspath(os.fspath(path))
            stat = os.stat(path)
            if stat.st_size < _KEPT_FROM_BYTES:
                return f(path)
            return cached(path, stat.st_mtime_ns, stat.st_size)

        per_file.cache_clear = cached.cache_clear
        return per_file

    return decorate


@cached_per_file(maxsize=2)
def gguf_reader(path: str | os.PathLike):
    """The parsed ``gguf.GGUFReader`` of ``path`` (reopened if the file changed)."""
    from gguf.gguf_reader import GGUFReader  # the class itself, never the shared() stand-in

    return GGUFReader(path)


VOCABULARY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


class _HeaderView:
    """A parsed reader without the vocabulary's arrays: what a config is read from. transformers converts every
    field it is given value by value, about 2.5 s for Gemma 3's 262k tokens, which a config does not need."""

    def __init__(self, reader):
        self._reader = reader
        self.fields = {k: v for k, v in reader.fields.items() if k not in VOCABULARY_FIELDS}

    def __getattr__(self, name):
        return getattr(self._reader, name)


def unstated_vocab_size(path: str | os.PathLike) -> int | None:
    """How many tokens the file's vocabulary holds, where its metadata has no ``ARCH.vocab_size`` (None: it has
    one, or no vocabulary): the size transformers would take from the vocabulary it was given."""
    fields = gguf_reader(path).fields
    if any(key.endswith(".vocab_size") and key.count(".") == 1 for key in fields):
        return None
    field = fields.get(VOCABULARY_FIELDS[0])
    return None if field is None else len(field.data)


@contextmanager
def shared_gguf_readers(header_only: bool = False) -> Iterator[None]:
    """While inside, ``gguf.GGUFReader(path)`` (read-only, as transformers opens it) returns
    :func:`gguf_reader`'s shared reader (``header_only``: without the vocabulary's arrays); other
    modes open a fresh one."""
    import gguf
    from gguf.gguf_reader import GGUFReader as original

    def shared(path, mode: str = "r"):
        if mode != "r":
            return original(path, mode)
        return _HeaderView(gguf_reader(path)) if header_only else gguf_reader(path)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original
