"""The OpenAI server (a real subprocess, the official client) against transformers and against itself.

Every test runs against one API process and against two (``--api-server-count 2``, the
processes sharing the port and one engine core, /metrics summed over both); the two-process
server also streams with ``--stream-interval 3``, so every streaming test checks coalesced
chunks too.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import openai
import pytest
import torch

from support.remote_server import SERVER_FLAGS, RemoteServer, wait_for

API_KEY = "test-key"
MODEL = "tiny"
MAX_TOKENS = 8
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


# (api server processes, stream interval)
FRONT_ENDS = {"api1": (1, 1), "api2": (2, 3)}


@pytest.fixture(scope="module", params=list(FRONT_ENDS))
def server(request, tiny_llama, tmp_path_factory):
    num_api_servers, stream_interval = FRONT_ENDS[request.param]
    log = tmp_path_factory.mktemp("server") / "server.log"
    flags = SERVER_FLAGS + ["--served-model-name", MODEL, "--max-body-bytes", "100000",
                            "--api-server-count", str(num_api_servers), "--stream-interval", str(stream_interval)]
    srv = RemoteServer(tiny_llama, flags, log, api_key=API_KEY).wait_ready()
    srv.stream_interval = stream_interval
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(tiny_llama), model


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy token ids and the log-softmax row of each step, by full forward passes."""
    ids = list(prompt_ids)
    rows = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
            row = torch.log_softmax(logits, dim=-1)
            rows.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt_ids):], rows


def complete(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kwargs})


# ----------------------------------------------------------------- basics
def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_matches_transformers(client, hf):
    tokenizer, model = hf
    prompt = "Hello, my name is"
    prompt_ids = tokenizer.encode(prompt)
    ref_ids, ref_rows = hf_greedy(model, prompt_ids, MAX_TOKENS)
    out = complete(client, prompt, logprobs=3)
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(ref_ids)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.total_tokens == len(prompt_ids) + MAX_TOKENS
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    for token_id, row, logprob, top in zip(ref_ids, ref_rows, lp.token_logprobs, lp.top_logprobs):
        assert logprob == pytest.approx(float(row[token_id]), abs=2e-3)
        expected_top = torch.topk(row, 3).values.tolist()
        assert sorted(top.values(), reverse=True) == pytest.approx(expected_top, abs=2e-3)


def test_chat_matches_transformers(client, hf):
    tokenizer, model = hf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    ref_ids, ref_rows = hf_greedy(model, prompt_ids, 5)
    out = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=5, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(ref_ids)
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 5
    content = choice.logprobs.content
    assert len(content) == 5
    for token_id, row, entry in zip(ref_ids, ref_rows, content):
        assert entry.logprob == pytest.approx(float(row[token_id]), abs=2e-3)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(float(row.max()), abs=2e-3)
        assert bytes(entry.bytes).decode() == entry.token


def test_chat_logprob_bytes_are_the_tokens_own(client, hf):
    """A character split over two tokens: each token alone shows as U+FFFD, and its ``bytes`` are its own (joined,
    the character's UTF-8), as OpenAI's field is meant; they were U+FFFD's bytes, which say nothing."""
    tokenizer, _ = hf
    char = next(c for c in "你好世界😀🙂" if len(tokenizer.encode(c, add_special_tokens=False)) == 2)
    pieces = tokenizer.encode(char, add_special_tokens=False)
    joined = b""
    for token_id in pieces:
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=1, logprobs=True,
            logit_bias={str(token_id): 100}, extra_body={"ignore_eos": True})
        entry = chat.choices[0].logprobs.content[0]
        assert entry.token == "\ufffd"
        joined += bytes(entry.bytes)
    assert joined.decode() == char


