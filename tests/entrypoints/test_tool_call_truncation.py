"""A hermes tool call cut short by max_tokens inside its end tag (``...}}</tool_``): the whole output and
the stream give the same call, as for a call cut short before the tag (the stream counted it; the whole
output made the call and the text around it content)."""

from __future__ import annotations

import pytest

from runtime.entrypoints.openai.tool_parsers import get_tool_parser

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}'


def assembled(text: str, step: int):
    parser = get_tool_parser("hermes")()
    results = [parser.extract_tool_calls_streaming(text[i:i + step]) for i in range(0, len(text), step)]
    results.append(parser.finish())
    content = "".join(r.content or "" for r in results) or None
    calls: dict[int, list[str]] = {}
    for delta in (d for r in results for d in r.calls):
        calls.setdefault(delta.index, [delta.name, ""])[1] += delta.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("cut", ["<", "</", "</tool_", "</tool_call"])
def test_a_call_cut_inside_its_end_tag_still_counts(cut):
    text = "Sure." + CALL + cut
    content, calls = get_tool_parser("hermes")().extract_tool_calls(text)
    assert (content, [(c.name, c.arguments) for c in calls]) == ("Sure.", [("f", '{"a": 1}')])
    for step in (1, 3, len(text)):
        assert assembled(text, step) == ("Sure.", [("f", '{"a": 1}')]), step


def test_text_after_the_json_that_is_no_end_tag_keeps_the_call_malformed():
    text = CALL + " oops"
    assert get_tool_parser("hermes")().extract_tool_calls(text).calls == []
