"""``runtime proxy``: an OpenAI-compatible front for prefill/decode disaggregation.

Each completion or chat request goes to a prefill instance first, as it is but with
``max_tokens=1``, no streaming and ``kv_transfer_params: {"do_remote_decode": true}``; the
prefill response's ``kv_transfer_params`` (where its KV blocks wait) are added to the original
request, which goes to a decode instance and is answered from there, streamed or not. Instances
are picked by load (the fewest requests in flight from this proxy) or in turn (``--routing``).
Requests that cannot be split (``n > 1``, several prompts) go to a decode instance alone, which
then computes the prompt itself.

A prefill instance that does not answer within ``--prefill-timeout`` seconds fails the request
with a 504. When the decode instance refuses a request (any status but 200) or cannot be
reached after its prefill ran, the proxy asks the prefill instance to free the leased blocks
(``POST /kv_transfer/release``, which a KV-transfer plugin serves) rather than leave them held
until the lease expires.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
PREFILL_TIMEOUT_S = 300.0  # --prefill-timeout: the longest wait for a prefill instance's answer
RELEASE_TIMEOUT_S = 5.0
RELEASE_PATH = "/kv_transfer/release"  # a KV-transfer plugin's route on the prefill instance
_FORWARDED_HEADERS = ("authorization", "x-request-id")


ROUTINGS = ("least_requests", "round_robin")


class Backends:
    """The prefill and decode instances' base URLs, and the pick of one per request.

    ``least_requests`` (the default) takes the instance of a pool with the fewest requests this
    proxy has in flight to it (ties in turn); ``round_robin`` takes them in turn whatever their load.
    """

    def __init__(self, prefill: list[str], decode: list[str], routing: str = "least_requests"):
        if not prefill or not decode:
            raise ValueError("runtime proxy needs at least one --prefill URL and one --decode URL")
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r} is not supported; choose one of: {', '.join(ROUTINGS)}")
        self.routing = routing
        self.prefill = [url.rstrip("/") for url in prefill]
        self.decode = [url.rstrip("/") for url in decode]
        self.in_flight = {"prefill": dict.fromkeys(self.prefill, 0), "decode": dict.fromkeys(self.decode, 0)}
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}

    def take(self, pool: str) -> str:
        """An instance of ``pool`` ("prefill" or "decode") for one request; :meth:`give_back` it when done."""
        loads = self.in_flight[pool]
        urls = list(loads)
        first = next(self._turn[pool]) % len(urls)
        order = urls[first:] + urls[:first]  # ties (and round_robin) go in turn
        url = order[0] if self.routing == "round_robin" else min(order, key=loads.__getitem__)
        loads[url] += 1
        return url

    def give_back(self, pool: str, url: str) -> None:
        self.in_flight[pool][url] -= 1


class RelayResponse(StreamingResponse):
    """A decode instance's stream relayed to the client. Once the response ends, however it ends
    (read to the end, the client gone midway, or gone before the body's first byte, when the
    relay never starts), the upstream stream is closed (which aborts the decode request) and
    ``release`` (giving the instance back) runs, once."""

    def __init__(self, upstream: httpx.Response, release):
        super().__init__(self.relay(upstream), media_type="text/event-stream")
        self.upstream = upstream
        self.release = release

    @staticmethod
    async def relay(upstream: httpx.Response):
        """The upstream's bytes; if it breaks off, a last event with the error in OpenAI's shape (as a
        server reports a stream that fails after its status line), rather than a cut connection."""
        ends_event = True  # whether the bytes so far end on an event's boundary
        try:
            async for chunk in upstream.aiter_raw():
                ends_event = chunk.endswith(b"\n\n")
                yield chunk
        except httpx.HTTPError as exc:
            logger.warning("a decode instance's stream broke off: %r", exc)
            from runtime.entrypoints.openai.errors import OpenAIError

            body = OpenAIError(f"the decode instance's stream broke off ({type(exc).__name__}: {exc})", 502).body()
            yield (b"" if ends_event else b"\n\n") + b"data: " + json.dumps(body).encode() + b"\n\n"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # runs even when the request's task is being cancelled
                await self.upstream.aclose()
            self.release()


def prefill_body(body: dict) -> dict:
    """The prefill instance's share of a request: its prompt, one token, KV kept for a remote decode."""
    drop = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs", "echo")
    out = {k: v for k, v in body.items() if k not in drop}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def can_split(body: dict) -> bool:
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return body.get("n", 1) in (1, None) and not (several and len(prompt) > 1)


def error(status: int, message: str) -> JSONResponse:
    """An answer in OpenAI's error shape."""
    from runtime.entrypoints.openai.errors import OpenAIError

    return JSONResponse(OpenAIError(message, status).body(), status_code=status)


