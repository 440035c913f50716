"""Load the tokenizer of a resolved model (a folder, or the vocabulary inside a GGUF)."""

from __future__ import annotations

import copy
import functools
import os

from runtime.model_loader.resolve import ResolvedModel


def get_tokenizer(resolved: ResolvedModel):
    """A transformers ``PreTrainedTokenizerBase`` for ``resolved.tokenizer_path``.

    Converting a GGUF vocabulary takes seconds (tens for large vocabularies), so that
    conversion happens once per process; each call gets its own copy.
    """
    path = resolved.tokenizer_path
    try:
        if path.endswith(".gguf"):
            stat = os.stat(path)
            return copy.deepcopy(_gguf_tokenizer(path, stat.st_mtime_ns, stat.st_size))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {path!r}: {exc}; pass a folder with tokenizer files "
            "or a .gguf file as the tokenizer"
        ) from exc


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str, mtime_ns: int, size: int):
    from transformers import AutoTokenizer

    from runtime.model_loader.gguf_reader import shared_gguf_readers

    with shared_gguf_readers():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
