"""Reasoning parsers (``--reasoning-parser``) on fixed model outputs: whole outputs, the same outputs streamed split
at every position (through the tags too) and token by token through the server's detokenizer, with the think tags
as single added tokens (as Qwen3's) and spelled over several tokens."""

from __future__ import annotations

import argparse

import pytest

from runtime.entrypoints.openai.reasoning import (
    Reasoning, ReasoningParser, get_reasoning_parser, reasoning_parser_names, register_reasoning_parser,
)

# (output, deepseek_r1's split, qwen3's split)
CASES = [
    ("<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4."), ("Let me see.", "It is 4.")),
    ("<think>\nhm\n</think>\n\nIt is 4.", ("\nhm\n", "\n\nIt is 4."), ("\nhm\n", "\n\nIt is 4.")),
    ("\n<think>hm</think>4", ("hm", "4"), ("hm", "4")),
    ("hm, 2+2</think>4", ("hm, 2+2", "4"), (None, "hm, 2+2</think>4")),  # the template opened the block
    ("It is 4.", ("It is 4.", None), (None, "It is 4.")),
    ("<think>cut short", ("cut short", None), ("cut short", None)),
    ("<think>cut short</thi", ("cut short</thi", None), ("cut short</thi", None)),
    ("<think></think>4", (None, "4"), (None, "4")),
    ("<think>a</think>b</think>c<think>d", ("a", "b</think>c<think>d"), ("a", "b</think>c<think>d")),
    ("4 <think>x</think>", ("4 <think>x", None), (None, "4 <think>x</think>")),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("  ", ("  ", None), (None, "  ")),
    ("", (None, None), (None, None)),
]
PARSERS = {"deepseek_r1": 1, "qwen3": 2}


def streamed(parser: ReasoningParser, pieces: list[str]) -> Reasoning:
    results = [parser.extract_reasoning_streaming(piece) for piece in pieces] + [parser.finish()]
    return Reasoning("".join(r.reasoning or "" for r in results) or None,
                     "".join(r.content or "" for r in results) or None)


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("case", CASES, ids=[repr(c[0]) for c in CASES])
def test_whole_output(name, case):
    assert tuple(get_reasoning_parser(name)().extract_reasoning(case[0])) == case[PARSERS[name]]


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("case", CASES, ids=[repr(c[0]) for c in CASES])
def test_streamed_split_at_every_position_gives_the_whole_outputs_split(name, case):
    text, expected = case[0], case[PARSERS[name]]
    cls = get_reasoning_parser(name)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert tuple(streamed(cls(), [text[:i], text[i:j], text[j:]])) == expected, (i, j)
    assert tuple(streamed(cls(), list(text))) == expected


def test_streaming_holds_back_only_what_may_be_a_tag():
    parser = get_reasoning_parser("qwen3")()
    assert parser.extract_reasoning_streaming("\n<thi") == (None, None)  # may still open the block
    assert parser.extract_reasoning_streaming("nk>I think") == ("I think", None)
    assert parser.extract_reasoning_streaming(" so</") == (" so", None)
    assert parser.extract_reasoning_streaming("think>Yes") == (None, "Yes")
    assert parser.extract_reasoning_streaming(" <think>") == (None, " <think>")
    plain = get_reasoning_parser("qwen3")()
    assert plain.extract_reasoning_streaming("Hi") == (None, "Hi")  # decided at once: no block
    r1 = get_reasoning_parser("deepseek_r1")()
    assert r1.extract_reasoning_streaming("Hmm") == ("Hmm", None)


def test_explicit_only_reads_an_unmarked_output_as_content():
    """For grammar-constrained outputs: deepseek_r1 then needs the start tag too."""
    r1 = get_reasoning_parser("deepseek_r1")
    assert r1(explicit_only=True).extract_reasoning('{"a": 1}') == (None, '{"a": 1}')
    assert r1(explicit_only=True).extract_reasoning("<think>x</think>{}") == ("x", "{}")
    assert streamed(r1(explicit_only=True), ['{"a"', ": 1}"]) == (None, '{"a": 1}')


def test_the_registry_names_the_valid_parsers():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope'; valid: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reasoning_parser("qwen3")(type("Other", (ReasoningParser,), {}))
    with pytest.raises(TypeError, match="must subclass ReasoningParser"):
        register_reasoning_parser("x")(object)


def serve_parser() -> argparse.ArgumentParser:
    from runtime.cli import serve

    root = argparse.ArgumentParser(prog="runtime")
    serve.register(root.add_subparsers())
    return root


def test_the_serve_flags(capsys):
    args = serve_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1", "--response-role", "bot"])
    assert (args.reasoning_parser, args.response_role) == ("deepseek_r1", "bot")
    args = serve_parser().parse_args(["serve"])
    assert (args.reasoning_parser, args.response_role) == (None, "assistant")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "--reasoning-parser", "nope"])
    assert "--reasoning-parser: unknown reasoning parser 'nope'; valid: deepseek_r1, qwen3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "--response-role", ""])
    assert "--response-role: must be a role name" in capsys.readouterr().err


# ------------------------------------------------------------------ tokenizer level
@pytest.fixture(scope="module")
def tokenizers(tiny_llama):
    """SmolLM2's tokenizer as it is (the tags are several tokens) and with the tags added as single tokens."""
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tiny_llama)
    tagged = AutoTokenizer.from_pretrained(tiny_llama)
    tagged.add_tokens(["<think>", "</think>"])
    return {"plain": plain, "tagged": tagged}


def detokenized_deltas(tokenizer, text: str) -> list[str]:
    """The text deltas the server's detokenizer sends for ``text``'s tokens, one token at a time."""
    from runtime.engine.detokenizer import IncrementalDetokenizer
    from runtime.sampling_params import SamplingParams

    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi", add_special_tokens=False), SamplingParams())
    deltas = []
    for token_id in ids:
        detokenizer.update([token_id], False)
        deltas.append(detokenizer.get_next_output_text(False, True))
    detokenizer.flush()
    deltas.append(detokenizer.get_next_output_text(True, True))
    assert "".join(deltas) == text
    return deltas


@pytest.mark.parametrize("kind", ["plain", "tagged"])
@pytest.mark.parametrize("name", PARSERS)
def test_token_by_token(tokenizers, kind, name):
    tokenizer = tokenizers[kind]
    if kind == "tagged":
        assert len(tokenizer.encode("<think></think>", add_special_tokens=False)) == 2
    for case in CASES:
        deltas = detokenized_deltas(tokenizer, case[0])
        assert tuple(streamed(get_reasoning_parser(name)(tokenizer), deltas)) == case[PARSERS[name]], case[0]
