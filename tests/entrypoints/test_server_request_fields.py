"""Request fields as vLLM (and OpenAI) treat them, through a real server and the official client:
``truncate_prompt_tokens`` bounded by the context, the empty prompt of a list named by its index,
vLLM's ``return_token_ids`` on chat completions, and ``response_format.json_schema.name`` required."""

from __future__ import annotations

import httpx
import openai
import pytest

from support.remote_server import SERVER_FLAGS, running_server

MODEL = "tiny"
MAX_MODEL_LEN = 256  # SERVER_FLAGS'
MESSAGES = [{"role": "user", "content": "Count with me: one two"}]
GREEDY = dict(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_request_fields") / "server.log"
    with running_server(tiny_llama, SERVER_FLAGS + ["--served-model-name", MODEL], log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def create(client, endpoint: str, **kwargs):
    if endpoint == "completions":
        return client.completions.create(model=MODEL, prompt="hi there", **{**GREEDY, **kwargs})
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **{**GREEDY, **kwargs})


# ---------------------------------------------------------------- truncate_prompt_tokens
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_truncate_prompt_tokens_over_max_model_len_is_a_400(client, endpoint):
    """As vLLM: a truncation longer than the context is refused naming the field and the limit (it was accepted,
    and a short prompt ran as it was); -1 (the context) and values within it still run."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            create(client, endpoint, stream=stream, extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})
        error = info.value.body
        assert error["param"] == "truncate_prompt_tokens", error
        assert str(MAX_MODEL_LEN + 1) in error["message"] and str(MAX_MODEL_LEN) in error["message"], error
    for keep in (-1, 3, MAX_MODEL_LEN):
        out = create(client, endpoint, extra_body={"truncate_prompt_tokens": keep})
        assert out.usage.completion_tokens > 0


def test_truncate_prompt_tokens_over_max_model_len_offline(tiny_llama):
    """Offline the same bound: a ValueError naming truncate_prompt_tokens, nothing left running."""
    from runtime import LLM, SamplingParams

    llm = LLM(tiny_llama, dtype="float32", max_model_len=64, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\).*max_model_len \(64\)"):
        llm.generate(["hi there"], SamplingParams(max_tokens=2, truncate_prompt_tokens=65), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate(["hi there"], SamplingParams(max_tokens=2, truncate_prompt_tokens=64), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


# ------------------------------------------------------------------- prompt lists
@pytest.mark.parametrize("prompts, index", [(["", "a"], 0), (["a", "b", ""], 2), ([[5, 6], []], 1)])
def test_an_empty_prompt_of_a_list_is_named_by_its_index(client, prompts, index):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompts, max_tokens=2)
    error = info.value.body
    assert error["param"] == "prompt", error
    assert f"prompt[{index}] must not be empty" in error["message"], error


def test_a_single_empty_prompt_is_still_named_prompt(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="", max_tokens=2)
    assert info.value.body["param"] == "prompt" and info.value.body["message"].startswith("prompt must not be empty")


# --------------------------------------------------------- return_token_ids on chat
def test_chat_return_token_ids(server, client):
    """vLLM's ``return_token_ids`` on chat: the response's prompt_token_ids (the templated conversation) and each
    choice's token_ids; streamed, prompt_token_ids in the first chunk and each choice's ids in its chunks. It was
    ignored: neither field came back."""
    tokens = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    out = create(client, "chat", n=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.model_extra["prompt_token_ids"] == tokens
    by_index = {c.index: c.model_extra["token_ids"] for c in out.choices}
    assert sorted(by_index) == [0, 1] and all(len(ids) == GREEDY["max_tokens"] for ids in by_index.values())
    # the same ids as a completion of the templated prompt's ids
    same = client.completions.create(model=MODEL, prompt=tokens, **GREEDY, extra_body={"ignore_eos": True,
                                                                                       "return_token_ids": True})
    assert same.choices[0].model_extra["token_ids"] == by_index[0]

    chunks = list(create(client, "chat", n=2, stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == tokens
    streamed = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra.get("token_ids") or []
    assert streamed == by_index

    plain = create(client, "chat")  # not asked: no such fields
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra
    plain_chunks = list(create(client, "chat", stream=True))
    assert all("token_ids" not in c.model_extra for chunk in plain_chunks for c in chunk.choices)
    assert all("prompt_token_ids" not in chunk.model_extra for chunk in plain_chunks)


def test_chat_return_token_ids_with_logprobs_stream(client):
    """The other streaming path (logprobs): each chunk's ids are those its logprobs speak of."""
    chunks = list(create(client, "chat", stream=True, logprobs=True,
                         extra_body={"return_token_ids": True, "ignore_eos": True}))
    ids = [t for chunk in chunks for c in chunk.choices for t in c.model_extra.get("token_ids") or []]
    logprobs = [lp for chunk in chunks for c in chunk.choices if c.logprobs for lp in c.logprobs.content]
    assert len(ids) == len(logprobs) == GREEDY["max_tokens"]


# ------------------------------------------------------------- response_format
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_json_schema_without_a_name_is_a_400(client, endpoint):
    """OpenAI's API and vLLM's protocol require ``json_schema.name``; it was accepted (named "response")."""
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as info:
        create(client, endpoint, extra_body={"response_format": fmt})
    error = info.value.body
    assert error["param"] == "response_format.json_schema.name", error


def test_completions_stream_return_token_ids_has_the_prompt_ids(server, client):
    """As vLLM: streamed, the first chunk of each choice carries its prompt's prompt_token_ids (they were only in the
    unary response), later chunks do not."""
    prompts = [[5, 6, 7], [8, 9]]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, stream=True, **GREEDY,
                                            extra_body={"return_token_ids": True, "ignore_eos": True}))
    seen: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            seen.setdefault(choice.index, []).append(choice.model_extra.get("prompt_token_ids"))
    assert sorted(seen) == [0, 1, 2, 3]
    for index, prompt_ids in seen.items():
        assert prompt_ids[0] == prompts[index // 2] and not any(prompt_ids[1:]), (index, prompt_ids)
