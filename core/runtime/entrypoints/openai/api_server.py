"""The OpenAI-compatible HTTP server: FastAPI app over an AsyncLLM, run by uvicorn.

``run_server`` validates the engine arguments in this process (an unknown
plugin name or a bad model path fails here), spawns the engine process and
waits for it to be ready, then serves. If the engine dies, in-flight requests
fail at once, /health answers 503, and the server exits non-zero after a
short grace period (``RUNTIME_ENGINE_DEATH_GRACE_S``, default 3 s).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from runtime.config import EngineArgs, EngineConfig
from runtime.engine.core_client import EngineStartupError
from runtime.entrypoints.openai import middleware
from runtime.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from runtime.entrypoints.openai.responses import ModelCard, ModelList
from runtime.entrypoints.openai.serving_chat import OpenAIServingChat
from runtime.entrypoints.openai.serving_completion import OpenAIServingCompletion
from runtime.entrypoints.openai.serving_engine import ServingContext
from runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

logger = logging.getLogger("runtime.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
_DEATH_GRACE_ENV = "RUNTIME_ENGINE_DEATH_GRACE_S"
_READY_TIMEOUT_ENV = "RUNTIME_ENGINE_READY_TIMEOUT_S"


def runtime_version() -> str:
    try:
        return metadata.version("runtime")
    except metadata.PackageNotFoundError:
        return "unknown"


async def run_until_disconnect(request: Request, handler):
    """Await ``handler`` unless the client goes away first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(handler)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its cleanup (aborts) run
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


def _add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine

    @app.get("/health")
    async def health(request: Request):
        if engine.is_dead:
            return error_response(request, OpenAIError(f"the engine is not running: {engine.dead_error}", 503))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": runtime_version()}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        cards = [
            ModelCard(id=name, root=engine.model_config.model, max_model_len=engine.model_config.max_model_len)
            for name in ctx.served_model_names
        ]
        return ModelList(data=cards).model_dump()


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await run_until_disconnect(request, completions.create_completion(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await run_until_disconnect(request, chat.create_chat_completion(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        completions.check_model(body.model)
        tokens = _tokenize(chat, body)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.model_config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        if engine.tokenizer is None:
            raise ValueError("detokenize needs a tokenizer; the server runs with skip_tokenizer_init")
        vocab = engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"tokens: token id {bad} is out of range; valid ids are 0..{vocab - 1}")
        return {"prompt": engine.tokenizer.decode(body.tokens)}


def _tokenize(chat: OpenAIServingChat, body: TokenizeRequest) -> list[int]:
    if chat.tokenizer is None:
        raise ValueError("tokenize needs a tokenizer; the server runs with skip_tokenizer_init")
    if (body.prompt is None) == (body.messages is None):
        raise ValueError("tokenize needs exactly one of prompt or messages")
    if body.messages is not None:
        request = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
        return chat.render_prompt(request)["prompt_token_ids"]
    return chat.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)


def build_app(args, engine) -> FastAPI:
    """The FastAPI app over a started AsyncLLM; ``args`` are the ``runtime serve`` flags."""
    app = FastAPI(title="runtime OpenAI-compatible server", version=runtime_version())
    app.state.metrics = engine.metrics
    ctx = ServingContext(engine=engine, served_model_names=[engine.model_config.served_model_name])
    install_error_handlers(app)
    _add_info_routes(app, ctx)
    _add_generation_routes(app, ctx)
    from runtime.plugins import get_plugin_manager

    get_plugin_manager().hook.register_routes(app=app)  # plugins add their own routes
    metrics = engine.metrics
    limit = getattr(args, "max_concurrent_requests", None)
    if limit:
        app.add_middleware(middleware.ConcurrencyLimitMiddleware, metrics=metrics, max_requests=limit)
    if getattr(args, "api_key", None):
        app.add_middleware(middleware.APIKeyMiddleware, metrics=metrics, api_key=args.api_key)
    max_body = getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
    app.add_middleware(middleware.BodySizeLimitMiddleware, metrics=metrics, max_bytes=max_body)
    origins = [o.strip() for o in (getattr(args, "allowed_origins", "") or "").split(",") if o.strip()]
    if origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
            allow_credentials="*" not in origins,
        )
    known = {route.path for route in app.routes}
    app.add_middleware(middleware.HTTPMetricsMiddleware, metrics=metrics, known_paths=known)
    return app


def run_server(args, engine_args: EngineArgs) -> int:
    """Serve until stopped; 0 after a clean stop, 1 if the engine failed to start or died."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    config = engine_args.create_engine_config()  # bad arguments raise ValueError here, before any process starts
    try:
        return asyncio.run(_serve(args, engine_args, config))
    except KeyboardInterrupt:
        return 0


async def _serve(args, engine_args: EngineArgs, config: EngineConfig) -> int:
    import uvicorn

    from runtime.engine.async_llm import AsyncLLM

    timeout = float(os.environ.get(_READY_TIMEOUT_ENV, "600"))
    try:
        engine = await AsyncLLM.start(engine_args, config, ready_timeout_s=timeout)
    except EngineStartupError as exc:
        print(f"runtime: error: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    app = build_app(args, engine)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=3)
    )
    grace = float(os.environ.get(_DEATH_GRACE_ENV, "3"))

    def on_engine_dead(error) -> None:
        logger.error("%s; the server stops in %.1fs", error, grace)
        asyncio.get_running_loop().call_later(grace, setattr, server, "should_exit", True)

    engine.on_engine_dead(on_engine_dead)
    logger.info("serving %s on http://%s:%d (engine pid %s)", config.model_config.served_model_name, args.host, args.port, engine.engine_pid)
    try:
        await server.serve()
    finally:
        await engine.shutdown()
    if engine.is_dead:
        print(f"runtime: error: {engine.dead_error}", file=sys.stderr)
        return 1
    return 0
