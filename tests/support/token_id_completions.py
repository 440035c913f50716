"""Greedy completions over the OpenAI API in token-ids-only mode (helpers for server tests).

With ``--skip-tokenizer-init`` the server spells each logprob token ``token_id:N``; these
helpers send token-id prompts with the official client and read the sampled ids back.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager


@contextmanager
def served_tiny_model(folder, arch: str, flags: list[str], num_new_tokens: int) -> Iterator[tuple]:
    """``runtime serve`` over a tiny untokenized ``arch`` model in ``folder``:
    yields (server, token-id prompts, transformers' greedy tokens for each prompt)."""
    from runtime.testing.models import build_untokenized_model
    from runtime.testing.reference import make_prompts, reference_outputs
    from support.remote_server import RemoteServer

    path = build_untokenized_model(arch, folder / "model")
    prompts = make_prompts()
    expected = [tokens for tokens, _ in reference_outputs(path, prompts, num_new_tokens)]
    server = RemoteServer(path, flags, folder / "server.log").wait_ready()
    try:
        yield server, prompts, expected
    finally:
        server.stop()


def token_ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def greedy_completion(client, model: str, prompt: list[int], max_tokens: int, **extra) -> tuple[list[int], str]:
    """(sampled ids, finish reason) of one non-streamed greedy completion."""
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=1, extra_body=extra or None
    )
    choice = response.choices[0]
    return token_ids(choice.logprobs.tokens), choice.finish_reason


def concurrent_greedy_completions(server, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """All prompts at once, one thread each; every completion must end by length."""
    client = server.client()
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: greedy_completion(client, model, p, max_tokens), prompts))
    assert all(reason == "length" for _, reason in results), results
    return [ids for ids, _ in results]


def streamed_greedy_completion(server, prompt: list[int], max_tokens: int) -> list[int]:
    client = server.client()
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=1, stream=True
    )
    return token_ids([t for chunk in stream if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens])
