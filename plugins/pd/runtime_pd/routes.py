"""``POST /kv_transfer/release`` on a prefill instance: free the blocks leased for a request that no
decode instance will pull (``runtime proxy`` asks when the decode instance refused the request or
could not be reached), rather than hold them until the lease expires.

The body is ``{"kv_transfer_params": ...}``, the prefill response's; the release is the "pulled"
notice a decode instance sends, delivered to the control port the parameters name.
"""

from __future__ import annotations

import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from runtime_pd.puller import send_pulled
from runtime_pd.settings import malformed_reason

RELEASE_PATH = "/kv_transfer/release"


def add_release_route(app: FastAPI) -> None:
    context = zmq.Context.instance()

    @app.post(RELEASE_PATH)
    async def release(request: Request):
        try:
            body = await request.json()
        except ValueError:  # not JSON, or not UTF-8
            body = None
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict):
            return _error("the body must be {\"kv_transfer_params\": {...}}, the prefill response's kv_transfer_params")
        bad = malformed_reason(params)
        if bad is not None:
            return _error(bad)
        send_pulled(context, params)
        return {"released": params["remote_request_id"]}


def _error(message: str) -> JSONResponse:
    from runtime.entrypoints.openai.errors import OpenAIError, error_response

    return error_response(None, OpenAIError(message, 400, param="kv_transfer_params"))
