"""Errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with the right status.

ValueError (bad input, named by SamplingParams / InputProcessor) and pydantic
validation errors are 400; an unknown model 404; a dead engine 503. Every
error response is counted in the app's metrics.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.engine.core_client import EngineDeadError, RequestFailedError
from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from runtime.entrypoints.openai.protocol_base import OpenAIBaseModel
from runtime.entrypoints.openai.responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_PARAMS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {"logit_bias"}
_FIRST_WORD = re.compile(r"^([a-z_]+)\b")
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


class OpenAIError(Exception):
    """An error to answer with; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def param_of(message: str) -> str | None:
    """The request field a ValueError message starts with ("temperature must be ..."), if any."""
    match = _FIRST_WORD.match(message)
    if match and match.group(1) in _PARAMS:
        return match.group(1)
    return None


def from_exception(exc: BaseException) -> OpenAIError:
    """The OpenAIError that answers ``exc``."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return OpenAIError(str(exc), 400, param=getattr(exc, "param", None) or param_of(str(exc)))
    if isinstance(exc, RequestFailedError):  # the server's failure, not the request's: a client may retry it
        logger.warning("a request failed on the server's side: %s", exc)
        return OpenAIError(str(exc), 500, code="request_failed")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(f"the engine is not running: {exc}", 503, code="engine_dead")
    logger.error("internal error answering a request", exc_info=exc)
    return OpenAIError(f"internal server error: {type(exc).__name__}: {exc}", 500)


def error_response(request: Request | None, error: OpenAIError, headers: dict | None = None) -> JSONResponse:
    metrics = getattr(getattr(request, "app", None), "state", None)
    metrics = getattr(metrics, "metrics", None)
    if metrics is not None:
        metrics.record_error(error.status, error.type)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _most_specific(errors: list[dict]) -> dict:
    """Of the errors of a union's forms, the one that got furthest (the form the client meant)."""
    if not errors:
        return {"loc": (), "msg": "invalid request"}
    def progress(error: dict) -> tuple:
        loc = error.get("loc", ())
        is_right_type = not str(error.get("type", "")).endswith("_type")  # a value of the form's type, out of bounds
        return len(loc), is_right_type, [p for p in loc if isinstance(p, int)]

    return max(errors, key=progress)


def _model_names() -> set[str]:
    """Names of the request models: pydantic tags a union member that is a model with its class name."""
    names, todo = set(), [OpenAIBaseModel]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _is_union_tag(part, model_names: set[str]) -> bool:
    """pydantic's name of a union member in an error location ("list[constrained-int]", "str", "NamedToolChoice")."""
    return isinstance(part, str) and (any(c in part for c in "[]-") or part in _UNION_TAGS or part in model_names)


def _shown_input(error: dict) -> str:
    """", got VALUE" for an error about a scalar value (so the message names it), else ""."""
    value = error.get("input")
    if error.get("type") == "missing" or not isinstance(value, (str, int, float, bool, type(None))):
        return ""
    text = repr(value[:61]) if isinstance(value, str) else json.dumps(value)
    return f", got {text[:60]}..." if len(text) > 60 else f", got {text}"


def _body_message(error: dict) -> str:
    """The message of an error about the body as a whole (missing, or JSON that is not an object)."""
    if error.get("type") == "missing":
        return "the request body is missing; send a JSON object"
    if "input" in error and not isinstance(error["input"], dict):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean", int: "a number",
                float: "a number", bytes: "not JSON"}.get(type(error["input"]), type(error["input"]).__name__)
        return f"the request body must be a JSON object, got {kind}"
    return str(error.get("msg"))


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = _most_specific(list(exc.errors()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(request, OpenAIError(f"the request body is not valid JSON: {detail}", 400))
    model_names = _model_names()
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part, model_names)]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}{_shown_input(first)}" if param else _body_message(first)
    return error_response(request, OpenAIError(message, 400, param=param))


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
    error = OpenAIError(str(exc.detail), exc.status_code, code=code)
    return error_response(request, error, headers=getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for exc_type in (OpenAIError, ValueError, EngineDeadError, Exception):
        app.add_exception_handler(exc_type, lambda request, exc: error_response(request, from_exception(exc)))