def build_app(backends: Backends, prefill_timeout: float = PREFILL_TIMEOUT_S) -> FastAPI:
    if not prefill_timeout > 0:
        raise ValueError(f"--prefill-timeout must be > 0 seconds, got {prefill_timeout}")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if app.state.client is not None:
            await app.state.client.aclose()

    app = FastAPI(title="runtime proxy", lifespan=lifespan)
    timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    prefill_timeouts = httpx.Timeout(prefill_timeout, connect=CONNECT_TIMEOUT_S)
    app.state.client = None

    def client() -> httpx.AsyncClient:
        if app.state.client is None:
            # No cap on connections (httpx's default of 100 queued every stream past the 100th until one ended):
            # the instances refuse what they cannot take (--max-concurrent-requests: a 503, relayed).
            app.state.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        return app.state.client

    async def route(request: Request, path: str):
        try:
            body = await request.json()
        except ValueError:  # not JSON, or not UTF-8
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, f"the request body must be a JSON object, got {type(body).__name__}")
        try:
            return await forward(request, path, body)
        except httpx.HTTPError as exc:  # an instance that is down or went away mid-answer
            logger.warning("proxying %s failed: %r", path, exc)
            return error(502, f"an instance behind the proxy did not answer ({type(exc).__name__}: {exc})")

    async def forward(request: Request, path: str, body: dict):
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        lease = None  # (prefill instance, its kv_transfer_params): blocks it holds for this request
        if can_split(body) and body.get("kv_transfer_params") is None:
            url = backends.take("prefill")
            try:
                prefill = await client().post(url + path, json=prefill_body(body), headers=headers, timeout=prefill_timeouts)
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ConnectTimeout):
                    raise
                logger.warning("the prefill instance %s did not answer %s within %g s", url, path, prefill_timeout)
                return error(504, f"the prefill instance did not answer within {prefill_timeout:g} s (--prefill-timeout)")
            finally:
                backends.give_back("prefill", url)
            if prefill.status_code != 200:
                return Response(prefill.content, prefill.status_code, media_type="application/json")
            try:
                answer = prefill.json()
            except ValueError:  # not JSON: not a runtime instance, or a broken one
                answer = None
            if not isinstance(answer, dict):
                return error(502, f"the prefill instance answered 200 with a body that is not a JSON object: "
                                  f"{prefill.text[:200]!r}")
            params = answer.get("kv_transfer_params")
            lease = (url, params) if isinstance(params, dict) and params.get("remote_block_ids") else None
            body = {**body, "kv_transfer_params": params}
        url = backends.take("decode")
        relaying = False  # from here the stream's end gives the instance back
        try:
            upstream = client().build_request("POST", url + path, json=body, headers=headers)
            try:
                response = await client().send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):  # the request never reached the decode instance
                await release(lease)
                raise
            if not body.get("stream") or response.status_code != 200:
                content = await response.aread()
                await response.aclose()
                if response.status_code != 200:
                    await release(lease)
                return Response(content, response.status_code, media_type=response.headers.get("content-type"))
            relaying = True
        finally:
            if not relaying:
                backends.give_back("decode", url)

        return RelayResponse(response, lambda: backends.give_back("decode", url))

    async def release(lease) -> None:
        """Ask the prefill instance to free the blocks it leased for a request the decode instance
        will not pull (best effort: unanswered, the lease expires as it would have)."""
        if lease is None:
            return
        url, params = lease
        try:
            answer = await client().post(url + RELEASE_PATH, json={"kv_transfer_params": params}, timeout=RELEASE_TIMEOUT_S)
            if answer.status_code != 200:
                logger.warning("the prefill instance %s did not release a lease: %s %s", url, answer.status_code, answer.text[:200])
        except httpx.HTTPError as exc:
            logger.warning("could not ask the prefill instance %s to release a lease: %r", url, exc)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        try:
            response = await client().get(backends.decode[0] + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            logger.warning("listing the models failed: %r", exc)
            return error(502, f"the decode instance did not answer ({type(exc).__name__}: {exc})")
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        down = []
        for url in backends.prefill + backends.decode:
            try:
                if (await client().get(url + "/health", timeout=5.0)).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        if down:
            return JSONResponse({"unhealthy": down}, status_code=503)
        return Response(status_code=200)

    return app


def run_proxy(prefill: list[str], decode: list[str], host: str, port: int, routing: str = "least_requests",
              prefill_timeout: float = PREFILL_TIMEOUT_S) -> None:
    import uvicorn

    app = build_app(Backends(prefill, decode, routing), prefill_timeout)
    logger.info("proxy on %s:%d (%s): prefill %s, decode %s", host, port, routing, ", ".join(prefill), ", ".join(decode))
    uvicorn.run(app, host=host, port=port, log_level="warning")
