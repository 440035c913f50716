"""Response and request fields that OpenAI and vLLM clients read: ``usage.prompt_tokens_details.cached_tokens``
(``--enable-prompt-tokens-details``), ``usage.completion_tokens_details.reasoning_tokens`` (``--reasoning-parser``),
the body's ``request_id``, ``refusal: null`` in chat messages and vLLM's ``reasoning`` beside ``reasoning_content``.
Serving tests over fixed outputs, and one real server with the official client over a model that replies
``<think>Let me think</think>Hello`` to any chat prompt."""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import httpx
import pytest

from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from runtime.entrypoints.openai.reasoning import get_reasoning_parser
from runtime.entrypoints.openai.reasoning_tokens import ReasoningTokenCounter
from runtime.entrypoints.openai.serving_chat import OpenAIServingChat
from runtime.entrypoints.openai.serving_completion import OpenAIServingCompletion
from runtime.entrypoints.openai.serving_engine import OpenAIServing, ServingContext
from runtime.outputs import CompletionOutput, RequestOutput
from support.remote_server import SERVER_FLAGS, running_server
from support.scripted_model import build_scripted_model

ASK = [{"role": "user", "content": "hi"}]
BLOCK_SIZE = 16  # the engine's default


@pytest.fixture(scope="module")
def tokenizer():
    from runtime.testing.models import smollm2_tokenizer

    return smollm2_tokenizer()


def ids(tokenizer, *pieces: str) -> list[int]:
    return [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False)]


def counted(parser_name: str, tokenizer, token_ids: list[int], chunk: int | None = None) -> int:
    counter = ReasoningTokenCounter(get_reasoning_parser(parser_name)(tokenizer), tokenizer)
    for start in range(0, len(token_ids), chunk or max(len(token_ids), 1)):
        counter.add(token_ids[start:start + (chunk or len(token_ids))])
        counter.count()  # as continuous usage asks after each chunk
    return counter.count(finished=True)


# ------------------------------------------------------------ reasoning tokens
@pytest.mark.parametrize("text, qwen3, deepseek_r1", [
    ("<think>Let me think</think>Hello", 3, 3),  # the tags (3 tokens each here) are not reasoning
    ("Let me think</think>Hello", 0, 3),  # deepseek_r1: the template opened the block in the prompt
    ("<think>Let me think", 3, 3),  # cut short inside the reasoning: all of it after the tag
    ("Hello there", 0, 2),
    ("  <think>\nab</think>\n\nHi", 2, 2),  # the newline after the tag is reasoning, as reasoning_content has it
    ("<think></think>Hi", 0, 0),
])
def test_a_token_counts_when_its_text_begins_inside_the_reasoning(tokenizer, text, qwen3, deepseek_r1):
    token_ids = ids(tokenizer, text)
    for chunk in (None, 1, 2):  # whole, and streamed in pieces: the same count
        assert counted("qwen3", tokenizer, token_ids, chunk) == qwen3
        assert counted("deepseek_r1", tokenizer, token_ids, chunk) == deepseek_r1
    split = get_reasoning_parser("qwen3")().extract_reasoning(text)
    assert (split.reasoning is not None) == (qwen3 > 0)


def test_single_token_tags_and_a_final_eos_are_not_reasoning(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)  # a copy of its own: the shared one must not change
    tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: not special
    token_ids = ids(tok, "<think>", "Let me think", "</think>", "Hello") + [tok.eos_token_id]
    assert len(ids(tok, "<think>")) == 1 and counted("qwen3", tok, token_ids) == 3
    assert counted("qwen3", tok, ids(tok, "<think>", "Let me think") + [tok.eos_token_id]) == 3
    counter = ReasoningTokenCounter(get_reasoning_parser("qwen3")(tok), None)  # no tokenizer: no text
    counter.add(token_ids)
    assert counter.count(finished=True) == 0