# -------------------------------------------------------------- streaming
def test_completion_stream_equals_unary(client):
    unary = complete(client, "The capital of France is", logprobs=1)
    chunks = list(complete(client, "The capital of France is", logprobs=1, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # really incremental
    assert "".join(c.choices[0].text for c in text_chunks) == unary.choices[0].text
    tokens = [t for c in text_chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == unary.choices[0].logprobs.tokens
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == unary.usage.model_dump()


def test_chat_stream_equals_unary(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=6,
                  extra_body={"ignore_eos": True})
    unary = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 == unary.usage.completion_tokens
    # without include_usage, no chunk carries usage
    assert all(c.usage is None for c in client.chat.completions.create(**kwargs, stream=True))


def test_chat_echo_starts_the_reply_with_the_last_message_of_its_role(client):
    """vLLM's chat ``echo``: with add_generation_prompt off and a last assistant message (a continuation), the reply
    starts with that message, streamed (a chunk of it per choice after the role chunk) and unary alike; with the
    last message a user's, echo adds nothing."""
    partial = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello, my friend"}]
    kwargs = dict(model=MODEL, messages=partial, temperature=0, max_tokens=5, n=2,
                  extra_body={"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kwargs)
    echoed = client.chat.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "echo": True}})
    assert [c.message.content for c in echoed.choices] == ["Hello, my friend" + c.message.content for c in plain.choices]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = list(client.chat.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "echo": True}},
                                                 stream=True))
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert [texts[i] for i in range(2)] == [c.message.content for c in echoed.choices]
    user_last = client.chat.completions.create(model=MODEL, messages=partial[:1], temperature=0, max_tokens=5,
                                               extra_body={"ignore_eos": True, "echo": True})
    assert user_last.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=partial[:1], temperature=0, max_tokens=5, extra_body={"ignore_eos": True}).choices[0].message.content


