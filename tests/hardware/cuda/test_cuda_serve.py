"""On a GPU: `runtime serve --platform cuda` end to end, with the official openai client.

The server runs a tiny untokenized float32 model with CUDA graphs and async scheduling;
token-id prompts go in, and the greedy tokens that come back must be transformers'
tokens, also when several requests run at once and when streamed.
"""

from __future__ import annotations

import pytest

from support.token_id_completions import (
    concurrent_greedy_completions,
    served_tiny_model,
    streamed_greedy_completion,
)

pytestmark = pytest.mark.gpu

NUM_NEW_TOKENS = 12
FLAGS = ["--platform", "cuda", "--dtype", "float32", "--skip-tokenizer-init", "--async-scheduling",
         "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "256", "--cuda-graph-sizes", "1", "2", "4", "8"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_model(tmp_path_factory.mktemp("served"), "llama", FLAGS, NUM_NEW_TOKENS) as served:
        yield served


def test_concurrent_completions_match_transformers(served):
    server, prompts, expected = served
    assert concurrent_greedy_completions(server, prompts, NUM_NEW_TOKENS) == expected


def test_streamed_completion_matches_transformers(served):
    server, prompts, expected = served
    assert streamed_greedy_completion(server, prompts[2], NUM_NEW_TOKENS) == expected[2]
    assert "captured 4 decode graphs" in server.log()  # --cuda-graph-sizes 1 2 4 8