def test_the_count_settles_once_the_reasoning_ends(tokenizer):
    counter = ReasoningTokenCounter(get_reasoning_parser("qwen3")(tokenizer), tokenizer)
    counter.add(ids(tokenizer, "<think>a b</think>"))
    assert counter.count() == 2
    counter.add(ids(tokenizer, " more text that is content") * 50)
    assert counter.count(finished=True) == 2 and len(counter._starts) < 20  # the content is not decoded


# ------------------------------------------------------------ serving over fixed outputs
def final_output(text: str, token_ids: list[int], num_cached: int = 0, n: int = 1) -> RequestOutput:
    outputs = [CompletionOutput(i, text, list(token_ids), None, None, "stop") for i in range(n)]
    return RequestOutput("r", None, [1, 2, 3], None, outputs, True, num_cached_tokens=num_cached)


def chat_serving(tokenizer=None, reasoning: str | None = None, details: bool = False) -> OpenAIServingChat:
    ctx = ServingContext(engine=SimpleNamespace(tokenizer=tokenizer), served_model_names=["m"],
                         reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None,
                         enable_prompt_tokens_details=details)
    return OpenAIServingChat(ctx)


def test_usage_details_only_with_their_flags(tokenizer):
    """Without the flags usage keeps OpenAI's three counts only; with them, the details objects."""
    text = "<think>Let me think</think>Hello"
    final = final_output(text, ids(tokenizer, text), num_cached=16, n=2)
    request = ChatCompletionRequest(messages=ASK, n=2)
    body = json.loads(chat_serving(tokenizer)._json_response(request, "m", "c", final).body)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}
    assert body["choices"][0]["message"]["refusal"] is None  # OpenAI's message always has it
    body = json.loads(chat_serving(tokenizer, "qwen3", details=True)._json_response(request, "m", "c", final).body)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23,
                             "prompt_tokens_details": {"cached_tokens": 16},
                             "completion_tokens_details": {"reasoning_tokens": 6}}  # 3 per choice
    completion = OpenAIServingCompletion(ServingContext(engine=SimpleNamespace(tokenizer=None), served_model_names=["m"],
                                                        enable_prompt_tokens_details=True))
    finals = [final_output("x", [5], num_cached=16), final_output("y", [6], num_cached=32)]
    body = json.loads(completion._json_response(CompletionRequest(prompt=["a", "b"]), "m", "c", finals).body)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}  # each prompt's hits, summed