def test_continuous_usage_stats_only_with_include_usage(client):
    """vLLM's ``continuous_usage_stats`` puts usage in every chunk, the role chunks too, but only with
    ``include_usage``; alone it changes nothing (it gave usage in every chunk, and no usage chunk)."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=4, n=2,
                extra_body={"ignore_eos": True}, stream=True)
    alone = {"continuous_usage_stats": True}
    assert all(c.usage is None for c in client.chat.completions.create(**chat, stream_options=alone))
    assert all(c.usage is None for c in complete(client, "hi", n=2, stream=True, stream_options=alone))
    both = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(**chat, stream_options=both))
    assert all(c.usage is not None for c in chunks)
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 8
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert len(roles) == 2 and all(c.usage.model_dump() == {**final.model_dump(), "completion_tokens": 0,
                                                            "total_tokens": final.prompt_tokens} for c in roles)
    chunks = list(complete(client, "hi", n=2, stream=True, stream_options=both))
    assert all(c.usage is not None for c in chunks) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS
    # Each choice's chunks count that choice's tokens so far (vLLM's), up to its own total.
    for stream, per_choice in ((client.chat.completions.create(**chat, stream_options=both), 4),
                               (complete(client, "hi", n=2, stream=True, stream_options=both, max_tokens=MAX_TOKENS), MAX_TOKENS)):
        counts: dict[int, list[int]] = {}
        for chunk in stream:
            for choice in chunk.choices:
                counts.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
        assert sorted(counts) == [0, 1]
        assert all(c == sorted(c) and c[-1] == per_choice for c in counts.values()), counts

def test_stream_interval_same_text_fewer_chunks(server, client):
    """A chunk once --stream-interval new tokens are in (the first at once); a reader that falls behind
    gets what queued up as one chunk, so there may be fewer still, never more, and never other text."""
    num_tokens, interval = 13, server.stream_interval
    kwargs = dict(max_tokens=num_tokens, stream_options={"include_usage": True})
    unary = complete(client, "Count with me:", max_tokens=num_tokens)
    chunks = list(complete(client, "Count with me:", stream=True, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == unary.choices[0].text
    assert chunks[-1].usage.completion_tokens == num_tokens
    assert 1 < len(text_chunks) <= 1 + -(-(num_tokens - 1) // interval)
    ids = [list(c.choices[0].model_extra["token_ids"]) for c in complete(
        client, "Count with me:", stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
        max_tokens=num_tokens) if c.choices]
    assert sum(len(i) for i in ids) == num_tokens and all(ids)
    assert len(ids[0]) == 1 and all(len(i) >= interval for i in ids[1:-1])  # the first token at once


# ------------------------------------------------------------ n, seed, stop
def test_n_and_seed(client):
    sample = dict(temperature=1.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    first = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=7, **sample)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=7, **sample)
    other = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=8, **sample)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # the two samples differ
    assert first.usage.completion_tokens == 2 * MAX_TOKENS
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=7, stream=True, **sample):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == texts


def test_stop_string(client):
    full = complete(client, "1 2 3 4 5").choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    out = complete(client, "1 2 3 4 5", stop=[stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in complete(client, "1 2 3 4 5", stop=stop, stream=True) if c.choices)
    assert streamed == expected


def test_prompt_forms_and_echo(client, hf):
    tokenizer, _ = hf
    a, b = "The sky is", "My favourite food is"
    single_a = complete(client, a).choices[0].text
    single_b = complete(client, b).choices[0].text
    both = complete(client, [a, b])
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [single_a, single_b]
    assert both.usage.prompt_tokens == len(tokenizer.encode(a)) + len(tokenizer.encode(b))
    assert complete(client, tokenizer.encode(a)).choices[0].text == single_a
    two_id_prompts = complete(client, [tokenizer.encode(a), tokenizer.encode(b)])
    assert [c.text for c in sorted(two_id_prompts.choices, key=lambda c: c.index)] == [single_a, single_b]
    echoed = complete(client, a, echo=True, logprobs=1).choices[0]
    assert echoed.text == a + single_a
    assert echoed.logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert len(echoed.logprobs.tokens) == len(tokenizer.encode(a)) + MAX_TOKENS
    # text_offset: each token's position in the text (prompt tokens included with echo)
    tokens, offsets = echoed.logprobs.tokens, echoed.logprobs.text_offset
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert offsets[len(tokenizer.encode(a))] == len(a)
    # Characters split over tokens (each part shows a replacement character, so the parts are longer than
    # the text they make): the offsets still never go backwards, streamed or not (a fuzzed request, session 31).
    split = "\U0001f389\U0001f389 hi"
    whole = complete(client, split, echo=True, logprobs=0).choices[0].logprobs.text_offset
    streamed = [o for chunk in complete(client, split, echo=True, logprobs=0, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for o in chunk.choices[0].logprobs.text_offset]
    for got in (whole, streamed):
        assert len(got) == len(tokenizer.encode(split)) + MAX_TOKENS and got == sorted(got)


def test_completion_top_logprobs_hold_the_chosen_token(client):
    """OpenAI's (and vLLM's) completions logprobs: the ``logprobs`` most likely tokens and the chosen one,
    up to logprobs + 1 entries (a sampled or prompt token outside the top was left out; logprobs=0 gave {})."""
    sample = dict(prompt="The sky is", temperature=1.5, seed=3, echo=True)
    for num in (0, 1):
        unary = complete(client, logprobs=num, **sample).choices[0].logprobs
        streamed = [c.choices[0].logprobs for c in complete(client, logprobs=num, stream=True, **sample)
                    if c.choices and c.choices[0].logprobs]
        for lp in [unary, *streamed]:
            assert lp.top_logprobs
            for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
                if top is None:  # the first prompt token
                    continue
                assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= num + 1
                if num == 0:
                    assert top == {token: logprob}
                else:
                    assert max(top.values()) >= logprob
        tops = [top for top in unary.top_logprobs if top]
        assert len(tops) == len(unary.tokens) - 1
        if num == 1:
            assert any(len(top) == 2 for top in tops)  # a prompt token outside the top 1 is there too

def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, client):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens are the prompt (usage counts them, echo shows
    them); a text prompt too; 0 is a 400 naming the field."""
    ids = list(range(1000, 1020))
    whole = complete(client, ids[-5:], echo=True, logprobs=0)
    cut = complete(client, ids, echo=True, logprobs=0, extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
    assert cut.usage.prompt_tokens == 5 == whole.usage.prompt_tokens
    assert cut.choices[0].text == whole.choices[0].text
    text = complete(client, "one two three four five six seven eight nine ten", extra_body={"truncate_prompt_tokens": 3,
                                                                                                "ignore_eos": True})
    assert text.usage.prompt_tokens == 3
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "truncate_prompt_tokens": 0},
                          headers=server.headers())
    assert response.status_code == 400 and response.json()["error"]["param"] == "truncate_prompt_tokens", response.text


