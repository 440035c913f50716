"""The server's control routes (vLLM's): the profiler and, in development mode, sleep mode.

``POST /start_profile`` and ``POST /stop_profile`` run ``torch.profiler`` in the engine's workers; they are
refused (400) unless ``RUNTIME_TORCH_PROFILER_DIR`` (vLLM's ``VLLM_TORCH_PROFILER_DIR``) was set when the
server started. With ``RUNTIME_SERVER_DEV_MODE=1`` (vLLM's ``VLLM_SERVER_DEV_MODE``) the server also has
``POST /sleep?level=1|2``, ``POST /wake_up`` (``?tags=weights&tags=kv_cache``, default all),
``GET /is_sleeping`` (``{"is_sleeping": bool}``) and ``POST /reset_prefix_cache``; sleeping needs
``--enable-sleep-mode``. These paths are outside ``/v1``, so ``--api-key`` does not guard them (as in vLLM):
development mode is for trusted networks.
"""

from __future__ import annotations

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from runtime.engine.control import EngineControlError
from runtime.entrypoints.openai.errors import OpenAIError
from runtime.envs import env_flag

DEV_MODE_ENV = "RUNTIME_SERVER_DEV_MODE"


async def _control(call) -> object:
    """Await an AsyncLLM control call; the engine's refusal is a 400 naming why."""
    try:
        return await call
    except EngineControlError as exc:
        raise OpenAIError(str(exc), 400, code="engine_state") from None


def add_control_routes(app: FastAPI, engine) -> None:
    """The routes above over ``engine`` (an AsyncLLM)."""

    @app.post("/start_profile")
    async def start_profile():
        await _control(engine.start_profile())
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile():
        await _control(engine.stop_profile())
        return Response(status_code=200)

    if not env_flag(DEV_MODE_ENV, default=False):
        return

    @app.post("/sleep")
    async def sleep(level: int = 1):
        await _control(engine.sleep(level))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        await _control(engine.wake_up(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": await _control(engine.is_sleeping())})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if not await _control(engine.reset_prefix_cache()):
            raise OpenAIError("the prefix cache could not be reset: KV blocks are in use by running requests", 400,
                              code="engine_state")
        return Response(status_code=200)
