"""ASGI middlewares of the API server: HTTP metrics, body size limit, API key, concurrency limit.

Plain ASGI (not BaseHTTPMiddleware) so streaming responses pass through
untouched and the concurrency slot is held until a stream ends.
"""

from __future__ import annotations

import json
import secrets

from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.entrypoints.openai.errors import OpenAIError
from runtime.metrics import EngineMetrics


async def send_error(send, metrics: EngineMetrics | None, error: OpenAIError, headers: list | None = None) -> None:
    body = json.dumps(error.body()).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": raw_headers + (headers or [])})
    await send({"type": "http.response.body", "body": body})
    if metrics is not None:
        metrics.record_error(error.status, error.type)


def _is_api_path(scope) -> bool:
    return scope["type"] == "http" and scope["path"].startswith("/v1/")


class HTTPMetricsMiddleware:
    """Count every response by path (known routes only, else "other") and status."""

    def __init__(self, app, metrics: EngineMetrics, known_paths: set[str]):
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope["path"] if scope["path"] in self.known_paths else "other"
            self.metrics.record_http(path, status["code"])


class _BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read; FastAPI passes HTTPExceptions on to the error handlers."""

    def __init__(self, message: str):
        super().__init__(status_code=413, detail=message)


class BodySizeLimitMiddleware:
    """413 for a request body over ``max_bytes`` (by Content-Length, or counted as it arrives)."""

    def __init__(self, app, metrics: EngineMetrics, max_bytes: int):
        self.app = app
        self.metrics = metrics
        self.max_bytes = max_bytes

    def _error(self, size: str) -> OpenAIError:
        message = f"request body of {size} bytes is larger than the limit of {self.max_bytes} bytes"
        return OpenAIError(message, 413, code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_error(send, self.metrics, self._error(length.decode()))
        received = 0
        started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self._error(f"more than {self.max_bytes}").message)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_error(send, self.metrics, self._error(f"more than {self.max_bytes}"))


class APIKeyMiddleware:
    """401 for a /v1/ request without ``Authorization: Bearer <api key>``."""

    def __init__(self, app, metrics: EngineMetrics, api_key: str):
        self.app = app
        self.metrics = metrics
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if _is_api_path(scope) and scope.get("method") != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("Incorrect or missing API key; send 'Authorization: Bearer <key>'", 401, code="invalid_api_key")
                return await send_error(send, self.metrics, error, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class ConcurrencyLimitMiddleware:
    """503 for a POST to /v1/ while ``max_requests`` are already in flight (streams included)."""

    def __init__(self, app, metrics: EngineMetrics, max_requests: int):
        self.app = app
        self.metrics = metrics
        self.max_requests = max_requests
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if not (_is_api_path(scope) and scope.get("method") == "POST"):
            return await self.app(scope, receive, send)
        if self.in_flight >= self.max_requests:
            error = OpenAIError(
                f"the server is at its limit of {self.max_requests} concurrent requests; retry later", 503,
                code="overloaded",
            )
            return await send_error(send, self.metrics, error, [(b"retry-after", b"1")])
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
