"""``--reasoning-parser`` and ``--response-role`` in chat completions: the reply's reasoning in
``message.reasoning_content`` / ``delta.reasoning_content`` and the rest in ``content``, tool calls read in the
content only. Serving tests over fixed outputs, and one real server with the official client over a model whose
weights make it reply ``<think>Let me think</think>Hello`` to any prompt."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from runtime.entrypoints.openai.protocol import ChatCompletionRequest
from runtime.entrypoints.openai.reasoning import get_reasoning_parser
from runtime.entrypoints.openai.serving_chat import OpenAIServingChat
from runtime.entrypoints.openai.serving_engine import ServingContext
from runtime.entrypoints.openai.tool_parsers import get_tool_parser
from runtime.outputs import CompletionOutput, RequestOutput
from support.remote_server import SERVER_FLAGS, running_server
from support.scripted_model import build_scripted_model

ASK = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
THOUGHT_CALL = '<tool_call>{"name": "f", "arguments": {"a": 0}}</tool_call>'
TEXT = f"<think>maybe {THOUGHT_CALL} no</think>Sure {CALL}"


def serving(reasoning: str | None = None, tools: bool = False, role: str = "assistant") -> OpenAIServingChat:
    ctx = ServingContext(engine=SimpleNamespace(tokenizer=None), served_model_names=["m"], response_role=role,
                         reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None,
                         tool_parser=get_tool_parser("hermes") if tools else None)
    return OpenAIServingChat(ctx)


def output(text: str, finish_reason: str | None = "stop") -> RequestOutput:
    completion = CompletionOutput(0, text, [1], None, None, finish_reason)
    return RequestOutput("r", None, [1, 2], None, [completion], finish_reason is not None)


def unary(chat: OpenAIServingChat, text: str, **fields) -> dict:
    request = ChatCompletionRequest(messages=fields.pop("messages", ASK), **fields)
    return json.loads(chat._json_response(request, "m", "chatcmpl-1", output(text)).body)["choices"][0]


def streamed(chat: OpenAIServingChat, pieces: list[str], **fields) -> list[dict]:
    """The deltas of each chunk (the finish reason of the last under "finish_reason")."""
    request = ChatCompletionRequest(messages=fields.pop("messages", ASK), stream=True, **fields)

    async def outputs():
        for i, piece in enumerate(pieces):
            yield output(piece, "stop" if i == len(pieces) - 1 else None)

    async def collect():
        return [event async for event in chat._stream(request, "m", "chatcmpl-1", outputs())]

    deltas = []
    for event in asyncio.run(collect()):
        body = event.removeprefix(b"data: ").strip()
        if body != b"[DONE]":
            (choice,) = json.loads(body)["choices"]
            deltas.append({**choice["delta"], "finish_reason": choice["finish_reason"]})
    return deltas


def joined(deltas: list[dict], key: str) -> str | None:
    return "".join(d.get(key) or "" for d in deltas) or None


def test_without_the_flag_nothing_is_split_and_no_field_is_added():
    message = unary(serving(), TEXT)["message"]
    assert message["content"] == TEXT and "reasoning_content" not in message
    deltas = streamed(serving(), [TEXT[:9], TEXT[9:]])
    assert joined(deltas, "content") == TEXT and not any("reasoning_content" in d for d in deltas)
    deltas = streamed(serving(tools=True), [TEXT[:9], TEXT[9:]], tools=TOOLS)  # the path that builds models
    assert len(deltas) > 2 and not any("reasoning_content" in d for d in deltas)
    assert "reasoning_content" not in unary(serving(tools=True), TEXT, tools=TOOLS)["message"]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_tool_calls_are_read_in_the_content_only(name):
    """The call the model wrote while thinking stays in the reasoning; only the answer's call is made."""
    chat = serving(name, tools=True)
    choice = unary(chat, TEXT, tools=TOOLS)
    message = choice["message"]
    assert message["reasoning_content"] == f"maybe {THOUGHT_CALL} no" and message["content"] == "Sure"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("f", {"a": 1})]
    assert choice["finish_reason"] == "tool_calls"
    for step in (1, 5, len(TEXT)):
        deltas = streamed(chat, [TEXT[i:i + step] for i in range(0, len(TEXT), step)], tools=TOOLS)
        assert joined(deltas, "reasoning_content") == message["reasoning_content"], step
        assert joined(deltas, "content") == "Sure"
        calls = [c for d in deltas for c in d.get("tool_calls") or ()]
        assert [c["function"]["name"] for c in calls if c["function"].get("name")] == ["f"]
        assert {c["index"] for c in calls} == {0}
        assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"a": 1}
        assert deltas[-1]["finish_reason"] == "tool_calls"


