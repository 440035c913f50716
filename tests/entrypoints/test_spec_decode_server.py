"""`runtime serve --speculative-config` on the CPU: several tokens per step reach concurrent and
streamed completions (token-ids-only mode) as transformers' greedy tokens, a stop token inside
an accepted run of drafts ends the stream there, and the acceptance counters reach /metrics."""

from __future__ import annotations

import json

import pytest

from support.token_id_completions import (
    concurrent_greedy_completions,
    greedy_completion,
    served_tiny_model,
    streamed_greedy_completion,
)

NUM_NEW_TOKENS = 16
# A self-drafting draft model would accept everything; ngram (1-token lookups) drafts often on the
# tiny models' repetitive outputs and gets some drafts rejected.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
FLAGS = ["--platform", "cpu", "--dtype", "float32", "--skip-tokenizer-init", "--max-model-len", "256",
         "--block-size", "4", "--speculative-config", json.dumps(NGRAM)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_model(tmp_path_factory.mktemp("spec-served"), "llama", FLAGS, NUM_NEW_TOKENS) as served:
        yield served


def test_concurrent_and_streamed_completions_match_transformers(served):
    server, prompts, expected = served
    assert concurrent_greedy_completions(server, prompts, NUM_NEW_TOKENS) == expected
    for i in (0, 3):
        assert streamed_greedy_completion(server, prompts[i], NUM_NEW_TOKENS) == expected[i]
    accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total", engine="0")
    assert 0 < accepted <= server.metric("vllm:spec_decode_num_draft_tokens_total", engine="0"), server.metrics()


def test_stop_token_inside_a_run_of_drafts(served):
    server, prompts, expected = served
    client = server.client()
    model = client.models.list().data[0].id
    for i, tokens in enumerate(expected):
        stop = tokens[6]
        ids, reason = greedy_completion(client, model, prompts[i], NUM_NEW_TOKENS, stop_token_ids=[stop])
        assert ids == tokens[: tokens.index(stop) + 1] and reason == "stop", i
