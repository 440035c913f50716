"""Structured output and tool calling through the OpenAI server (a real subprocess on the default
SmolLM2-135M-Instruct, the official client, the outlines guided backend).

Every constrained output parses and validates against its schema (jsonschema, formats checked);
regex and choice outputs match; streamed greedy outputs equal unary ones; tool calls of
``required`` and named choices carry arguments valid for the tool, streamed deltas assemble to
the same calls; bad requests are 400s in OpenAI's shape and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time

import httpx
import openai
import pytest

from support.remote_server import running_server

jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2"
FLAGS = [
    "--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "1024",
    "--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--structured-output-compile-memory-bytes", str(1 << 30),
]
MAX_TOKENS = 200
GREEDY = dict(model=MODEL, temperature=0.0, max_tokens=MAX_TOKENS)

# Strings are bounded (maxLength, pattern, enum, format) so the tiny model finishes within MAX_TOKENS.
NAME = {"type": "string", "maxLength": 12}
SCHEMAS: list[tuple[str, dict]] = [
    ("person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"]}),
    ("enum_color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("bool_flag", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    ("number_range", {"type": "object", "properties": {"t": {"type": "number", "minimum": -5, "maximum": 5}},
                      "required": ["t"]}),
    ("int_array", {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9},
                                                         "minItems": 2, "maxItems": 4}}, "required": ["xs"]}),
    ("string_array", {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                              "minItems": 1, "maxItems": 3}}, "required": ["tags"]}),
    ("nested", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": NAME},
                 "required": ["id", "name"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]}),
    ("deeply_nested", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 50}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]}),
    ("array_of_objects", {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                                   "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
                  "required": ["sku", "qty"]}}}, "required": ["items"]}),
    ("pattern_phone", {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
                       "required": ["phone"]}),
    ("date", {"type": "object", "properties": {"birthday": {"type": "string", "format": "date"}}, "required": ["birthday"]}),
    ("email", {"type": "object", "properties": {"email": {"type": "string", "format": "email",
                                                          "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
               "required": ["email"]}),
    ("uuid", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]}),
    ("nullable", {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10}},
                  "required": ["note"]}),
    ("any_of", {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                  {"type": "boolean"}]}}, "required": ["v"]}),
    ("const_and_enum_ints", {"type": "object", "properties": {"version": {"const": 2}, "level": {"enum": [1, 2, 3]}},
                             "required": ["version", "level"]}),
    ("top_level_array", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
                         "maxItems": 3}),
    ("top_level_enum", {"type": "string", "enum": ["yes", "no", "maybe"]}),
    ("top_level_integer", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("refs", {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, "required": ["start", "end"]}),
    ("many_fields", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "floor": {"type": "integer", "minimum": 0, "maximum": 30}, "lift": {"type": "boolean"},
        "kind": {"enum": ["flat", "house"]}}, "required": ["city", "zip", "floor", "lift", "kind"]}),
    ("optional_fields", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "b": {"type": "string", "maxLength": 5}},
                         "required": ["a"]}),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add", "description": "Add two small integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"]},
    },
}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from runtime.model_loader.default_model import default_model_path

    folder = tmp_path_factory.mktemp("structured_output")
    with running_server(default_model_path(), FLAGS, folder / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def validate(instance, schema) -> None:
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def ask_for(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with a JSON value for '{name}'."}]


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ------------------------------------------------------------------ JSON schemas
def test_json_schemas_concurrently(server):
    assert len(SCHEMAS) >= 20

    async def one(client, name, schema):
        out = await client.chat.completions.create(messages=ask_for(name), response_format=response_format(name, schema),
                                                   **GREEDY)
        return out.choices[0]

    async def main():
        async with server.async_client(timeout=240) as client:
            return await asyncio.gather(*(one(client, name, schema) for name, schema in SCHEMAS))

    choices = asyncio.run(main())
    failures = []  # all of them at once: which schemas the backend does not hold the model to
    for (name, schema), choice in zip(SCHEMAS, choices):
        assert not choice.message.tool_calls
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            validate(json.loads(choice.message.content), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}: {choice.message.content!r}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_completions_endpoint_json_schema_and_guided_json(client):
    name, schema = SCHEMAS[0]
    out = client.completions.create(prompt="A person as JSON: ", extra_body={"response_format": response_format(name, schema)},
                                    **GREEDY)
    validate(json.loads(out.choices[0].text), schema)
    out = client.completions.create(prompt="A person as JSON: ", extra_body={"guided_json": json.dumps(schema)}, **GREEDY)
    validate(json.loads(out.choices[0].text), schema)


def test_json_object(client):
    out = client.chat.completions.create(messages=ask_for("anything"), response_format={"type": "json_object"},
                                         **{**GREEDY, "max_tokens": 60})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an object may go on past max_tokens: what there is starts one
        assert text.lstrip().startswith("{")


# ------------------------------------------------------------------- regex, choice
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.mark.parametrize("extra_body", [
    {"structured_outputs": {"regex": REGEX}},
    {"guided_regex": REGEX},
], ids=["structured_outputs", "guided_regex"])
def test_regex(client, extra_body):
    chat = client.chat.completions.create(messages=ask_for("a code"), extra_body=extra_body, **GREEDY)
    assert re.fullmatch(REGEX, chat.choices[0].message.content), chat.choices[0].message.content
    text = client.completions.create(prompt="Code: ", extra_body=extra_body, **GREEDY).choices[0].text
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("extra_body", [
    {"structured_outputs": {"choice": CHOICES}},
    {"guided_choice": CHOICES},
], ids=["structured_outputs", "guided_choice"])
def test_choice(client, extra_body):
    messages = [{"role": "user", "content": "Sentiment of 'I love it'?"}]
    out = client.chat.completions.create(messages=messages, extra_body=extra_body, n=2, **{**GREEDY, "temperature": 1.0})
    for choice in out.choices:
        assert choice.message.content in CHOICES and choice.finish_reason == "stop"


# ------------------------------------------------------------ streaming = unary
def stream_chat(client, **kwargs):
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("constraint", [
    {"response_format": response_format(*SCHEMAS[6])},
    {"extra_body": {"structured_outputs": {"regex": REGEX}}},
    {"extra_body": {"structured_outputs": {"json": SCHEMAS[8][1]}}},
], ids=["json_schema", "regex", "structured_outputs_json"])
def test_streaming_equals_unary(client, constraint):
    kwargs = dict(messages=ask_for("streaming"), **GREEDY, **constraint)
    unary = client.chat.completions.create(**kwargs).choices[0]
    text, finish = stream_chat(client, **kwargs)
    assert (text, finish) == (unary.message.content, unary.finish_reason)
    body = constraint.get("extra_body") or {"response_format": constraint["response_format"]}
    unary_text = client.completions.create(prompt="Value: ", extra_body=body, **GREEDY).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="Value: ", stream=True, extra_body=body,
                                                                               **GREEDY) if c.choices)
    assert streamed == unary_text


# ----------------------------------------------------------------- tool calling
def tool_schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def assemble(chunks) -> tuple[list[dict], str | None, str]:
    """The calls that streamed tool_calls deltas make, the last finish_reason and the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.type == "function"
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    assert call["name"] is None and call["id"] is not None, "the id and name come first"
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    assert call["name"] is not None
                    call["arguments"] += delta.function.arguments
    return [calls[i] for i in sorted(calls)], finish, content


