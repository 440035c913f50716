"""``runtime proxy`` when an instance fails a request: a prefill instance that never answers is a 504
after ``--prefill-timeout`` (OpenAI's error shape, the instance given back), and a request the decode
instance refuses, or cannot take, after its prefill ran has the prefill instance's lease released at
once (``POST /kv_transfer/release``) rather than held until it expires."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from support.remote_server import free_port
from test_proxy_routing import serving

from runtime.entrypoints.proxy import Backends, build_app

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "cmpl-1", "remote_block_ids": [0, 1],
          "remote_host": "127.0.0.1", "remote_port": 14579, "num_remote_tokens": 20, "block_size": 16}


def prefill_app(released: list, answer_after_s: float = 0.0) -> FastAPI:
    """A stand-in prefill instance: leases blocks (PARAMS) and records the releases it is asked for."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        await request.json()
        await asyncio.sleep(answer_after_s)
        return {"choices": [{"text": "a"}], "kv_transfer_params": PARAMS}

    @app.post("/kv_transfer/release")
    async def release(request: Request):
        released.append(await request.json())
        return {"released": PARAMS["remote_request_id"]}

    return app


def refusing_decode_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        assert body["kv_transfer_params"] == PARAMS
        error = {"message": "stream_options is only allowed with stream: true", "type": "invalid_request_error",
                 "param": "stream_options", "code": None}
        return JSONResponse({"error": error}, status_code=400)

    return app


def test_a_prefill_instance_that_never_answers_is_a_504():
    """The prefill instance takes the request and sleeps: the client got no answer, ever (no read timeout)."""
    with serving([prefill_app([], answer_after_s=3600), refusing_decode_app()]) as (prefill, decode):
        backends = Backends([prefill], [decode])
        with serving([build_app(backends, prefill_timeout=1.0)]) as (proxy,):
            client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=30)
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model="m", prompt="x", max_tokens=2)
            assert time.monotonic() - started < 10
    assert info.value.status_code == 504
    error = info.value.body
    assert error["type"] == "server_error" and "did not answer within 1 s (--prefill-timeout)" in error["message"], error
    assert backends.in_flight == {"prefill": {prefill: 0}, "decode": {decode: 0}}


def test_a_bad_prefill_timeout_is_refused():
    with pytest.raises(ValueError, match="--prefill-timeout must be > 0 seconds, got 0"):
        build_app(Backends(["http://p"], ["http://d"]), prefill_timeout=0)


def test_a_request_the_decode_instance_refuses_releases_the_lease():
    """The decode instance answers 400 after the prefill ran: the client gets that 400 and the prefill instance is
    asked to free the blocks it leased (before, they stayed held until the lease expired)."""
    released = []
    with serving([prefill_app(released), refusing_decode_app()]) as (prefill, decode):
        backends = Backends([prefill], [decode])
        with serving([build_app(backends)]) as (proxy,):
            client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=30)
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model="m", prompt="x", max_tokens=2, stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"
    assert released == [{"kv_transfer_params": PARAMS}]
    assert backends.in_flight == {"prefill": {prefill: 0}, "decode": {decode: 0}}


def test_a_decode_instance_that_is_down_releases_the_lease():
    released = []
    with serving([prefill_app(released)]) as (prefill,):
        backends = Backends([prefill], [f"http://127.0.0.1:{free_port()}"])  # nobody listens
        with serving([build_app(backends)]) as (proxy,):
            response = httpx.post(proxy + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert response.status_code == 502 and "ConnectError" in response.json()["error"]["message"]
    assert released == [{"kv_transfer_params": PARAMS}]


def test_a_decode_stream_that_breaks_ends_with_an_error_event():
    """The decode instance goes away mid-stream: the client's stream ends with an error event in OpenAI's shape
    (what a server sends when a stream fails after its status line), which the openai client raises; before, the
    proxy's connection broke off mid-body."""
    from fastapi.responses import StreamingResponse

    broken = FastAPI()

    @broken.post("/v1/completions")
    async def completions(request: Request):
        await request.json()

        async def events():
            yield b'data: {"id": "c", "object": "text_completion", "created": 0, "model": "m", ' \
                  b'"choices": [{"index": 0, "text": "a", "finish_reason": null, "logprobs": null}]}\n\n'
            raise RuntimeError("the decode instance went away")

        return StreamingResponse(events(), media_type="text/event-stream")

    with serving([prefill_app([]), broken]) as (prefill, decode):
        backends = Backends([prefill], [decode])
        with serving([build_app(backends)]) as (proxy,):
            client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=30)
            texts = []
            with pytest.raises(openai.APIError, match="the decode instance's stream broke off"):
                for chunk in client.completions.create(model="m", prompt="x", max_tokens=2, stream=True):
                    texts.append(chunk.choices[0].text)
    assert texts == ["a"]
    assert backends.in_flight == {"prefill": {prefill: 0}, "decode": {decode: 0}}


@pytest.mark.parametrize("body", [b"<html>not json</html>", b"[1, 2]"])
def test_a_prefill_answer_that_is_not_a_json_object_is_a_502(body):
    """A 200 from the prefill instance whose body is not a JSON object (not a runtime instance, or a broken one) is
    a 502 naming what came back; it was a 500."""
    from fastapi.responses import Response as PlainResponse

    odd = FastAPI()

    @odd.post("/v1/completions")
    async def completions(request: Request):
        await request.json()
        return PlainResponse(body, media_type="text/html")

    with serving([odd, refusing_decode_app()]) as (prefill, decode):
        backends = Backends([prefill], [decode])
        with serving([build_app(backends)]) as (proxy,):
            response = httpx.post(proxy + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert response.status_code == 502, response.text
    assert "not a JSON object" in response.json()["error"]["message"]
    assert backends.in_flight == {"prefill": {prefill: 0}, "decode": {decode: 0}}


def test_listing_models_with_the_decode_instance_down_is_a_502():
    backends = Backends([f"http://127.0.0.1:{free_port()}"], [f"http://127.0.0.1:{free_port()}"])  # nobody listens
    with serving([build_app(backends)]) as (proxy,):
        response = httpx.get(proxy + "/v1/models", timeout=30)
    assert response.status_code == 502 and "did not answer" in response.json()["error"]["message"]