def test_streamed_chunks_carry_reasoning_then_content():
    deltas = streamed(serving("qwen3"), ["<think>", "Let me", " think</", "think>", "Hello"])
    assert deltas[0] == {"role": "assistant", "content": "", "reasoning_content": None, "reasoning": None,
                         "tool_calls": None, "finish_reason": None}
    assert [(d["reasoning_content"], d["content"]) for d in deltas[1:]] == [
        ("Let me", None), (" think", None), (None, "Hello")]


def test_a_constrained_output_is_content_unless_it_writes_the_tags():
    """Without a tokenizer to find the tags in, the grammar holds from the first token, so deepseek_r1 does not
    take a JSON answer for reasoning."""
    fields = dict(response_format={"type": "json_object"})
    assert unary(serving("deepseek_r1"), '{"a": 1}', **fields)["message"] == {
        "role": "assistant", "content": '{"a": 1}', "refusal": None, "reasoning_content": None, "reasoning": None,
        "tool_calls": []}
    assert unary(serving("deepseek_r1"), '<think>x</think>{"a": 1}', **fields)["message"]["reasoning_content"] == "x"
    assert unary(serving("deepseek_r1"), '{"a": 1}')["message"]["reasoning_content"] == '{"a": 1}'  # unconstrained
    deltas = streamed(serving("deepseek_r1"), ['{"a"', ": 1}"], **fields)
    assert joined(deltas, "content") == '{"a": 1}' and joined(deltas, "reasoning_content") is None


