"""A GGUF file's tokenizer, converted once and kept in pytest's cache (Gemma's 262k-token
vocabulary takes ~25-40 s to convert)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import transformers


def cached_gguf_tokenizer(pytestconfig, name: str, gguf_path: str, load: Callable[[str], object]):
    """``load(path)`` reads a tokenizer from a .gguf file or a tokenizer folder; the converted
    tokenizer is saved under pytest's cache and loaded from that folder next time."""
    cache = getattr(pytestconfig, "cache", None)
    if cache is None:
        return load(gguf_path)
    version = f"{name}-{os.path.getsize(gguf_path)}-transformers{transformers.__version__}"
    folder = cache.mkdir("gguf_tokenizers") / version
    if (folder / "tokenizer.json").exists():
        return load(str(folder))
    tokenizer = load(gguf_path)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    tokenizer.save_pretrained(str(partial))
    try:
        os.rename(partial, folder)  # whole or not at all, if two processes race
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer
