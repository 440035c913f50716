"""``runtime plugins``: what is installed and what each plugin registered; install and uninstall."""

from __future__ import annotations

import argparse
import json

from runtime.plugins import REGISTRY_KINDS


def register(sub) -> None:
    from runtime.cli import plugins_install

    parser = sub.add_parser("plugins", help="list, install and uninstall plugins")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--hook", default=None, help="only plugins implementing this hook (e.g. register_platforms)")
    # Read by runtime.cli.main before plugins load; accepted here too so that
    # `runtime plugins --plugins cpu` works as well as `runtime --plugins cpu plugins`.
    parser.add_argument("--plugins", default=argparse.SUPPRESS, help="comma-separated plugins to load ('' loads none)")
    parser.set_defaults(func=run)
    plugin_sub = parser.add_subparsers(dest="plugins_command", metavar="{install,uninstall}")
    plugins_install.add_parsers(plugin_sub)


def collect(hook: str | None = None) -> list[dict]:
    from runtime.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if hook is not None:
        valid = sorted(name for name in dir(manager.hook) if name.startswith("register_"))
        if hook not in valid:
            raise ValueError(f"unknown hook {hook!r}; hooks: {', '.join(valid)}")
        implementers = {impl.plugin_name for impl in getattr(manager.hook, hook).get_hookimpls()}
    rows = []
    for info in manager.infos.values():
        if hook is not None and info.name not in implementers:
            continue
        hooks = sorted(
            name
            for name in dir(manager.hook)
            if name.startswith("register_")
            and any(impl.plugin_name == info.name for impl in getattr(manager.hook, name).get_hookimpls())
        )
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "hooks": hooks,
                "registered": {kind: names for kind, names in info.registered.items()},
            }
        )
    return rows


def run(args) -> int:
    rows = collect(args.hook)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    kinds = list(REGISTRY_KINDS.values())
    for row in rows:
        print(f"{row['name']} {row['version']} ({row['distribution']})")
        for kind in kinds:
            names = row["registered"].get(kind)
            if names:
                print(f"  {kind}: {', '.join(names)}")
        others = [h for h in row["hooks"] if h not in REGISTRY_KINDS]
        if others:
            print(f"  hooks: {', '.join(others)}")
    return 0