def test_prompt_logprobs_in_the_response(client, hf):
    """vLLM's ``prompt_logprobs``: completions' choices and chat responses carry, per prompt position, None (the
    first) or {token id: {logprob, rank, decoded_token}} with the prompt's own token, close to transformers'."""
    tokenizer, model = hf
    ids = tokenizer("The capital of France is")["input_ids"]
    out = complete(client, ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    field = out.choices[0].model_extra["prompt_logprobs"]
    assert len(field) == len(ids) and field[0] is None
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for position, token_id in enumerate(ids[1:], start=1):
        entries = field[position]
        assert str(token_id) in entries and 2 <= len(entries) <= 3, entries
        own = entries[str(token_id)]
        assert abs(own["logprob"] - expected[position - 1, token_id].item()) < 1e-3 and own["rank"] >= 1
        assert own["decoded_token"] == tokenizer.decode([token_id])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    field = chat.model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == chat.usage.prompt_tokens and all(len(e) == 1 for e in field[1:])


def test_return_tokens_as_token_ids(client):
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token (and each top entry) as ``token_id:N``, the
    same tokens the text comes from; streamed completions and chat too."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True}
    out = complete(client, "The capital of France is", logprobs=2, extra_body=extra)
    ids = out.choices[0].model_extra["token_ids"]
    assert out.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert all(all(k.startswith("token_id:") for k in top) and len(top) >= 2 for top in out.choices[0].logprobs.top_logprobs)
    streamed = [t for c in complete(client, "The capital of France is", logprobs=2, stream=True, extra_body=extra)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == out.choices[0].logprobs.tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body=extra)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(c.token.startswith("token_id:") and c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)


def test_max_tokens_variants(client):
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(max_completion_tokens=3, **chat).usage.completion_tokens == 3
    assert client.chat.completions.create(max_tokens=2, **chat).usage.completion_tokens == 2
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5, seed=1,
                                    extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2})
    assert out.usage.completion_tokens == 4


def test_logit_bias_forces_token(client, hf):
    tokenizer, _ = hf
    token_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = complete(client, "Hello", logit_bias={str(token_id): 100}, max_tokens=3)
    assert out.choices[0].text == tokenizer.decode([token_id] * 3)


# ------------------------------------------------------------ concurrency
def test_64_concurrent_streams_equal_solo_runs(server, client):
    prompts = [f"Request number {i} says" for i in range(64)]
    short = {**GREEDY, "max_tokens": 4}
    solo = [complete(client, p, **short).choices[0].text for p in prompts]

    async def run_all():
        aclient = server.async_client()

        async def one(prompt):
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, stream=True, **short)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run_all()) == solo
    assert server.metric("runtime:num_requests_running") == 0


def check_stream_shape(events: list[dict], num_choices: int, include_usage: bool) -> None:
    """OpenAI's chunks: each choice index finishes once, in its last chunk; the usage chunk (choices
    empty) comes last, and only when asked for."""
    finished: set[int] = set()
    for event in events:
        assert "error" not in event, event
        for choice in event["choices"]:
            assert choice["index"] not in finished, event
            if choice["finish_reason"] is not None:
                finished.add(choice["index"])
    assert finished == set(range(num_choices))
    if include_usage:
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    else:
        assert all(event.get("usage") is None for event in events)


