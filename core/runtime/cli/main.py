"""The ``runtime`` command."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser(load_plugins: bool = True) -> argparse.ArgumentParser:
    from runtime.cli import bench, plugins_cmd, proxy, serve
    from runtime.plugins import get_plugin_manager

    parser = argparse.ArgumentParser(prog="runtime", description="LLM inference and serving engine")
    parser.add_argument("--plugins", default=None, help="comma-separated plugins to load (default: all; '' loads none)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve.register(sub)
    plugins_cmd.register(sub)
    bench.register(sub)
    proxy.register(sub)
    if load_plugins:
        get_plugin_manager().hook.register_commands(cli=sub)
    return parser


def _manages_plugins(argv: list[str]) -> bool:
    """``runtime plugins install|uninstall`` must work even when an installed plugin is broken."""
    words = [a for a in argv if not a.startswith("-")]
    return len(words) >= 2 and words[0] == "plugins" and words[1] in ("install", "uninstall")


def _apply_plugin_allow_list(argv: list[str]) -> list[str]:
    """``--plugins`` must act before plugins load, so it is read ahead of argparse."""
    for i, arg in enumerate(argv):
        if arg == "--plugins" and i + 1 < len(argv):
            os.environ["RUNTIME_PLUGINS"] = argv[i + 1]
        elif arg.startswith("--plugins="):
            os.environ["RUNTIME_PLUGINS"] = arg.split("=", 1)[1]
    return argv


def main(argv: list[str] | None = None) -> int:
    from runtime.cli.config_file import parse_args_with_config
    from runtime.plugins import PluginError

    argv = _apply_plugin_allow_list(list(sys.argv[1:] if argv is None else argv))
    try:
        parser = build_parser(load_plugins=not _manages_plugins(argv))
        args = parse_args_with_config(parser, argv)  # --config FILE.yaml: the file's values under the flags
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except (ValueError, PluginError) as exc:
        print(f"runtime: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