def as_dicts(tool_calls) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in tool_calls]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_constrained_tool_calls(client, tool_choice):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, **GREEDY)
    finish_reason = "stop" if isinstance(tool_choice, dict) else "tool_calls"  # OpenAI: a named call ends with stop
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == finish_reason and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
        assert call.function.name in ("get_weather", "add")
        validate(json.loads(call.function.arguments), tool_schema(call.function.name))
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
    streamed, finish, content = assemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == finish_reason and content == ""
    strip_ids = lambda calls: [{k: v for k, v in c.items() if k != "id"} for c in calls]  # noqa: E731
    assert strip_ids(streamed) == strip_ids(as_dicts(calls))


def test_tool_results_in_the_conversation(client):
    """A conversation with an assistant tool call and the tool's answer renders and runs."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="none", **{**GREEDY, "max_tokens": 8})
    assert out.choices[0].message.tool_calls in (None, []) and out.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_with_hermes_parser(client):
    """The tiny model may or may not write a call: the response is well-formed either way."""
    kwargs = dict(messages=ASK, tools=TOOLS, **{**GREEDY, "max_tokens": 60})  # no tool_choice: "auto"
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = choice.message.tool_calls or []
    if calls:
        assert choice.finish_reason in ("tool_calls", "length")
        for call in calls:
            assert call.function.name and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    streamed, finish, content = assemble(client.chat.completions.create(stream=True, tool_choice="auto", **kwargs))
    assert finish == choice.finish_reason
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert (content or None) == choice.message.content


# ------------------------------------------------------------------ bad requests
BAD = [
    ("chat/completions", {"response_format": response_format("bad", {"type": "no_such_type"})},
     "response_format.json_schema.schema"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat/completions", {"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex"),
    ("completions", {"guided_regex": "(a)\\1"}, "guided_regex"),
    ("chat/completions", {"guided_json": "{not json"}, "guided_json"),
    ("chat/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("chat/completions", {"structured_outputs": {"no_such_field": 1}}, "structured_outputs.no_such_field"),
    ("chat/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("completions", {"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_choice"),
    ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ("chat/completions", {"tools": [{"type": "retrieval"}]}, "tools.0.type"),
]


def test_bad_requests_are_400s_and_the_server_keeps_serving(server, client):
    for path, body, param in BAD:
        if path == "completions":
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **body}
        else:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
        response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param and error["message"], (body, error)
    with pytest.raises(openai.BadRequestError, match="'nope', which is not among the tools; valid: get_weather, add"):
        client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}},
                                       model=MODEL)
    out = client.chat.completions.create(messages=ASK, extra_body={"guided_choice": CHOICES}, **GREEDY)
    assert out.choices[0].message.content in CHOICES
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_spec_past_the_compile_memory_limit_is_a_400(server, client):
    """outlines-core asks for 1 GiB at once to compile ``a{99999999}``: the compile's child process runs out of its
    limit (the server's 1 GiB), the request gets a 400 naming it, and the engine keeps serving (before the grammar
    sandbox, such a compile grew the engine process until it was killed)."""
    for _ in range(2):  # the second time from the cache of bad specs
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 3, "guided_regex": "a{99999999}"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "needed more than 1 GiB of memory (structured_output_compile_memory_bytes)" in error["message"], error
    out = client.chat.completions.create(messages=ASK, extra_body={"guided_choice": CHOICES}, **GREEDY)
    assert out.choices[0].message.content in CHOICES
    assert httpx.get(server.url + "/health").status_code == 200


def test_compiles_of_clients_that_hung_up_leave_the_workers_to_others(server):
    """Six requests with distinct slow regexes (~8 s each to compile on a 2-core machine) whose clients hang up
    after 0.3 s: their compiles are taken off the queue or, running, killed, so another client's small regex compiles
    at once. Before, it queued behind them and failed after 64 s naming its own regex (fuzzed, session 33)."""
    def hang_up(i: int) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "guided_regex": "([a-z]{1,10} ){1,%d}" % (300 + i)}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(hang_up, range(6)))
    start = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 3, "guided_regex": "[0-9]{3}"})
    assert response.status_code == 200, response.text
    assert re.fullmatch("[0-9]{3}", response.json()["choices"][0]["text"])
    assert time.monotonic() - start < 10


def test_auto_tool_choice_needs_the_server_flags():
    """Without --enable-auto-tool-choice, "auto" (and tools without tool_choice) is a 400 saying how to start the server."""
    from types import SimpleNamespace

    from runtime.entrypoints.openai.protocol import ChatCompletionRequest, InvalidField
    from runtime.entrypoints.openai.serving_chat import OpenAIServingChat
    from runtime.entrypoints.openai.serving_engine import ServingContext

    chat = OpenAIServingChat(ServingContext(engine=SimpleNamespace(), served_model_names=[MODEL]))
    for tool_choice in ("auto", None):
        request = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice=tool_choice)
        with pytest.raises(InvalidField, match="--enable-auto-tool-choice --tool-call-parser NAME") as info:
            chat._check_tool_choice(request)
        assert info.value.param == "tool_choice"
    chat._check_tool_choice(ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="none"))
