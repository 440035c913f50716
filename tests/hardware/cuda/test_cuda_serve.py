"""On a GPU: `runtime serve --platform cuda` end to end, with the official openai client.

The server runs a tiny untokenized float32 model with CUDA graphs and async scheduling;
token-id prompts go in, and the greedy tokens that come back (as ``token_id:N`` logprob
entries, the token-ids-only mode's spelling) must be transformers' tokens, also when
several requests run at once and when streamed.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuda_tiny import build_untokenized_model, make_prompts, reference_outputs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "entrypoints"))
from remote_server import RemoteServer  # noqa: E402

pytestmark = pytest.mark.gpu

NUM_NEW_TOKENS = 12
FLAGS = ["--platform", "cuda", "--dtype", "float32", "--skip-tokenizer-init", "--async-scheduling",
         "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "256", "--cuda-graph-sizes", "1", "2", "4", "8"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    path = build_untokenized_model("llama", folder / "model")
    prompts = make_prompts()
    expected = [tokens for tokens, _ in reference_outputs(path, prompts, NUM_NEW_TOKENS)]
    server = RemoteServer(path, FLAGS, folder / "server.log").wait_ready()
    yield server, prompts, expected
    server.stop()


def token_ids(logprob_tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in logprob_tokens), logprob_tokens
    return [int(t.removeprefix("token_id:")) for t in logprob_tokens]


def test_concurrent_completions_match_transformers(served):
    server, prompts, expected = served
    client = server.client()
    model = client.models.list().data[0].id

    def complete(prompt: list[int]) -> list[int]:
        response = client.completions.create(
            model=model, prompt=prompt, max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=1
        )
        choice = response.choices[0]
        assert choice.finish_reason == "length" and response.usage.completion_tokens == NUM_NEW_TOKENS
        return token_ids(choice.logprobs.tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(complete, prompts))
    assert got == expected


def test_streamed_completion_matches_transformers(served):
    server, prompts, expected = served
    client = server.client()
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt=prompts[2], max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=1, stream=True
    )
    tokens: list[str] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
    assert token_ids(tokens) == expected[2]
    assert "captured 4 decode graphs" in server.log()  # --cuda-graph-sizes 1 2 4 8
