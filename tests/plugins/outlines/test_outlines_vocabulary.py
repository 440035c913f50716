"""The outlines-core vocabulary built from the engine's real tokenizers: every normal token's
bytes are what the tokenizer decodes it to, special tokens and EOS stay out, and it is cached."""

from __future__ import annotations

import copy
import random
import time

import pytest

from runtime_outlines.vocabulary import (
    BYTE_LEVEL,
    SENTENCEPIECE,
    build_vocabulary,
    bytes_to_unicode,
    get_vocabulary,
    special_token_ids,
)

TEXTS = [
    "Hello world, this is a test.",
    "  leading and trailing spaces  ",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented",
    '{"name": "Zoë", "tags": ["a", "b"], "n": -1.5e3}',
    "你好，世界！日本語のテキストと한국어 문장",
    "Emoji: 😀🎉 family 👨‍👩‍👧 flags 🇫🇷 naïve café ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\n\n\n\r\n\x00\x07 control \x1f bytes",
    "ŁÓDŹ ĞĠĊ (byte-level's space and newline letters) and <0x0A> literally",
    # (A literal "▁" is lost by SentencePiece itself: it normalizes spaces to it.)
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return get_vocabulary(tokenizer, len(tokenizer))


def test_kind_is_detected(smollm2_tokenizer, gemma3_tokenizer):
    assert get_vocabulary(smollm2_tokenizer, len(smollm2_tokenizer)).kind == BYTE_LEVEL
    assert get_vocabulary(gemma3_tokenizer, len(gemma3_tokenizer)).kind == SENTENCEPIECE


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_decodes_to_its_bytes(tokenizer, vocab, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert vocab.decode(ids) == text.encode("utf-8")


def test_random_text_round_trips(tokenizer, vocab):
    rng = random.Random(0)
    alphabet = "abcXYZ019 \n\t.,:;{}[]\"'\\éßø中文🙂ⓐ–—…" + "".join(chr(c) for c in range(0x400, 0x420))
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert vocab.decode(ids) == text.encode("utf-8"), text


def test_single_tokens_decode_like_the_tokenizer(tokenizer, vocab):
    """A sample of single tokens: where the bytes are whole UTF-8, they are what decode gives."""
    rng = random.Random(1)
    ids = [i for i in rng.sample(range(len(vocab.token_bytes)), 4000) if vocab.token_bytes[i] is not None]
    checked = 0
    for token_id, text in zip(ids, tokenizer.batch_decode([[i] for i in ids])):
        data = vocab.token_bytes[token_id]
        try:
            expected = data.decode("utf-8")
        except UnicodeDecodeError:
            assert "\ufffd" in text  # a partial character: the tokenizer shows a replacement
            continue
        assert text == expected, (token_id, tokenizer.convert_ids_to_tokens(token_id))
        checked += 1
    assert checked > 3000


def test_single_byte_tokens(vocab):
    """Gemma's byte fallback has <0x00>..<0xFF>; SmolLM2's byte-level BPE has a token for
    every byte its training text held (all of ASCII and every UTF-8 lead and continuation
    byte of the common scripts)."""
    singles = {data[0] for data in vocab.token_bytes if data is not None and len(data) == 1}
    if vocab.kind == SENTENCEPIECE:
        assert singles == set(range(256))
    else:
        assert set(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D} <= singles
        assert set(range(0x80, 0xC0)) <= singles  # continuation bytes
        assert set(range(0xC2, 0xF0)) <= singles  # lead bytes of 2- and 3-byte characters


def test_special_tokens_and_eos_are_left_out(tokenizer, vocab):
    special = special_token_ids(tokenizer)
    assert tokenizer.eos_token_id in special or tokenizer.eos_token_id is not None
    assert vocab.eos_token_id == tokenizer.eos_token_id
    for token_id in special | {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id}:
        assert vocab.token_bytes[token_id] is None, tokenizer.convert_ids_to_tokens(token_id)
    assert vocab.vocabulary.get_eos_token_id() == tokenizer.eos_token_id
    # Every normal token is in: all ids but the special ones (and none decodes to nothing).
    present = sum(data is not None for data in vocab.token_bytes)
    assert present == vocab.num_tokens
    assert present >= len(tokenizer) - len(special | {tokenizer.eos_token_id}) - 64


def test_chat_markers_are_special(smollm2_tokenizer):
    vocab = get_vocabulary(smollm2_tokenizer, len(smollm2_tokenizer))
    for marker in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert vocab.token_bytes[smollm2_tokenizer.convert_tokens_to_ids(marker)] is None


def test_sentencepiece_space_and_byte_fallback(gemma3_tokenizer):
    vocab = get_vocabulary(gemma3_tokenizer, len(gemma3_tokenizer))
    newline = gemma3_tokenizer.convert_tokens_to_ids("<0x0A>")
    assert vocab.token_bytes[newline] == b"\n"
    hello = gemma3_tokenizer.convert_tokens_to_ids("\u2581Hello")
    assert vocab.token_bytes[hello] == b" Hello"


def test_byte_level_table_is_gpt2s():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a" and table[ord("a")] == "a"


def test_ids_past_the_logits_width_are_left_out(smollm2_tokenizer):
    vocab = build_vocabulary(smollm2_tokenizer, 1000)
    assert all(data is None for data in vocab.token_bytes[1000:])
    assert vocab.num_tokens < 1000


def test_build_is_fast_and_cached(smollm2_tokenizer, gemma3_tokenizer):
    for tokenizer, limit in ((smollm2_tokenizer, 3.0), (gemma3_tokenizer, 10.0)):
        start = time.perf_counter()
        built = build_vocabulary(tokenizer, len(tokenizer))
        assert time.perf_counter() - start < limit  # measured ~0.2 s and ~1.3 s on 2 cores
        assert built.build_seconds < limit
    first = get_vocabulary(smollm2_tokenizer, 49152)
    assert get_vocabulary(smollm2_tokenizer, 49152) is first
    # The engine hands each backend its own deep copy of the tokenizer: still one build.
    assert get_vocabulary(copy.deepcopy(smollm2_tokenizer), 49152) is first
    assert get_vocabulary(smollm2_tokenizer, 1024) is not first
