"""`runtime serve --async-scheduling` on the CPU: the engine-core process queues each step
before the previous one's tokens are back, and concurrent and streamed completions still
carry transformers' greedy tokens (token-ids-only mode: logprob tokens read ``token_id:N``)."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from remote_server import RemoteServer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hardware", "cuda"))
from cuda_tiny import build_untokenized_model, make_prompts, reference_outputs  # noqa: E402

NUM_NEW_TOKENS = 10
FLAGS = ["--platform", "cpu", "--dtype", "float32", "--skip-tokenizer-init", "--async-scheduling",
         "--max-model-len", "256", "--block-size", "4"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("async-served")
    path = build_untokenized_model("qwen3", folder / "model")
    prompts = make_prompts()
    expected = [tokens for tokens, _ in reference_outputs(path, prompts, NUM_NEW_TOKENS)]
    server = RemoteServer(path, FLAGS, folder / "server.log").wait_ready()
    yield server, prompts, expected
    server.stop()


def token_ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_concurrent_completions_match_transformers(served):
    server, prompts, expected = served
    client = server.client()
    model = client.models.list().data[0].id

    def complete(prompt: list[int]) -> list[int]:
        response = client.completions.create(
            model=model, prompt=prompt, max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=1
        )
        assert response.choices[0].finish_reason == "length"
        return token_ids(response.choices[0].logprobs.tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(complete, prompts)) == expected


def test_streamed_completion_and_stop_token(served):
    server, prompts, expected = served
    client = server.client()
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt=prompts[1], max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=1, stream=True
    )
    tokens = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]
    assert token_ids(tokens) == expected[1]
    # A stop token mid-way: the step queued behind it must not leak an extra token.
    stop = expected[1][4]
    response = client.completions.create(
        model=model, prompt=prompts[1], max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=1,
        extra_body={"stop_token_ids": [stop]},
    )
    got = token_ids(response.choices[0].logprobs.tokens)
    assert got == expected[1][: expected[1].index(stop) + 1]
    assert response.choices[0].finish_reason == "stop"
