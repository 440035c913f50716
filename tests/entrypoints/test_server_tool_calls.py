"""Tool calling semantics of OpenAI's API through a real server and the official client, on the tiny model with
the hermes parser. A guided regex makes the model write an exact text (two hermes calls), so what the server
makes of it is known: ``parallel_tool_calls: false`` leaves at most one call in the message, streamed or not."""

from __future__ import annotations

import json

import pytest

from support.remote_server import SERVER_FLAGS, running_server

MODEL = "tiny"
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
]
ASK = [{"role": "user", "content": "call both"}]
TWO_CALLS = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": {"b": 2}}</tool_call>'


def literal_regex(text: str) -> str:
    return "".join("\\" + c if c in "{}[]()." else c for c in text)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_tool_calls") / "server.log"
    flags = SERVER_FLAGS + ["--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with running_server(tiny_llama, flags, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def two_calls_request(**kwargs) -> dict:
    return dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0.0,
                extra_body={"structured_outputs": {"regex": literal_regex(TWO_CALLS)}}, **kwargs)


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], str | None]:
    """The (name, arguments) of each streamed call, by index, and the finish_reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_the_forced_text_gives_two_calls_by_default(client):
    choice = client.chat.completions.create(**two_calls_request()).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("f", {"a": 1}), ("g", {"b": 2})]
    assert choice.finish_reason == "tool_calls"
    calls, finish = streamed_calls(client.chat.completions.create(stream=True, **two_calls_request()))
    assert [name for name, _ in calls] == ["f", "g"] and finish == "tool_calls"


def test_parallel_tool_calls_false_keeps_only_the_first_call(client):
    """OpenAI's: with parallel_tool_calls false the assistant message holds at most one call (it held both)."""
    choice = client.chat.completions.create(parallel_tool_calls=False, **two_calls_request()).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("f", {"a": 1})]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    chunks = client.chat.completions.create(stream=True, parallel_tool_calls=False, **two_calls_request())
    calls, finish = streamed_calls(chunks)
    assert [(name, json.loads(args)) for name, args in calls] == [("f", {"a": 1})] and finish == "tool_calls"


def test_parallel_tool_calls_false_with_tool_choice_required_makes_one_call(client):
    """The "required" schema then allows one call only, so the model is not left to write more."""
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
                                         temperature=0.0, parallel_tool_calls=False)
    choice = out.choices[0]
    if choice.finish_reason != "length":
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"


def test_the_required_schema_allows_one_call_without_parallel_tool_calls():
    from runtime.entrypoints.openai.protocol import ChatCompletionRequest

    def schema(**kwargs) -> dict:
        request = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required", **kwargs)
        return request.to_sampling_params().structured_outputs.json

    assert "maxItems" not in schema() and "maxItems" not in schema(parallel_tool_calls=True)
    assert schema(parallel_tool_calls=False)["maxItems"] == 1 and schema(parallel_tool_calls=False)["minItems"] == 1


@pytest.mark.parametrize("text", ['Hi <tool_call>{"oops": 1}</tool_call> ok', "Hi <tool_call>"])
def test_a_block_that_is_no_call_streams_the_same_content(client, text):
    """The model writes a hermes tag but no call (or is cut short after the tag): the content, streamed or not, is the
    text as written (streamed, the spaces around the block were dropped and an open block was lost)."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0.0,
                  extra_body={"structured_outputs": {"regex": literal_regex(text)}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == text
    assert streamed_calls(chunks) == ([], "stop")


def test_required_tools_keep_their_own_schema_references(client):
    """tool_choice "required" puts each tool's parameters in one array schema: a tool's references ("#/$defs/P",
    "#/properties/a") still mean its own schema there. Before, two tools' $defs of one name merged (f's "P" took g's,
    so f's arguments had to be a string), and "#/properties/a" pointed into the array: a 400 for a valid tool."""
    jsonschema = pytest.importorskip("jsonschema")
    f = {"type": "object", "$defs": {"P": {"type": "integer", "minimum": 0, "maximum": 9}},
         "properties": {"p": {"$ref": "#/$defs/P"}, "q": {"$ref": "#/properties/p"}}, "required": ["p", "q"]}
    g = {"type": "object", "$defs": {"P": {"enum": ["x", "y"]}}, "properties": {"p": {"$ref": "#/$defs/P"}},
         "required": ["p"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": f}},
             {"type": "function", "function": {"name": "g", "parameters": g}}]
    seen = set()
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required", max_tokens=80,
                                             seed=seed, temperature=1.0, parallel_tool_calls=False)
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), f if call.function.name == "f" else g)
        seen.add(call.function.name)
    assert seen, "no call finished within max_tokens"


def test_the_required_schema_resolves_each_tools_references_in_its_own_schema():
    jsonschema = pytest.importorskip("jsonschema")
    from runtime.entrypoints.openai.protocol import ChatCompletionRequest, required_tools_schema

    f = {"type": "object", "$defs": {"P": {"type": "integer"}}, "properties": {
        "p": {"$ref": "#/$defs/P"}, "q": {"$ref": "#/properties/p"}, "default": {"$ref": "#/$defs/P"}}}
    g = {"type": "object", "definitions": {"P": {"type": "string"}}, "properties": {"p": {"$ref": "#/definitions/P"}},
         "default": {"$ref": "#/kept"}}
    h = {"type": "object", "$defs": {"P": {"type": "boolean"}}, "properties": {"p": {"$ref": "#/$defs/P"}}}
    request = ChatCompletionRequest(messages=ASK, tool_choice="required", tools=[
        {"type": "function", "function": {"name": name, "parameters": params}} for name, params in zip("fgh", (f, g, h))])
    schema = required_tools_schema(request.tools)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "f", "parameters": {"p": 1, "q": 2}}, {"name": "g", "parameters": {"p": "x"}},
                               {"name": "h", "parameters": {"p": True}}])
    for bad in ({"name": "f", "parameters": {"p": True}}, {"name": "f", "parameters": {"q": "x"}},
                {"name": "f", "parameters": {"default": "x"}},  # a property named as a keyword is a schema still
                {"name": "h", "parameters": {"p": 1}}, {"name": "g", "parameters": {"p": 1}}):
        assert not validator.is_valid([bad]), bad  # f's P was h's (boolean), f's q pointed into the array
    assert schema["$defs"]["parameters_1"]["default"] == {"$ref": "#/kept"}  # data is left as it is
