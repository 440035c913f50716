"""``runtime serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl

from runtime.cli.args import add_engine_args, engine_args_from_namespace, json_object, json_or_comma_list
from runtime.entrypoints.openai.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CHOICES_PER_REQUEST,
    DEFAULT_MAX_N,
    RequestLimits,
)
from runtime.entrypoints.openai.request_logger import DEFAULT_MAX_LOG_LEN
from runtime.model_loader.default_model import default_model_path, default_served_model_name

MAX_API_SERVERS = 255  # the engine names a client by one byte
MAX_PORT = 65535
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's choices
_METHOD = re.compile(r"[A-Za-z]+|\*")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token


def register(sub) -> None:
    parser = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    parser.add_argument("model_tag", nargs="?", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--plugins", default=None, help="comma-separated plugins to load ('' loads none)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("RUNTIME_API_KEY") or os.environ.get("VLLM_API_KEY"),
                        help="required bearer token (env RUNTIME_API_KEY, else vLLM's VLLM_API_KEY)")
    parser.add_argument("--allowed-origins", type=origin_list, default="",
                        help="CORS origins: comma-separated, or vLLM's JSON list ('*' for any)")
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
    parser.add_argument("--reasoning-parser", type=reasoning_parser_name, default=None, metavar="NAME",
                        help="chat replies carry the model's reasoning in reasoning_content, split off as this "
                             f"parser reads it: {', '.join(_reasoning_parser_names())}")
    parser.add_argument("--response-role", type=response_role, default="assistant", metavar="ROLE",
                        help="the role of the reply in chat responses (with add_generation_prompt)")
    parser.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="API server processes sharing one engine core, each accepting connections on the port")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                        help="a stream sends a chunk once this many new tokens are in (the first and last at once)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true", default=False,
                        help='logprobs name tokens as "token_id:N" unless a request says otherwise '
                             "(its return_tokens_as_token_ids)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", default=False,
                        help="usage has prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix "
                             "cache")
    parser.add_argument("--enable-force-include-usage", action="store_true", default=False,
                        help="every streamed response ends with the usage chunk, as if the request had "
                             "stream_options.include_usage (continuous usage still needs continuous_usage_stats)")
    parser.add_argument("--limit-mm-per-prompt", type=json_object, default=None, metavar="JSON",
                        help="vLLM's multimodal item limits: only zeros are accepted (models here take text only)")
    _add_http_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run)


def _add_http_args(parser) -> None:
    """vLLM's flags for uvicorn, CORS, TLS and the HTTP extras."""
    parser.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS, help="uvicorn's log level")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", default=False,
                        help="no access log line per HTTP request")
    parser.add_argument("--root-path", default=None, metavar="PATH",
                        help="the path prefix under which a proxy that strips it serves this server (FastAPI's root_path)")
    parser.add_argument("--allowed-methods", type=name_list("method", _METHOD), default=["*"],
                        help="CORS methods for --allowed-origins: JSON list or comma-separated (default: any)")
    parser.add_argument("--allowed-headers", type=name_list("header", _HEADER), default=["*"],
                        help="CORS request headers for --allowed-origins: JSON list or comma-separated (default: any)")
    parser.add_argument("--allow-credentials", action="store_true", default=False,
                        help="CORS: let the --allowed-origins send credentials (cookies, HTTP auth)")
    parser.add_argument("--disable-fastapi-docs", action="store_true", default=False,
                        help="no /docs, /redoc or /openapi.json")
    parser.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="TLS private key (PEM, unencrypted)")
    parser.add_argument("--ssl-certfile", default=None, metavar="FILE", help="TLS certificate chain (PEM): serve HTTPS")
    parser.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA certificates to verify clients with")
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), metavar="N",
                        help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    parser.add_argument("--enable-request-id-headers", action="store_true", default=False,
                        help="answer with an X-Request-Id header: the request's own, else a new one")


def name_list(kind: str, pattern: re.Pattern):
    """The type of a CORS list flag: vLLM's JSON list or comma-separated names, each matching ``pattern``."""

    def parse(text: str) -> list[str]:
        names = json_or_comma_list(text)
        if not names:
            raise argparse.ArgumentTypeError(f"must be a list of {kind} names, got {text!r}")
        bad = next((n for n in names if not isinstance(n, str) or not pattern.fullmatch(n)), None)
        if bad is not None:
            raise argparse.ArgumentTypeError(f"{bad!r} is not an HTTP {kind} name (or '*' for any)")
        return names

    return parse


