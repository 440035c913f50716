"""Load the tokenizer of a resolved model (a folder, or the vocabulary inside a GGUF)."""

from __future__ import annotations

import os

from runtime.model_loader.resolve import ResolvedModel


def get_tokenizer(resolved: ResolvedModel):
    """A transformers ``PreTrainedTokenizerBase`` for ``resolved.tokenizer_path``."""
    from transformers import AutoTokenizer

    path = resolved.tokenizer_path
    try:
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {path!r}: {exc}; pass a folder with tokenizer files "
            "or a .gguf file as the tokenizer"
        ) from exc