def test_include_reasoning_false_leaves_the_reasoning_out():
    message = unary(serving("qwen3"), "<think>x</think>y", include_reasoning=False)["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "y")
    deltas = streamed(serving("qwen3"), ["<think>x</thi", "nk>y"], include_reasoning=False)
    assert joined(deltas, "reasoning_content") is None and joined(deltas, "content") == "y"


def test_response_role():
    """vLLM's: the reply's role is --response-role, or the last message's without add_generation_prompt."""
    chat = serving(role="bot")
    assert unary(chat, "x")["message"]["role"] == "bot"
    assert streamed(chat, ["x"])[0]["role"] == "bot"
    assert unary(serving(), "x")["message"]["role"] == "assistant"
    messages = [*ASK, {"role": "bot", "content": "I am"}]
    choice = unary(chat, " here", messages=messages, add_generation_prompt=False, echo=True)
    assert choice["message"] == {"role": "bot", "content": "I am here", "refusal": None, "tool_calls": []}
    deltas = streamed(chat, [" here"], messages=messages, add_generation_prompt=False, echo=True)
    assert deltas[0]["role"] == "bot" and joined(deltas, "content") == "I am here"


# ------------------------------------------------------------------ a real server
SCRIPT = ["<think>", "Let", " me", " think", "</think>", "Hello"]


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_reasoning")
    model = build_scripted_model(tiny_llama, folder / "model", SCRIPT, added_tokens=["<think>", "</think>"])
    flags = SERVER_FLAGS + ["--served-model-name", "tiny", "--reasoning-parser", "qwen3"]
    with running_server(model, flags, folder / "server.log") as server:
        yield server.client(timeout=60)


def test_the_official_client_reads_reasoning_content(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=20)
    choice = client.chat.completions.create(temperature=0.0, **kwargs).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("Let me think", "Hello")
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me think"
    assert "".join(d.content or "" for d in deltas) == "Hello"
    assert chunks[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ structured output after the reasoning
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
CLOSED = "<think>\n\n</think>\n\n"  # Qwen3's template with enable_thinking false


@pytest.fixture(scope="module")
def think_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


def test_reasoning_tags_come_from_the_tokenizer_and_the_prompt(think_tokenizer):
    from runtime.entrypoints.openai.reasoning.grammar_start import reasoning_tags
    from runtime.sampling_params import ReasoningTags

    start, end = think_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    ask = think_tokenizer.encode("<|im_start|>assistant\n")
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert reasoning_tags(qwen3, think_tokenizer, ask) == ReasoningTags([end], [start], starts_in_reasoning=False)
    assert reasoning_tags(r1, think_tokenizer, ask) == ReasoningTags([end], [start], starts_in_reasoning=True)
    opened = think_tokenizer.encode("<|im_start|>assistant\n<think>\n")  # the template opened the block
    assert reasoning_tags(qwen3, think_tokenizer, opened).starts_in_reasoning is True
    closed = think_tokenizer.encode("<|im_start|>assistant\n" + CLOSED)  # ... or closed it: the grammar holds at once
    assert reasoning_tags(qwen3, think_tokenizer, closed) is None and reasoning_tags(r1, think_tokenizer, closed) is None
    answered = think_tokenizer.encode("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n")  # an earlier turn's
    assert reasoning_tags(r1, think_tokenizer, answered).starts_in_reasoning is True
    assert reasoning_tags(r1, None, ask) is None  # no tokenizer: no tags to look for


def test_a_constrained_output_is_read_as_the_engine_constrained_it(think_tokenizer):
    """Where the grammar starts after the reasoning, deepseek_r1 reads the output as reasoning up to </think>;
    where the prompt closed the block, the grammar held from the first token and the output is content."""
    ctx = ServingContext(engine=SimpleNamespace(tokenizer=think_tokenizer), served_model_names=["m"],
                         response_role="assistant", reasoning_parser=get_reasoning_parser("deepseek_r1"))
    chat = OpenAIServingChat(ctx)
    request = ChatCompletionRequest(messages=ASK, response_format={"type": "json_object"})
    for prompt, text, expected in [
        (think_tokenizer.encode("assistant\n"), 'x</think>{"a": 1}', ("x", '{"a": 1}')),
        (think_tokenizer.encode("assistant\n" + CLOSED), '{"a": 1}', (None, '{"a": 1}')),
    ]:
        final = RequestOutput("r", None, prompt, None, [CompletionOutput(0, text, [1], None, None, "stop")], True)
        message = json.loads(chat._json_response(request, "m", "c", final).body)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == expected


def test_the_grammar_starts_after_the_reasoning(client):
    """The scripted model thinks freely, then the schema holds: JSON instead of "Hello" after </think>."""
    import jsonschema

    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=40, temperature=0.0,
                  response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "Let me think"
    jsonschema.validate(json.loads(message.content), SCHEMA)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me think"
    assert "".join(d.content or "" for d in deltas) == message.content
    # A prompt that closed the block: the grammar holds from the first token, and the answer is all content.
    closed = [*kwargs.pop("messages"), {"role": "assistant", "content": CLOSED}]
    choice = client.chat.completions.create(messages=closed, **kwargs, extra_body={
        "continue_final_message": True, "add_generation_prompt": False}).choices[0]
    assert getattr(choice.message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_an_unconstrained_output_is_read_from_where_the_prompt_left_the_block(think_tokenizer):
    """A prompt that opened the block (Qwen3-2507's template) puts even qwen3's output in the reasoning; one that
    closed it (enable_thinking false) makes even deepseek_r1's output content, as the engine's gate reads them."""
    opened = think_tokenizer.encode("assistant\n<think>\n")
    closed = think_tokenizer.encode("assistant\n" + CLOSED)
    request = ChatCompletionRequest(messages=ASK)
    for name, prompt, text, expected in [
        ("qwen3", opened, "x</think>Hello", ("x", "Hello")),
        ("qwen3", opened, "still thinking", ("still thinking", None)),
        ("deepseek_r1", closed, "Hello", (None, "Hello")),
        ("qwen3", closed, "Hello", (None, "Hello")),
        ("qwen3", think_tokenizer.encode("assistant\n"), "Hello", (None, "Hello")),
    ]:
        ctx = ServingContext(engine=SimpleNamespace(tokenizer=think_tokenizer), served_model_names=["m"],
                             response_role="assistant", reasoning_parser=get_reasoning_parser(name))
        chat = OpenAIServingChat(ctx)
        final = RequestOutput("r", None, prompt, None, [CompletionOutput(0, text, [1], None, None, "stop")], True)
        message = json.loads(chat._json_response(request, "m", "c", final).body)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == expected, (name, text)
        streamed = chat.reasoning_reader(request, prompt)  # the streamed side reads it the same way
        pieces = [streamed.extract_reasoning_streaming(ch) for ch in text] + [streamed.finish()]
        got = ("".join(p.reasoning or "" for p in pieces) or None, "".join(p.content or "" for p in pieces) or None)
        assert got == expected, (name, text)
