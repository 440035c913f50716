"""``runtime proxy --routing``: which prefill or decode instance a request goes to. By load, the
instance with the fewest requests this proxy has in flight to it (ties in turn); in turn, each
instance after the other whatever its load. A request gives its instance back when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from support.remote_server import free_port, wait_for

from runtime.cli.proxy import ROUTINGS as CLI_ROUTINGS
from runtime.entrypoints.proxy import ROUTINGS, Backends, RelayResponse, build_app

P, D = ["http://p0", "http://p1/"], ["http://d0", "http://d1", "http://d2"]


def test_least_requests_takes_the_least_loaded_and_turns_on_ties():
    backends = Backends(P, D)
    assert backends.routing == "least_requests"
    first = [backends.take("decode") for _ in range(3)]
    assert sorted(first) == ["http://d0", "http://d1", "http://d2"]  # one each before any gets a second
    backends.give_back("decode", "http://d1")
    assert backends.take("decode") == "http://d1"  # the only one with nothing in flight
    assert backends.in_flight["decode"] == {"http://d0": 1, "http://d1": 1, "http://d2": 1}
    for url in ("http://d0", "http://d1", "http://d2"):
        backends.give_back("decode", url)
    assert {backends.take("prefill"), backends.take("prefill")} == {"http://p0", "http://p1"}  # trailing "/" dropped


def test_round_robin_ignores_load():
    backends = Backends(P, D, "round_robin")
    assert [backends.take("decode") for _ in range(4)] == ["http://d0", "http://d1", "http://d2", "http://d0"]
    assert backends.in_flight["decode"]["http://d0"] == 2


def test_bad_routing_and_empty_pools_are_errors():
    assert CLI_ROUTINGS == ROUTINGS
    with pytest.raises(ValueError, match=r"routing 'random' is not supported; choose one of: least_requests, round_robin"):
        Backends(P, D, "random")
    with pytest.raises(ValueError, match="at least one --prefill URL and one --decode URL"):
        Backends([], D)


def instance_app() -> FastAPI:
    """A stand-in prefill/decode server: completions answered whole, or streamed as two events."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        if (await request.json()).get("stream"):
            async def events():
                yield b'data: {"choices": [{"text": "a"}]}\n\n'
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"text": "a"}], "kv_transfer_params": {"remote_block_ids": [0]}}

    return app


@contextlib.contextmanager
def serving(apps: list[FastAPI]):
    """Each app on its own loopback port (uvicorn in a thread); yields their base URLs."""
    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")) for app in apps]
    threads = [threading.Thread(target=server.run, daemon=True) for server in servers]
    for thread in threads:
        thread.start()
    try:
        assert wait_for(lambda: all(server.started for server in servers), 20)
        yield [f"http://127.0.0.1:{server.config.port}" for server in servers]
    finally:
        for server, thread in zip(servers, threads):
            server.should_exit = True
            thread.join(10)


def test_requests_give_their_instances_back():
    """Through the proxy app over real HTTP, whole and streamed answers: nothing stays in flight."""
    with serving([instance_app() for _ in range(3)]) as (prefill, *decode):
        backends = Backends([prefill], decode)
        with serving([build_app(backends)]) as (proxy,), httpx.Client(base_url=proxy, timeout=10) as client:
            for stream in (False, True, False, True):
                response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream})
                assert response.status_code == 200 and '"a"' in response.text
        assert backends.in_flight == {"prefill": {prefill: 0}, "decode": dict.fromkeys(decode, 0)}


def test_bad_bodies_and_dead_instances_are_openai_errors():
    """Not JSON, or not an object: 400; an instance that does not answer: 502. OpenAI's error shape."""
    backends = Backends([f"http://127.0.0.1:{free_port()}"], [f"http://127.0.0.1:{free_port()}"])  # nobody listens
    with serving([build_app(backends)]) as (proxy,), httpx.Client(base_url=proxy, timeout=20) as client:
        for content, status, message in ((b"{not json", 400, "not valid JSON"), (b"[1, 2]", 400, "must be a JSON object"),
                                         (b'{"prompt": "x"}', 502, "did not answer (ConnectError")):
            response = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert message in error["message"] and error["type"] in ("invalid_request_error", "server_error")
    assert backends.in_flight == {"prefill": dict.fromkeys(backends.prefill, 0), "decode": dict.fromkeys(backends.decode, 0)}


@pytest.mark.parametrize("client", ["reads it all", "leaves before the first byte"])
def test_a_relayed_stream_closes_upstream_and_gives_back_once(client):
    """Driven as ASGI: whether the client reads the stream or is gone before the relay starts (the
    body's generator then never runs), the decode stream is closed and the instance given back once."""
    closed, released, sent = [], [], []

    class Upstream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b"data: [DONE]\n\n"

        async def aclose(self):
            closed.append(True)

    async def receive():
        if client == "reads it all":
            await asyncio.Event().wait()  # never disconnects
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0)  # a real send yields to the loop (where a cancellation lands)
        sent.append(message["type"])

    relay = RelayResponse(httpx.Response(200, stream=Upstream()), lambda: released.append(True))
    asyncio.run(relay({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send))
    assert closed and released == [True]
    if client == "reads it all":
        assert sent[:2] == ["http.response.start", "http.response.body"]
    else:
        assert sent == []  # nothing was sent: the relay never started


def test_more_concurrent_streams_than_a_default_connection_pool():
    """150 streams at once through the proxy all reach the decode instance before any ends: the proxy's HTTP client
    caps no connections (the instances refuse load themselves, with a 503). It capped them at httpx's default 100,
    and the rest waited for a stream to end."""
    num_streams, opened, release = 150, [], threading.Event()
    held = FastAPI()

    @held.post("/v1/completions")
    async def completions(request: Request):
        if not (await request.json()).get("stream"):
            return {"choices": [{"text": "a"}], "kv_transfer_params": {"remote_block_ids": [0]}}
        opened.append(True)

        async def events():
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            while not release.is_set():
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def streams(proxy):
        async with httpx.AsyncClient(base_url=proxy, timeout=60, limits=httpx.Limits(max_connections=None)) as client:
            body = {"prompt": "x", "max_tokens": 2, "stream": True}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(num_streams)]
            await asyncio.to_thread(wait_for, lambda: len(opened) >= num_streams, 30)
            open_at_once = len(opened)
            release.set()
            responses = await asyncio.gather(*tasks)
        return open_at_once, [r.status_code for r in responses]

    with serving([instance_app(), held]) as (prefill, decode):
        backends = Backends([prefill], [decode])
        with serving([build_app(backends)]) as (proxy,):
            open_at_once, statuses = asyncio.run(streams(proxy))
    assert open_at_once == num_streams, f"only {open_at_once} of {num_streams} streams reached the decode instance at once"
    assert statuses == [200] * num_streams
    assert backends.in_flight == {"prefill": {prefill: 0}, "decode": {decode: 0}}
