"""``runtime serve``: the OpenAI-compatible server."""

from __future__ import annotations

import os

from runtime.cli.args import add_engine_args, engine_args_from_namespace
from runtime.entrypoints.openai.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CHOICES_PER_REQUEST,
    DEFAULT_MAX_N,
    RequestLimits,
)
from runtime.entrypoints.openai.request_logger import DEFAULT_MAX_LOG_LEN
from runtime.model_loader.default_model import default_model_path

MAX_API_SERVERS = 255  # the engine names a client by one byte


def register(sub) -> None:
    parser = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    parser.add_argument("model_tag", nargs="?", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--plugins", default=None, help="comma-separated plugins to load ('' loads none)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("RUNTIME_API_KEY"), help="required bearer token (env RUNTIME_API_KEY)")
    parser.add_argument("--allowed-origins", default="", help="comma-separated CORS origins ('*' for any)")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024, help="503 beyond this many in flight")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="413 for a larger request body (parsed on the event loop: a larger limit lets one request stall the others longer)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="400 for a request with a larger n (OpenAI allows 128)")
    parser.add_argument("--max-choices-per-request", type=int, default=DEFAULT_MAX_CHOICES_PER_REQUEST,
                        help="400 for a completions request asking for more completions in all (n x number of prompts)")
    parser.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=True,
                        help="do not log each request received (id, prompt, sampling parameters)")
    parser.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                        help="log each request received (the default)")
    parser.add_argument("--max-log-len", type=int, default=DEFAULT_MAX_LOG_LEN,
                        help="characters of a prompt that a request's log line shows (-1: all)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                        help='answer tool_choice "auto" (and tools without tool_choice) by parsing the model\'s '
                             "text with --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how tool calls look in the model's text, for --enable-auto-tool-choice: "
                             f"{', '.join(_tool_parser_names())}")
    parser.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="API server processes sharing one engine core, each accepting connections on the port")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                        help="a stream sends a chunk once this many new tokens are in (the first and last at once)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true", default=False,
                        help='logprobs name tokens as "token_id:N" unless a request says otherwise '
                             "(its return_tokens_as_token_ids)")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def _tool_parser_names() -> list[str]:
    from runtime.entrypoints.openai.tool_parsers import tool_parser_names

    return tool_parser_names()


def check_tool_args(args) -> None:
    """--enable-auto-tool-choice needs a known --tool-call-parser; ValueError saying why otherwise."""
    from runtime.entrypoints.openai.tool_parsers import get_tool_parser

    parser = getattr(args, "tool_call_parser", None)
    if parser is not None:
        get_tool_parser(parser)  # unknown: ValueError listing the valid ones
    if getattr(args, "enable_auto_tool_choice", False) and parser is None:
        raise ValueError(
            f"--enable-auto-tool-choice needs --tool-call-parser NAME (one of: {', '.join(_tool_parser_names())})"
        )


def check_front_end_args(args) -> None:
    """--api-server-count in 1..255 and --stream-interval >= 1; ValueError naming the bad value otherwise."""
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        raise ValueError(f"--api-server-count must be in 1..{MAX_API_SERVERS}, got {args.api_server_count}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1 (tokens), got {args.stream_interval}")


def run(args) -> int:
    from runtime.entrypoints.openai.api_server import run_server

    RequestLimits.from_args(args)  # a bad limit fails here, before the model loads
    check_tool_args(args)
    check_front_end_args(args)
    model = args.model_tag or args.model or default_model_path()
    engine_args = engine_args_from_namespace(args, model=model)
    return run_server(args, engine_args)
