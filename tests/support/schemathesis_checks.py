"""Schemathesis checks of the server fuzz test, loaded by ``st run`` through SCHEMATHESIS_HOOKS (a file path)."""

from __future__ import annotations

import schemathesis

ERROR_KEYS = {"message", "type", "param", "code"}


@schemathesis.check
def openai_error_shape(ctx, response, case):
    """Every 4xx and 5xx answer is ``{"error": {"message", "type", "param", "code"}}``, as OpenAI's."""
    if response.status_code < 400:
        return None
    body = response.json()
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not ERROR_KEYS <= set(error) or not error["message"]:
        raise AssertionError(f"HTTP {response.status_code} is not in OpenAI's error shape: {response.text[:300]}")
    return None
