"""Concurrency limit, CORS, a server-wide default (--return-tokens-as-token-ids), and what happens when the engine
process dies (a server of its own)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from support.remote_server import SERVER_FLAGS, RemoteServer, wait_for

ORIGIN = "http://allowed.example"
LONG = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_limits") / "server.log"
    flags = SERVER_FLAGS + ["--max-concurrent-requests", "2", "--allowed-origins", ORIGIN, "--max-model-len", "512",
                            "--return-tokens-as-token-ids"]
    srv = RemoteServer(tiny_llama, flags, log, env={"RUNTIME_ENGINE_DEATH_GRACE_S": "2"}).wait_ready()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log()


def test_cors(server):
    preflight = httpx.options(
        server.url + "/v1/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"}).headers


def test_concurrency_limit(server):
    async def burst():
        body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))
        return [r.status_code for r in responses], responses

    statuses, responses = asyncio.run(burst())
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
    assert all(r.json()["error"]["code"] == "overloaded" for r in responses if r.status_code == 503)
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0)
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert server.metric("runtime:request_errors_total", status="503", type="server_error") == statuses.count(503)


def test_return_tokens_as_token_ids_flag_is_the_default_a_request_can_override(server):
    """vLLM's --return-tokens-as-token-ids: logprobs name tokens as token_id:N unless the request says false."""
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
    out = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{i}" for i in out["token_ids"]]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "ignore_eos": True}
    content = httpx.post(server.url + "/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(c["token"].startswith("token_id:") for c in content)
    own = httpx.post(server.url + "/v1/completions", json=body | {"return_tokens_as_token_ids": False}).json()
    tokens = own["choices"][0]["logprobs"]["tokens"]
    assert "".join(tokens) == own["choices"][0]["text"] and not any(t.startswith("token_id:") for t in tokens)


def test_engine_death_fails_requests_and_exits(server):
    """Run last: it kills this module's server."""
    results: list[tuple[list[str], float]] = []

    def stream_until_end():
        with httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=60) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    started.set()
            results.append((events, time.monotonic()))

    started = threading.Event()
    thread = threading.Thread(target=stream_until_end)
    thread.start()
    assert started.wait(30)
    killed_at = time.monotonic()
    os.kill(server.engine_pid, signal.SIGKILL)
    thread.join(30)
    assert results, "the in-flight stream did not end"
    events, ended_at = results[0]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "engine" in events[-2]
    assert ended_at - killed_at < 5.0  # failed fast, not at the end of 240 tokens
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    assert server.proc.wait(30) != 0
    assert "the engine process exited unexpectedly" in server.log()
