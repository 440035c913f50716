"""OpenAI (and vLLM) request semantics through a real server and the official client: completions
``echo`` with ``max_tokens`` 0 (the prompt and its logprobs back, nothing generated), and errors
about a chat request's templated conversation naming ``messages``, the field the request has."""

from __future__ import annotations

import httpx
import openai
import pytest

from support.remote_server import SERVER_FLAGS, running_server

MODEL = "tiny"
MAX_MODEL_LEN = 256  # SERVER_FLAGS'


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_openai_semantics") / "server.log"
    with running_server(tiny_llama, SERVER_FLAGS + ["--served-model-name", MODEL], log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def tokenize(server, prompt: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs(server, client):
    """OpenAI's legacy scoring call, as vLLM answers it: the prompt as the text, its tokens' logprobs (the first
    None), finish_reason "length" and no completion tokens."""
    prompt = "hi there friend"
    ids = tokenize(server, prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == prompt and len(logprobs.tokens) == len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(token in top for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:]))
    # the same scores as the prompt_logprobs of a request that generates
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    assert scored.choices[0].logprobs.token_logprobs[:len(ids)] == pytest.approx(logprobs.token_logprobs, abs=1e-4)

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == prompt
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    streamed = [t for chunk in chunks for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)


def test_echo_with_max_tokens_0_of_several_prompts_and_n(client):
    out = client.completions.create(model=MODEL, prompt=["one two", "three"], max_tokens=0, echo=True, n=2)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (0, "one two", "length"), (1, "one two", "length"), (2, "three", "length"), (3, "three", "length"),
    ]
    assert out.usage.completion_tokens == 0
    ids = [[5, 6, 7]]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [] and out.choices[0].model_extra["prompt_token_ids"] == ids[0]


def test_max_tokens_0_without_echo_is_still_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_a_conversation_too_long_for_the_context_is_a_400_naming_messages(server, client):
    """Short enough in characters to be tokenized, too long in tokens once templated: the error names the chat
    request's own field (it named "prompt", which a chat request does not have)."""
    messages = [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert info.value.body["param"] == "messages", info.value.body
    assert str(MAX_MODEL_LEN) in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # streamed: refused before the stream starts
        client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    assert info.value.body["param"] == "messages"
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_priority_without_the_priority_policy_is_a_400_naming_it(client, endpoint):
    """As vLLM: a server that schedules first come, first served refuses a nonzero priority rather than ignore it."""
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "completions":
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 3})
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={"priority": 3})
    error = caught.value.body
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 0})
    assert ok.choices[0].finish_reason == "length"


def test_validation_errors_name_the_field_and_the_bad_value(client):
    """A bad member of a union with a model (tool_choice's named function) is named by its own path, without pydantic's
    class name in it; a bad scalar is quoted back in the message."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**chat, tool_choice={"type": "function"})
    assert info.value.body["param"] == "tool_choice.function", info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**chat, tool_choice={"type": "function", "function": {"name": 5}})
    assert info.value.body["param"] == "tool_choice.function.name", info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**chat, tool_choice="sometimes")
    assert info.value.body["param"] == "tool_choice" and "got 'sometimes'" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**chat, temperature="hot")
    assert info.value.body["param"] == "temperature" and "got 'hot'" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", seed=2**64)
    assert info.value.body["param"] == "seed" and f"got {2**64}" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # a long value is cut short
        client.completions.create(model=MODEL, prompt="hi", seed=10**4000)
    assert info.value.body["param"] == "seed" and len(info.value.body["message"]) < 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_with_stream_is_a_400(client, endpoint):
    """As vLLM: a stream has no field for prompt logprobs, so asking for them is refused (they were dropped quietly);
    unstreamed they come back."""
    def create(**kwargs):
        if endpoint == "completions":
            return client.completions.create(model=MODEL, prompt="hi there", max_tokens=2, **kwargs)
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                              **kwargs)

    with pytest.raises(openai.BadRequestError) as info:
        create(stream=True, extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs" and "stream" in info.value.body["message"]
    assert list(create(stream=True, extra_body={"prompt_logprobs": 0}))  # nothing to drop: served, as vLLM does
    out = create(extra_body={"prompt_logprobs": 1})
    extra = out.choices[0].model_extra if endpoint == "completions" else out.model_extra
    assert extra["prompt_logprobs"][0] is None and len(extra["prompt_logprobs"]) > 1