def test_streamed_usage_counts_reasoning_per_choice_and_in_all(tokenizer):
    chat = chat_serving(tokenizer, "qwen3", details=True)
    pieces = ["<think>", "Let me", " think</think>", "Hello"]
    request = ChatCompletionRequest(messages=ASK, stream=True, n=2,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True})

    async def outputs():
        for i, piece in enumerate(pieces):
            done = i == len(pieces) - 1
            completions = [CompletionOutput(c, piece, ids(tokenizer, piece), None, None, "stop" if done else None)
                           for c in range(2)]
            yield RequestOutput("r", None, [1, 2, 3], None, completions, done, num_cached_tokens=16)

    async def collect():
        return [event async for event in chat._stream(request, "m", "c", outputs(), 3)]

    chunks = [json.loads(e.removeprefix(b"data: ")) for e in asyncio.run(collect()) if e != b"data: [DONE]\n\n"]
    per_choice = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert "prompt_tokens_details" not in chunk["usage"]  # as vLLM: only in the final usage
        per_choice[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens_details"]["reasoning_tokens"])
    assert per_choice[0] == per_choice[1] == [0, 2, 3, 3]  # role chunk, then each piece but the tag (no chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


def test_reasoning_comes_under_both_names_and_only_with_the_parser(tokenizer):
    """vLLM's newer ``reasoning`` and its older ``reasoning_content``, the same text, unary and streamed (on the path
    that builds no models and the one that does); neither without --reasoning-parser."""
    text, request = "<think>Let me think</think>Hello", ChatCompletionRequest(messages=ASK)
    for chat, expected in ((chat_serving(tokenizer, "qwen3"), "Let me think"), (chat_serving(tokenizer), None)):
        message = json.loads(chat._json_response(request, "m", "c", final_output(text, [1])).body)["choices"][0]["message"]
        assert message.get("reasoning") == message.get("reasoning_content") == expected
        assert ("reasoning" in message) == ("reasoning_content" in message) == (expected is not None)
        for logprobs in (False, True):
            streamed = ChatCompletionRequest(messages=ASK, stream=True, logprobs=logprobs)
            completion = CompletionOutput(0, text, [1], [{1: SimpleNamespace(logprob=-1.0, decoded_token="x")}] if
                                          logprobs else None, None, "stop")
            delta = chat._stream_choice(streamed, completion, None, chat.reasoning_reader(streamed))["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content") == expected
            assert ("reasoning" in delta) == (expected is not None)


# ------------------------------------------------------------ request_id
def test_the_body_request_id_names_the_request_unless_a_header_does():
    assert OpenAIServing.request_ids("cmpl", None, "mine")[0] == "cmpl-mine"
    response_id, engine_id = OpenAIServing.request_ids("cmpl", None, "mine")
    assert engine_id.startswith("cmpl-mine-") and engine_id != OpenAIServing.request_ids("cmpl", None, "mine")[1]
    raw = SimpleNamespace(headers={"x-request-id": "from-header"}, state=SimpleNamespace(request_id=None))
    assert OpenAIServing.request_ids("chatcmpl", raw, "mine")[0] == "chatcmpl-from-header"
    made = SimpleNamespace(headers={}, state=SimpleNamespace(request_id="made"))  # the middleware's own id
    assert OpenAIServing.request_ids("chatcmpl", made, "mine")[0] == "chatcmpl-mine"
    for bad in ["", "x" * 257, "caf\u00e9", "a\nb"]:
        with pytest.raises(ValueError, match="request_id"):
            CompletionRequest(prompt="hi", request_id=bad)


# ------------------------------------------------------------ a real server
@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_usage_details")
    script = ["<think>", "Let", " me", " think", "</think>", "Hello"]
    model = build_scripted_model(tiny_llama, folder / "model", script, added_tokens=["<think>", "</think>"])
    flags = SERVER_FLAGS + ["--served-model-name", "tiny", "--reasoning-parser", "qwen3",
                            "--enable-prompt-tokens-details"]
    with running_server(model, flags, folder / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=60)


def test_the_official_client_reads_reasoning_and_its_tokens(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=20)
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].message.reasoning == "Let me think" and reply.choices[0].message.refusal is None
    usage = reply.usage
    assert usage.completion_tokens == 7  # the script and EOS
    assert usage.completion_tokens_details.reasoning_tokens == 3  # "Let", " me", " think": not the tags nor EOS
    chunks = list(client.chat.completions.create(stream=True, n=2, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 6


def test_the_official_client_reads_cached_tokens(client):
    """A prompt sent again is served from the prefix cache: its full blocks (not the last token), in unary and
    streamed usage, on both endpoints."""
    prompt = f"{uuid.uuid4().hex} one two three four five six seven eight nine ten"  # new to the cache
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.usage.prompt_tokens > 2 * BLOCK_SIZE
    expected = (first.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == expected
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_the_body_request_id_over_http(server, client):
    chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body={"request_id": "job-7"})
    assert chat.id == "chatcmpl-job-7"
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"request_id": "job-7"},
                                           extra_headers={"X-Request-Id": "trace-1"})
    assert completion.id == "cmpl-trace-1"  # the header first, as vLLM
    response = httpx.post(server.url + "/v1/completions", headers=server.headers(),
                          json={"model": "tiny", "prompt": "hi", "request_id": "x" * 300})
    assert response.status_code == 400 and response.json()["error"]["param"] == "request_id"
    assert "256 printable ASCII" in response.json()["error"]["message"]
