"""Checks on a request body before FastAPI parses it into a request model.

A body with a media type other than JSON is a 415 (FastAPI would hand it on as
bytes, refused as "Input should be a valid dictionary"). A string anywhere in
the body holding a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape, which
Python's JSON parser accepts) is a 400 naming the request field that holds it:
such a string cannot be encoded as UTF-8, so the tokenizer, the engine's wire
format or the response encoder would fail on it later (a 500 for ``bad_words``).
"""

from __future__ import annotations

import email.message
import json
import re
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

from runtime.entrypoints.openai.errors import OpenAIError

# A JSON escape of a surrogate (pairs included: they are checked after parsing) or the UTF-8-style bytes of one,
# which Python's JSON parser lets through: bodies without either (nearly all) are not walked.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (``application/json`` or ``application/*+json``); none does too,
    as FastAPI parses a body without one as JSON."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_path(value: Any) -> tuple | None:
    """The path (keys and indices) to the first string or key in parsed JSON ``value`` that is not valid Unicode;
    None if all are."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not _is_valid_unicode(node):
                return path
        elif isinstance(node, dict):
            for key in node:
                if not _is_valid_unicode(key):
                    return (*path, key)
            stack.extend((child, (*path, key)) for key, child in reversed(node.items()) if isinstance(child, (str, dict, list)))
        elif isinstance(node, list):
            stack.extend((node[i], (*path, i)) for i in range(len(node) - 1, -1, -1) if isinstance(node[i], (str, dict, list)))
    return None


def check_body(content_type: str | None, body: bytes) -> None:
    """OpenAIError (415 or 400) for a body this server must not parse as a request."""
    if not body:
        return
    if not is_json_media_type(content_type):
        raise OpenAIError(
            f"Content-Type must be application/json, got {content_type!r}; send the request as JSON",
            415, code="unsupported_media_type",
        )
    if _MAYBE_SURROGATE.search(body) is None:
        return
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return  # FastAPI reports it
    path = lone_surrogate_path(parsed)
    if not path:
        return  # valid, or a body that is itself one string: the request validation refuses it
    where = ".".join(str(part) for part in path).encode("utf-8", "backslashreplace").decode()
    param = str(path[0]).encode("utf-8", "backslashreplace").decode()
    raise OpenAIError(f"{param} is not valid Unicode: {where} holds a lone surrogate (an unpaired \\ud800-\\udfff "
                      "escape); strings must be valid UTF-16 in JSON", 400, param=param)


class CheckedBodyRoute(APIRoute):
    """An APIRoute whose request body passes ``check_body`` before FastAPI parses it."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked_handler(request: Request):
            if request.method in ("POST", "PUT", "PATCH"):
                check_body(request.headers.get("content-type"), await request.body())  # cached for FastAPI
            return await handler(request)

        return checked_handler
