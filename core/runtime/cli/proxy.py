"""``runtime proxy --prefill URL [URL...] --decode URL [URL...]``: the prefill/decode front."""

from __future__ import annotations

ROUTINGS = ("least_requests", "round_robin")  # runtime.entrypoints.proxy's (not imported here: fastapi is slow to load)
PREFILL_TIMEOUT_S = 300.0  # runtime.entrypoints.proxy's


def register(sub) -> None:
    parser = sub.add_parser("proxy", help="OpenAI-compatible front routing requests to prefill and decode instances")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--routing", choices=ROUTINGS, default="least_requests",
                        help="pick the instance with the fewest requests in flight from this proxy, or each in turn")
    parser.add_argument("--prefill-timeout", type=float, default=PREFILL_TIMEOUT_S, metavar="SECONDS",
                        help="fail a request with a 504 when its prefill instance has not answered this long")
    parser.set_defaults(func=run)


def run(args) -> int:
    import logging

    from runtime.entrypoints.proxy import run_proxy

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_proxy(args.prefill, args.decode, args.host, args.port, args.routing, args.prefill_timeout)
    return 0
