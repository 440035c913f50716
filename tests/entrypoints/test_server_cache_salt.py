"""``cache_salt`` in the request body (the official client's ``extra_body``) isolates prefix caches.

The usage block does not report cached tokens, so the prefix-cache hit counter of /metrics
tells whether a request reused blocks: it counts prompt tokens found in the cache.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from support.remote_server import SERVER_FLAGS, RemoteServer

MODEL = "tiny"
PROMPT = list(range(100, 140))  # 40 token ids: 2 full blocks of 16 are reusable
NUM_REUSABLE = 32
MESSAGES = [{"role": "user", "content": "Tell me about prefix caches."}]
HITS = "runtime:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-salt") / "server.log"
    srv = RemoteServer(tiny_llama, SERVER_FLAGS + ["--served-model-name", MODEL], log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def new_hits(server: RemoteServer, send) -> float:
    """Prompt tokens ``send()`` found in the prefix cache."""
    before = server.metric(HITS)
    send()
    return server.metric(HITS) - before


def complete(client, salt: str | None):
    body = {} if salt is None else {"cache_salt": salt}
    return lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0, extra_body=body)


def chat(client, salt: str):
    return lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0.0, extra_body={"cache_salt": salt}
    )


def test_completion_cache_salt_isolates_tenants(server):
    client = server.client()
    assert new_hits(server, complete(client, "tenant-a")) == 0
    assert new_hits(server, complete(client, "tenant-b")) == 0  # same prompt, other tenant
    assert new_hits(server, complete(client, None)) == 0  # no salt shares nothing with a salt
    assert new_hits(server, complete(client, "tenant-a")) == NUM_REUSABLE
    assert new_hits(server, complete(client, None)) == NUM_REUSABLE


def test_chat_cache_salt_isolates_tenants(server):
    client = server.client()
    assert new_hits(server, chat(client, "chat-a")) == 0
    assert new_hits(server, chat(client, "chat-b")) == 0
    assert new_hits(server, chat(client, "chat-a")) > 0


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("salt", ["", 5])
def test_bad_cache_salt_is_a_400_naming_it(server, path, salt):
    body = {"model": MODEL, "cache_salt": salt, "max_tokens": 2}
    body.update({"prompt": PROMPT} if path == "completions" else {"messages": MESSAGES})
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error", error


def test_official_client_sees_the_400(server):
    with pytest.raises(openai.BadRequestError, match="cache_salt must be None or a non-empty string"):
        server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"cache_salt": ""})