def origin_list(text: str) -> str:
    """``--allowed-origins`` as comma-separated origins: vLLM's JSON list (``'["https://a", "https://b"]'``)
    or runtime's comma-separated text."""
    if not text.lstrip().startswith("["):
        return text
    origins = json_or_comma_list(text)
    if not all(isinstance(o, str) and o and "," not in o for o in origins):
        raise argparse.ArgumentTypeError(f"must be a list of origin strings, got {text!r}")
    return ",".join(origins)


def _tool_parser_names() -> list[str]:
    from runtime.entrypoints.openai.tool_parsers import tool_parser_names

    return tool_parser_names()


def _reasoning_parser_names() -> list[str]:
    from runtime.entrypoints.openai.reasoning import reasoning_parser_names

    return reasoning_parser_names()


def reasoning_parser_name(name: str) -> str:
    """The type of ``--reasoning-parser``: a registered parser's name."""
    from runtime.entrypoints.openai.reasoning import get_reasoning_parser

    try:
        get_reasoning_parser(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def response_role(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a role name such as 'assistant', got an empty one")
    return text


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
    """--api-server-count in 1..255, --stream-interval >= 1, --port a TCP port, --max-concurrent-requests >= 0 and
    no multimodal items asked for; ValueError naming the bad value otherwise."""
    if not 0 <= args.port <= MAX_PORT:
        raise ValueError(f"--port must be a TCP port in 0..{MAX_PORT} (0: any free port), got {args.port}")
    if args.max_concurrent_requests < 0:
        raise ValueError(f"--max-concurrent-requests must be >= 1, or 0 for no limit, got {args.max_concurrent_requests}")
    mm_limits = getattr(args, "limit_mm_per_prompt", None) or {}
    if any(value not in (0, {"count": 0}) for value in mm_limits.values()):
        raise ValueError(
            f"--limit-mm-per-prompt {json.dumps(mm_limits)}: this server runs text-only models and takes no images, "
            "audio or video; leave the flag out (or give every modality 0)"
        )
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        raise ValueError(f"--api-server-count must be in 1..{MAX_API_SERVERS}, got {args.api_server_count}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1 (tokens), got {args.stream_interval}")
    check_http_args(args)


def check_http_args(args) -> None:
    """--root-path, the CORS credentials and the TLS files; ValueError naming the bad value otherwise."""
    root = getattr(args, "root_path", None)
    if root and not root.startswith("/"):
        raise ValueError(f"--root-path must be a URL path starting with '/', got {root!r}")
    if getattr(args, "allow_credentials", False) and "*" in [o.strip() for o in args.allowed_origins.split(",")]:
        raise ValueError("--allow-credentials with --allowed-origins '*' would let any web site send requests with "
                         "its visitors' credentials; list the origins that may")
    cert_reqs = getattr(args, "ssl_cert_reqs", 0)
    if cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}")
    keyfile, certfile, ca_certs = (getattr(args, name, None) for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"))
    if keyfile and not certfile:
        raise ValueError(f"--ssl-keyfile {keyfile} needs --ssl-certfile (the certificate of that key)")
    if (ca_certs or cert_reqs) and not certfile:
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (they apply to HTTPS)")
    if certfile:
        _check_tls_files(certfile, keyfile, ca_certs)


def _check_tls_files(certfile: str, keyfile: str | None, ca_certs: str | None) -> None:
    """Load the TLS files as uvicorn will, so a bad one fails before the model loads."""

    def encrypted_key():
        raise ValueError(f"--ssl-keyfile {keyfile or certfile}: the key is encrypted; give an unencrypted key")

    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=encrypted_key)
    except ssl.SSLError as exc:
        raise ValueError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a usable certificate and key "
                         f"in PEM ({exc})") from None
    if ca_certs:
        try:
            context.load_verify_locations(ca_certs)
        except ssl.SSLError as exc:
            raise ValueError(f"--ssl-ca-certs {ca_certs}: not PEM CA certificates ({exc})") from None


def run(args) -> int:
    from runtime.entrypoints.openai.api_server import run_server

    RequestLimits.from_args(args)  # a bad limit fails here, before the model loads
    check_tool_args(args)
    check_front_end_args(args)
    model = args.model_tag or args.model
    names = getattr(args, "served_model_name", None)
    if not model:  # the embedded default: its file name is its API name unless --served-model-name gives one
        model = default_model_path()
        names = names or default_served_model_name(model)
    engine_args = engine_args_from_namespace(args, model=model, served_model_name=names)
    return run_server(args, engine_args)