def test_streams_dropped_mid_way_or_read_slowly_leave_nothing_running(server):
    """Many streams at once (n > 1, logprobs, stop strings, usage): some clients hang up after a few
    chunks, some read slowly, the rest read all; afterwards nothing runs or waits and new requests work."""

    async def one(http: httpx.AsyncClient, i: int) -> str:
        rng = random.Random(i)
        n = rng.choice([1, 2, 3])
        usage = rng.random() < 0.5
        body = {"model": MODEL, "max_tokens": rng.choice([6, 40]), "n": n, "stream": True, "ignore_eos": True,
                "temperature": 1.0, "seed": i, "stop": ["e", "the"] if rng.random() < 0.4 else None,
                "stream_options": {"include_usage": usage, "continuous_usage_stats": rng.random() < 0.5}}
        if i % 2:
            path, body = "/v1/completions", {**body, "prompt": rng.choice(["hi", [[1, 2, 3], [4, 5]]]), "logprobs": 2}
            n *= 1 if isinstance(body["prompt"], str) else 2
        else:
            path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}],
                                                  "logprobs": True, "top_logprobs": 2}
        mode = ("drop", "slow", "full")[i % 3]
        events = []
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line[6:]))
                if mode == "drop" and len(events) == 1 + i % 4:
                    return "dropped"  # closes the connection mid-stream
                if mode == "slow":
                    await asyncio.sleep(0.05)
        check_stream_shape(events, n, usage)
        return mode

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(30)))

    done = asyncio.run(run_all())
    assert done.count("dropped") >= 5 and done.count("full") == 10 and done.count("slow") == 10
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0
                    and server.metric("runtime:num_requests_waiting") == 0)
    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(server.client(), "still there?").usage.completion_tokens == MAX_TOKENS

def test_client_disconnect_aborts(server):
    before = server.metric("runtime:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers()) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # generation started
        # the gauges come with the engine's step stats (to one API server of several): they follow, eventually
        assert wait_for(lambda: server.metric("runtime:num_requests_running") == 1)
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0)
    assert server.metric("runtime:request_success_total", finished_reason="abort") == before + 1
    # a unary request whose client gives up is aborted too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, headers=server.headers(), timeout=0.5)
    assert wait_for(lambda: server.metric("runtime:request_success_total", finished_reason="abort") == before + 2)
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0)



# ------------------------------------------------------------- request ids
def test_x_request_id_names_the_completion_and_its_log_line(server, client):
    """vLLM: an X-Request-Id header is the base of the response id (cmpl-<id>, chatcmpl-<id>, every chunk's too)
    and of the id the request is logged and run under; one that is too long or not ASCII is ignored (a new id)."""
    given = {"X-Request-Id": "trace-42/a b"}
    assert complete(client, "hi", extra_headers=given).id == "cmpl-trace-42/a b"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, extra_headers=given, **GREEDY))
    assert {chunk.id for chunk in chunks} == {"chatcmpl-trace-42/a b"}
    assert wait_for(lambda: "Received request cmpl-trace-42/a b-" in server.log()
                    and "Received request chatcmpl-trace-42/a b-" in server.log())
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", complete(client, "hi").id)
    for bad in [b"x" * 257, "caf\u00e9".encode()]:
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                              headers={"X-Request-Id": bad, **server.headers()})
        assert response.status_code == 200 and re.fullmatch(r"cmpl-[0-9a-f]{32}", response.json()["id"]), bad
    assert complete(client, "hi", extra_headers={"X-Request-Id": "y" * 256}).id == "cmpl-" + "y" * 256


def test_requests_sharing_an_x_request_id_run_apart(server):
    """Requests in flight at once with one X-Request-Id (n = 2 each: a stream the client drops, a stream read to the
    end, a unary one) all run: the engine gets an id of its own for each, so dropping one aborts only that one."""
    headers = {"X-Request-Id": "same-id"}
    aborted = server.metric("runtime:request_success_total", finished_reason="abort")
    body = dict(model=MODEL, prompt="hi", n=2, extra_body={"ignore_eos": True}, extra_headers=headers)

    async def run():
        aclient = server.async_client()
        try:
            dropped = await aclient.completions.create(stream=True, max_tokens=240, **body)
            first = await dropped.__anext__()  # generation started; 240 tokens keep it in flight
            kept = await aclient.completions.create(stream=True, max_tokens=30, **body,
                                                    stream_options={"include_usage": True})
            unary = asyncio.ensure_future(aclient.completions.create(max_tokens=30, **body))
            await asyncio.sleep(0.05)
            await dropped.close()  # the client goes away: the server aborts that request
            return first, [chunk async for chunk in kept], await unary
        finally:
            await aclient.close()

    first, kept, unary = asyncio.run(run())
    assert first.id == unary.id == "cmpl-same-id" and {chunk.id for chunk in kept} == {"cmpl-same-id"}
    assert kept[-1].usage.completion_tokens == unary.usage.completion_tokens == 2 * 30
    assert sorted(c.finish_reason for chunk in kept for c in chunk.choices if c.finish_reason) == ["length"] * 2
    assert [c.finish_reason for c in unary.choices] == ["length"] * 2
    assert wait_for(lambda: server.metric("runtime:request_success_total", finished_reason="abort") == aborted + 2)
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0)


