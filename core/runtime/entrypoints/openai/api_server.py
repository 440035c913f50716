"""The OpenAI-compatible HTTP server: FastAPI app over an AsyncLLM, run by uvicorn.

``run_server`` validates the engine arguments in this process (an unknown
plugin name or a bad model path fails here), spawns the engine process and
waits for it to be ready, then serves. If the engine dies, in-flight requests
fail at once, /health answers 503, and the server exits non-zero after a
short grace period (``RUNTIME_ENGINE_DEATH_GRACE_S``, default 3 s).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import uuid
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.datastructures import Headers

from runtime.config import EngineConfig
from runtime.engine_args import EngineArgs
from runtime.engine.core_client import EngineStartupError, raise_if_stop_requested
from runtime.entrypoints.openai import middleware
from runtime.entrypoints.openai.api_servers import url_scheme
from runtime.entrypoints.openai.dev_routes import add_control_routes
from runtime.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from runtime.entrypoints.openai.limits import RequestLimits
from runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, InvalidField, TokenizeRequest,
)
from runtime.entrypoints.openai.request_body import CheckedBodyRoute
from runtime.entrypoints.openai.request_logger import DEFAULT_MAX_LOG_LEN, RequestLogger
from runtime.entrypoints.openai.responses import ModelCard, ModelList
from runtime.entrypoints.openai.serving_chat import OpenAIServingChat
from runtime.entrypoints.openai.serving_completion import OpenAIServingCompletion
from runtime.entrypoints.openai.serving_engine import ServingContext, client_request_id, model_not_found
from runtime.entrypoints.openai.shutdown import abort_requests_on_exit, stop_on_sigterm
from runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from runtime.stat_logger import log_stats_interval

logger = logging.getLogger("runtime.server")

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


def get_and_head(app: FastAPI, path: str):
    """Register a GET route that answers HEAD too (as HTTP asks; load balancers probe with it), the HEAD route
    left out of /openapi.json."""
    def register(endpoint):
        app.head(path, include_in_schema=False)(endpoint)
        return app.get(path)(endpoint)

    return register


def _add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine

    @get_and_head(app, "/health")
    async def health(request: Request):
        error = engine.probe_health()
        if error is not None:
            return error_response(request, OpenAIError(f"the engine is not running: {error}", 503))
        return Response(status_code=200)

    @get_and_head(app, "/version")
    async def version():
        return {"version": runtime_version()}

    @get_and_head(app, "/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def card(name: str) -> dict:
        config = engine.model_config
        return ModelCard(id=name, root=config.model, max_model_len=config.max_model_len).model_dump()

    @get_and_head(app, "/v1/models")
    async def models():
        return ModelList(data=[card(name) for name in ctx.served_model_names]).model_dump()

    @get_and_head(app, "/v1/models/{model:path}")
    async def retrieve_model(model: str):  # OpenAI's GET /v1/models/{model}; model names may hold "/"
        if model not in ctx.served_model_names:
            raise model_not_found(model, ctx.served_model_names)
        return card(model)


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        body = completions.with_forced_usage(completions.with_model_defaults(body))
        return await run_until_disconnect(request, completions.create_completion(body, request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        body = chat.with_forced_usage(chat.with_model_defaults(body))
        return await run_until_disconnect(request, chat.create_chat_completion(body, request))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        completions.check_model(body.model)
        tokens = await asyncio.to_thread(_tokenize, chat, body)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.model_config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        return {"prompt": await asyncio.to_thread(_detokenize, engine, body.tokens)}


def _detokenize(engine, tokens: list[int]) -> str:
    if engine.tokenizer is None:
        raise ValueError("detokenize needs a tokenizer; the server runs with skip_tokenizer_init")
    vocab = engine.model_config.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidField("tokens", f"tokens: token id {bad} is out of range; valid ids are 0..{vocab - 1}")
    return engine.tokenizer.decode(tokens)


def _tokenize(chat: OpenAIServingChat, body: TokenizeRequest) -> list[int]:
    if chat.tokenizer is None:
        raise ValueError("tokenize needs a tokenizer; the server runs with skip_tokenizer_init")
    if (body.prompt is None) == (body.messages is None):
        raise InvalidField("prompt" if body.prompt is None else "messages", "tokenize needs exactly one of prompt or messages")
    if body.messages is not None:
        request = ChatCompletionRequest(
            messages=body.messages, tools=body.tools, tool_choice="none", add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs,
        )
        request.check_supported()  # as a chat request's: no template of the request's own
        return chat.render_prompt(request)["prompt_token_ids"]
    return chat.engine.input_processor.encode(body.prompt, add_special_tokens=body.add_special_tokens)


def serving_context(args, engine) -> ServingContext:
    """The names the engine answers to and, unless ``--disable-log-requests``, a request logger."""
    config = engine.model_config
    names = list(getattr(config, "served_model_names", ()) or [config.served_model_name])
    ctx = ServingContext(engine=engine, served_model_names=names,
                         return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False))
    if getattr(args, "enable_auto_tool_choice", False) and getattr(args, "tool_call_parser", None):
        from runtime.entrypoints.openai.tool_parsers import get_tool_parser

        ctx.tool_parser = get_tool_parser(args.tool_call_parser)
    if getattr(args, "reasoning_parser", None):
        from runtime.entrypoints.openai.reasoning import get_reasoning_parser

        ctx.reasoning_parser = get_reasoning_parser(args.reasoning_parser)
    ctx.response_role = getattr(args, "response_role", None) or "assistant"
    ctx.enable_prompt_tokens_details = getattr(args, "enable_prompt_tokens_details", False)
    ctx.enable_force_include_usage = getattr(args, "enable_force_include_usage", False)
    if getattr(args, "log_requests", False):
        ctx.request_logger = RequestLogger(getattr(args, "max_log_len", DEFAULT_MAX_LOG_LEN))
    return ctx


def build_app(args, engine) -> FastAPI:
    """The FastAPI app over a started AsyncLLM; ``args`` are the ``runtime serve`` flags."""
    no_docs = getattr(args, "disable_fastapi_docs", False)
    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if no_docs else {}
    root_path = (getattr(args, "root_path", None) or "").rstrip("/")
    app = FastAPI(title="runtime OpenAI-compatible server", version=runtime_version(), root_path=root_path, **docs)
    app.router.route_class = CheckedBodyRoute  # JSON bodies only, with valid Unicode strings
    app.state.metrics = engine.metrics
    ctx = serving_context(args, engine)
    ctx.limits = RequestLimits.from_args(args)
    install_error_handlers(app)
    _add_info_routes(app, ctx)
    _add_generation_routes(app, ctx)
    add_control_routes(app, engine)  # /start_profile, /stop_profile; /sleep, /wake_up ... in dev mode
    from runtime.plugins import get_plugin_manager

    get_plugin_manager().hook.register_routes(app=app)  # plugins add their own routes
    metrics = engine.metrics
    limit = getattr(args, "max_concurrent_requests", None)
    if limit:
        app.add_middleware(middleware.ConcurrencyLimitMiddleware, metrics=metrics, max_requests=limit)
    if getattr(args, "api_key", None):
        app.add_middleware(middleware.APIKeyMiddleware, metrics=metrics, api_key=args.api_key)
    app.add_middleware(middleware.BodySizeLimitMiddleware, metrics=metrics, max_bytes=ctx.limits.max_body_bytes)
    origins = [o.strip() for o in (getattr(args, "allowed_origins", "") or "").split(",") if o.strip()]
    if origins:  # credentials only when asked for, as vLLM; `runtime serve` refuses them with "*"
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=getattr(args, "allowed_methods", ["*"]),
            allow_headers=getattr(args, "allowed_headers", ["*"]),
            allow_credentials=getattr(args, "allow_credentials", False),
        )
    if getattr(args, "enable_request_id_headers", False):
        app.add_middleware(RequestIdMiddleware)  # outside the checks above, so their errors carry it too
    known = {route.path for route in app.routes}
    app.add_middleware(middleware.HTTPMetricsMiddleware, metrics=metrics, known_paths=known)
    if root_path:
        app.add_middleware(RootPathMiddleware, root_path=root_path)
    return app


class RootPathMiddleware:
    """--root-path (FastAPI's root_path, as vLLM sets it): routing takes "/prefix/v1/..." (a proxy that kept the
    prefix) as "/v1/..."; every middleware sees that path too, so the API key and the limits apply to it as well."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and path.startswith(self.root_path + "/"):
            scope = {**scope, "path": path[len(self.root_path):]}
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every HTTP response has X-Request-Id, the request's own if it sent a
    usable one (see ``client_request_id``), else a new random id, which the request's completion id is made of too
    (``request.state.request_id``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = client_request_id(Headers(scope=scope))
        if given is None:
            made = uuid.uuid4().hex
            scope.setdefault("state", {})["request_id"] = made
        request_id = (made if given is None else given).encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def uvicorn_config(app: FastAPI, args):
    """uvicorn's settings from the ``runtime serve`` flags (vLLM's names): log level, access log, TLS."""
    import uvicorn

    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=getattr(args, "uvicorn_log_level", "info"),
        access_log=not getattr(args, "disable_uvicorn_access_log", False), timeout_graceful_shutdown=3,
        ssl_keyfile=getattr(args, "ssl_keyfile", None), ssl_certfile=getattr(args, "ssl_certfile", None),
        ssl_ca_certs=getattr(args, "ssl_ca_certs", None), ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0),
    )


