"""`runtime serve --async-scheduling` on the CPU: the engine-core process queues each step
before the previous one's tokens are back, and concurrent and streamed completions still
carry transformers' greedy tokens (token-ids-only mode)."""

from __future__ import annotations

import pytest

from support.token_id_completions import (
    concurrent_greedy_completions,
    greedy_completion,
    served_tiny_model,
    streamed_greedy_completion,
)

NUM_NEW_TOKENS = 10
FLAGS = ["--platform", "cpu", "--dtype", "float32", "--skip-tokenizer-init", "--async-scheduling",
         "--max-model-len", "256", "--block-size", "4"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_model(tmp_path_factory.mktemp("async-served"), "qwen3", FLAGS, NUM_NEW_TOKENS) as served:
        yield served


def test_concurrent_completions_match_transformers(served):
    server, prompts, expected = served
    assert concurrent_greedy_completions(server, prompts, NUM_NEW_TOKENS) == expected


def test_streamed_completion_and_stop_token(served):
    server, prompts, expected = served
    assert streamed_greedy_completion(server, prompts[1], NUM_NEW_TOKENS) == expected[1]
    # A stop token mid-way: the step queued behind it must not leak an extra token.
    stop = expected[1][4]
    client = server.client()
    model = client.models.list().data[0].id
    ids, reason = greedy_completion(client, model, prompts[1], NUM_NEW_TOKENS, stop_token_ids=[stop])
    assert ids == expected[1][: expected[1].index(stop) + 1] and reason == "stop"