# ---------------------------------------------------------------- errors
BAD_REQUESTS = [
    ("completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),  # not sampled quietly instead
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True}, 400, "use_beam_search"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),  # OpenAI: stream only
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                          "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 99999999]}, 400, "prompt"),
    ("completions", {"prompt": "hello " * 300}, 400, "prompt"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": "hi", "stream": True, "temperature": -1}, 400, "temperature"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS, ids=[f"{p}-{s}-{q}" for p, _, s, q in BAD_REQUESTS])
def test_bad_request(server, path, body, status, param):
    body = {"model": MODEL, **body}
    response = httpx.post(f"{server.url}/v1/{path}", json=body, headers=server.headers(), timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_bad_json_and_official_client_errors(server, client):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={**server.headers(), "content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="hi")


def test_api_key(server):
    for path in ("/v1/models",):
        assert httpx.get(server.url + path).status_code == 401
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_oversized_body(server):
    big = {"model": MODEL, "prompt": "x" * 200_000}
    response = httpx.post(server.url + "/v1/completions", json=big, headers=server.headers())
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"x" * 10_000
        yield b'"}'

    response = httpx.post(server.url + "/v1/completions", content=chunks(), headers={**server.headers(), "content-type": "application/json"})
    assert response.status_code == 413


def test_tokenize_detokenize(server, hf):
    tokenizer, _ = hf
    response = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert response["tokens"] == tokenizer.encode("Hello world") and response["count"] == len(response["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": response["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_bench_serve_against_server(server, tmp_path):
    import argparse
    import json

    from runtime.bench import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    result_file = tmp_path / "result.json"
    args = parser.parse_args([
        "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6", "--random-input-len", "12",
        "--random-output-len", "4", "--request-rate", "20", "--max-concurrency", "3",
        "--save-result", "--result-filename", str(result_file), "--metric-percentiles", "50,99",
    ])
    assert bench_serve.main(args) == 0
    result = json.loads(result_file.read_text())
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 6 * 4 and result["total_input_tokens"] == 6 * 12
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["p99_itl_ms"] > 0
    assert [r["output_tokens"] for r in result["results"]] == [4] * 6


def test_errors_counted_and_server_healthy(server, client):
    """Run last: every error above was counted, nothing leaked, and the server still serves."""
    samples = server.metrics()
    num_400 = samples.get(("runtime:request_errors_total", (("status", "400"), ("type", "invalid_request_error"))), 0)
    num_404 = samples.get(("runtime:request_errors_total", (("status", "404"), ("type", "invalid_request_error"))), 0)
    num_bad = sum(1 for _, _, status, _ in BAD_REQUESTS if status == 400)
    assert num_400 >= num_bad and num_404 >= 2
    assert samples[("runtime:http_responses_total", (("path", "/v1/completions"), ("status", "413")))] >= 2
    assert samples[("runtime:num_requests_running", ())] == 0 and samples[("runtime:num_requests_waiting", ())] == 0
    assert samples[("runtime:request_success_total", (("finished_reason", "length"),))] > 64
    assert samples[("runtime:time_to_first_token_seconds_count", ())] > 64
    assert samples[("runtime:generation_tokens_total", ())] > 64 * 4 * 2
    assert samples[("runtime:prefix_cache_queries_total", ())] > 0
    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(client, "still alive?").usage.completion_tokens == MAX_TOKENS