def run_server(args, engine_args: EngineArgs) -> int:
    """Serve until stopped; 0 after a clean stop, 1 if the engine failed to start or died."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    config = engine_args.create_engine_config()  # bad arguments raise ValueError here, before any process starts
    stop_on_sigterm()
    if getattr(args, "api_server_count", 1) > 1:
        from runtime.entrypoints.openai.api_servers import run_api_servers

        return run_api_servers(args, engine_args, config)
    return run_event_loop(serve(args, engine_args, config))


def run_event_loop(main) -> int:
    """Run the coroutine ``main`` on uvloop where it is installed (else asyncio's loop); Ctrl-C gives 0."""
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(main)
    except KeyboardInterrupt:
        return 0


async def _log_stats_every(interval_s: float, engine) -> None:
    while True:
        await asyncio.sleep(interval_s)
        engine.metrics.stat_logger.log()


async def serve(args, engine_args: EngineArgs, config: EngineConfig, sock=None, watchdog=None, **engine_kwargs) -> int:
    """Start an AsyncLLM (``engine_kwargs`` go to it) and serve HTTP on ``sock`` (default: bind --host/--port)
    until stopped, or until the coroutine ``watchdog`` returns."""
    import uvicorn

    from runtime.engine.async_llm import AsyncLLM

    timeout = float(os.environ.get(_READY_TIMEOUT_ENV, "600"))
    stats_interval = None if engine_args.disable_log_stats else log_stats_interval()
    engine_kwargs.setdefault("stream_interval", getattr(args, "stream_interval", 1))
    try:
        engine = await AsyncLLM.start(engine_args, config, ready_timeout_s=timeout, **engine_kwargs)
    except EngineStartupError as exc:
        print(f"runtime: error: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    app = build_app(args, engine)
    server = uvicorn.Server(uvicorn_config(app, args))
    grace = float(os.environ.get(_DEATH_GRACE_ENV, "3"))

    def on_engine_dead(error) -> None:
        logger.error("%s; the server stops in %.1fs", error, grace)
        asyncio.get_running_loop().call_later(grace, setattr, server, "should_exit", True)

    engine.on_engine_dead(on_engine_dead)
    pids = ", ".join(str(pid) for pid in engine.engine_pids)
    logger.info("serving %s on %s://%s:%d (engine pid %s)", config.model_config.served_model_name, url_scheme(args),
                args.host, args.port, pids)
    if config.model_config.default_sampling_params:
        logger.info("default sampling parameters from the model's generation config (--generation-config vllm "
                    "ignores them): %s", config.model_config.default_sampling_params)
    stats_task = asyncio.create_task(_log_stats_every(stats_interval, engine)) if stats_interval else None
    # The startup heap (tokenizer, torch, transformers: about a million objects) lives until exit;
    # frozen, full collections skip it, so a request that allocates much (a JSON body of many
    # small lists) pauses the event loop about 3x less.
    gc.collect()
    gc.freeze()
    stopping = asyncio.create_task(abort_requests_on_exit(server, engine))
    if watchdog is not None:
        watching = asyncio.create_task(watchdog)
        watching.add_done_callback(lambda _: setattr(server, "should_exit", True))
    try:
        raise_if_stop_requested()  # a SIGTERM since start-up whose KeyboardInterrupt a library swallowed
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        stopping.cancel()
        if stats_task is not None:
            stats_task.cancel()
        await engine.shutdown()
    if engine.is_dead:
        print(f"runtime: error: {engine.dead_error}", file=sys.stderr)
        return 1
    return 0
