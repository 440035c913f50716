"""``runtime proxy --prefill URL [URL...] --decode URL [URL...]``: the prefill/decode front."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("proxy", help="OpenAI-compatible front routing requests to prefill and decode instances")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.set_defaults(func=run)


def run(args) -> int:
    import logging

    from runtime.entrypoints.proxy import run_proxy

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_proxy(args.prefill, args.decode, args.host, args.port)
    return 0
