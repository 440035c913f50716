"""Tool-call parsers on fixed model outputs: exact calls and content, whole and streamed in pieces of
every size, and the streamed deltas assembling to exactly the whole output's calls."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime.entrypoints.openai.protocol import ChatCompletionRequest, InvalidField, required_tools_schema
from runtime.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser, register_tool_parser, tool_parser_names
from runtime.entrypoints.openai.tool_parsers.constrained import NamedToolCalls, RequiredToolCalls
from runtime.entrypoints.openai.tool_parsers.json_scan import scan_call


def whole(parser: ToolParser, text: str):
    content, calls = parser.extract_tool_calls(text)
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
    return content, [(c.name, c.arguments) for c in calls]


def streamed(parser: ToolParser, text: str, step: int):
    """Feed ``text`` in pieces of ``step`` characters; the assembled content and calls."""
    content, calls, ids = [], {}, {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    results = [parser.extract_tool_calls_streaming(piece) for piece in pieces] + [parser.finish()]
    for piece_content, deltas in results:
        if piece_content:
            content.append(piece_content)
        for delta in deltas:
            if delta.index not in calls:  # the first delta of a call carries its id and name
                assert delta.id and delta.id.startswith("chatcmpl-tool-") and delta.name, delta
                assert delta.index == len(calls), "calls start in order"
                calls[delta.index] = [delta.name, ""]
                ids[delta.index] = delta.id
            else:
                assert delta.id is None and delta.name is None, delta
            calls[delta.index][1] += delta.arguments or ""
    assert len(set(ids.values())) == len(ids)
    return ("".join(content) or None), [tuple(calls[i]) for i in sorted(calls)]


def check(name: str, text: str, content, calls):
    """Whole and streamed (every piece size up to 7, and one piece) give ``content`` and ``calls``."""
    assert whole(get_tool_parser(name)(), text) == (content, calls)
    for step in [1, 2, 3, 5, 7, len(text) or 1]:
        assert streamed(get_tool_parser(name)(), text, step) == (content, calls), f"step {step}"


# ---------------------------------------------------------------------------- hermes
def test_hermes_one_call_with_text_around():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\nDone.'
    check("hermes", text, "Let me look.\nDone.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')])


def test_hermes_several_calls_and_nested_arguments():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": [1, 2, {"y": "}]{\\"<"}], "z": null}}</tool_call>\n'
        '<tool_call>\n{"arguments": {"q": -1.5e3, "t": true}, "name": "b"}\n</tool_call>'
        '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    )
    calls = [("a", '{"x": [1, 2, {"y": "}]{\\"<"}], "z": null}'), ("b", '{"q": -1.5e3, "t": true}'), ("c", "{}")]
    check("hermes", text, None, calls)
    for _, args in calls:
        json.loads(args)


def test_hermes_arguments_as_a_string_and_missing_arguments():
    text = '<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    check("hermes", text, None, [("f", '{"k": 1}'), ("g", "{}")])


def test_hermes_unclosed_last_call_still_counts():
    text = 'Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}'
    check("hermes", text, "Sure.", [("f", '{"a": 1}')])


def test_hermes_plain_text_is_content_unchanged():
    for text in ["The weather is nice.", "a < b and <tool not a tag", "ends with <tool_ca", "  spaced  \n"]:
        check("hermes", text, text, [])


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>["a"]</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
])
def test_hermes_malformed_call_falls_back_to_content(text):
    assert whole(get_tool_parser("hermes")(), text) == (text, [])
    for step in (1, 4, len(text)):
        content, calls = streamed(get_tool_parser("hermes")(), text, step)
        assert calls == [] and content == text


@pytest.mark.parametrize("text", [
    "a <tool_call>not json</tool_call> b",
    'Hi.\n<tool_call>\n{"arguments": {}}\n</tool_call>\nBye.',
    "a <tool_call>bad</tool_call> b <tool_call>x",
    "a <tool_call>",  # cut short by max_tokens right after the tag
    'hi <tool_call>{"name"',  # or before the name is whole
])
def test_hermes_text_that_makes_no_call_streams_as_written(text):
    """Streamed, a block that is no call kept the whitespace around it dropped (and a newline added), and an open
    block at the end was lost; the whole output gives the text as it is."""
    check("hermes", text, text, [])


def test_hermes_malformed_call_among_good_ones_makes_all_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {oops}</tool_call>'
    assert whole(get_tool_parser("hermes")(), text) == (text, [])


def test_hermes_streams_arguments_in_fragments_after_the_name():
    parser = get_tool_parser("hermes")()
    seen = []
    for piece in ["Hi ", "<tool_", 'call>{"name": "f', '", "arguments": {"a"', ": 12", "3}}</tool_call>"]:
        seen.append(parser.extract_tool_calls_streaming(piece))
    seen.append(parser.finish())
    assert seen[0].content == "Hi" and seen[1] == (None, [])  # a tag may be arriving: held back
    assert seen[2] == (None, [])  # the name is not complete yet
    first = seen[3].calls[0]
    assert (first.index, first.name, first.arguments) == (0, "f", '{"a"')
    assert [d.arguments for r in seen[4:] for d in r.calls] == [": 12", "3}"]


# ----------------------------------------------------------------------- llama3_json
def test_llama3_json_with_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "search", "parameters": {"query": "rust; go"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'
    check("llama3_json", text, None, [("search", '{"query": "rust; go"}'), ("add", '{"a": 1, "b": 2}')])


def test_llama3_json_without_tag_and_with_arguments_key():
    text = ' {"name": "f", "arguments": {"x": [1, {"y": 2}]}};\n{"name": "g", "parameters": {}};'
    check("llama3_json", text, None, [("f", '{"x": [1, {"y": 2}]}'), ("g", "{}")])


@pytest.mark.parametrize("text", [
    "The answer is 42.",
    '{"answer": 42}',  # JSON, but not a call
    '{"name": "f", "parameters": {"a": 1}} and then some words',
    '{"name": "f", "parameters": {"a": 1}',  # cut off
    "<|python_tag|>print('hi')",
])
def test_llama3_json_non_calls_are_content(text):
    assert whole(get_tool_parser("llama3_json")(), text) == (text, [])


def test_llama3_json_text_streams_as_content():
    for text in ["The answer is 42.", '{"answer": 42}', "<|python_", "  "]:
        for step in (1, 3, len(text)):
            assert streamed(get_tool_parser("llama3_json")(), text, step) == (text, [])


# --------------------------------------------------------- required and named choices
def test_required_tool_calls_array():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"s": "[]{}"}}]'
    calls = [("a", '{"x": 1}'), ("b", '{"s": "[]{}"}')]
    assert whole(RequiredToolCalls(), text) == (None, calls)
    for step in (1, 2, 9, len(text)):
        assert streamed(RequiredToolCalls(), text, step) == (None, calls)


def test_named_tool_call_is_the_whole_output():
    text = '{"city": "Paris"}'
    assert whole(NamedToolCalls("get_weather"), text) == (None, [("get_weather", text)])
    for step in (1, 4, len(text)):
        assert streamed(NamedToolCalls("get_weather"), text, step) == (None, [("get_weather", text)])


def test_required_schema_accepts_calls_of_the_tools_only():
    jsonschema = pytest.importorskip("jsonschema")
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tool_choice="required",
        tools=[
            {"type": "function", "function": {"name": "a", "parameters": {
                "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
                "$defs": {"P": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b"}},
        ],
    )
    schema = required_tools_schema(request.tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "a", "parameters": {"p": 3}}, {"name": "b", "parameters": {}}])
    for bad in ([], [{"name": "c", "parameters": {}}], [{"name": "a", "parameters": {"p": "x"}}], [{"name": "a"}]):
        assert not validator.is_valid(bad), bad
    assert request.to_sampling_params().structured_outputs.json == schema


# ---------------------------------------------------------------- the scanner, the registry
def test_scan_call_reports_a_growing_prefix():
    text = '{"name": "f", "arguments": {"a": [1, 2]}}'
    previous = ""
    for end in range(1, len(text) + 1):
        scan = scan_call(text[:end], 0)
        assert scan.arguments.startswith(previous)
        previous = scan.arguments
        assert (scan.name == "f") == (end >= len('{"name": "f"'))
    assert scan.complete and scan.arguments == '{"a": [1, 2]}'


def test_registry_lists_and_refuses_unknown_names():
    assert {"hermes", "llama3_json"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; valid: .*hermes.*llama3_json"):
        get_tool_parser("nope")

    @register_tool_parser("test_upper")
    class Upper(ToolParser):
        def extract_tool_calls(self, text):
            return text.upper(), []

    assert get_tool_parser("test_upper") is Upper and Upper.name == "test_upper"
    with pytest.raises(TypeError):
        register_tool_parser("test_bad")(dict)


def test_tool_choice_checks():
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
        (dict(tools=tools, tool_choice={"type": "function", "function": {"name": "c"}}), "tool_choice", "'c'.*valid: a, b"),
        (dict(tools=tools + tools[:1]), "tools", "'a' is given more than once"),
        (dict(tools=tools, tool_choice="required", guided_regex="x"), "guided_regex", "both constrain"),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(InvalidField, match=message) as info:
            ChatCompletionRequest(messages=messages, **kwargs).check_supported()
        assert info.value.param == param


def test_serve_refuses_an_unknown_parser_before_loading_a_model():
    cmd = [sys.executable, "-m", "runtime.cli.main", "serve", "--tool-call-parser", "nope", "--enable-auto-tool-choice"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unknown tool call parser 'nope'; valid: " in result.stderr and "hermes" in result.stderr
    result = subprocess.run(cmd[:4] + ["--enable-auto-tool-choice"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in result.stderr
