"""``runtime plugins install`` / ``uninstall``: pip in the environment that runs ``runtime``.

Like ``llm install``, both run ``sys.executable -m pip`` so that a plugin always lands
next to the core that will load it, whatever ``pip`` is first on ``PATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

from runtime.plugins import ENTRY_POINT_GROUP

CORE_DISTRIBUTION = "runtime"
PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg")
ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".zip", ".tar.bz2")


def add_parsers(plugin_sub) -> None:
    """Add ``install`` and ``uninstall`` under the ``plugins`` subcommand."""
    install = plugin_sub.add_parser("install", help="install plugins with pip into this environment")
    install.add_argument("targets", nargs="+", metavar="NAME|PATH", help="package names, project folders or archives")
    install.add_argument("-e", "--editable", action="store_true", help="install project folders in editable mode")
    install.add_argument("-U", "--upgrade", action="store_true", help="upgrade plugins that are already installed")
    install.add_argument("--no-deps", action="store_true", help="do not install dependencies (pip --no-deps)")
    install.add_argument(
        "--no-build-isolation", action="store_true", help="build with the packages already installed (pip option)"
    )
    install.set_defaults(func=run_install)
    uninstall = plugin_sub.add_parser("uninstall", help="uninstall plugins with pip")
    uninstall.add_argument("names", nargs="+", metavar="NAME", help="distribution names or plugin (entry-point) names")
    uninstall.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    uninstall.set_defaults(func=run_uninstall)


# ---------------------------------------------------------------------- install
def is_path_like(target: str) -> bool:
    """A folder or archive rather than a name on the package index."""
    return (
        os.sep in target
        or "/" in target
        or target.startswith((".", "~"))
        or target.endswith(ARCHIVE_SUFFIXES)
    )


def check_install_target(target: str, editable: bool) -> str:
    """The pip argument for ``target``; raises ValueError for folders that cannot be installed."""
    if not (editable or is_path_like(target)):
        return target
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.exists(path):
        kind = "editable install needs a project folder" if editable else "no such plugin folder or archive"
        raise ValueError(f"{kind}: {target!r} does not exist")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in PROJECT_FILES):
        raise ValueError(f"{target!r} is not a Python project: it has none of {', '.join(PROJECT_FILES)}")
    if editable and not os.path.isdir(path):
        raise ValueError(f"editable installs need a project folder, not a file: {target!r}")
    return path


def install_command(args) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install"]
    if args.upgrade:
        cmd.append("--upgrade")
    if args.no_deps:
        cmd.append("--no-deps")
    if args.no_build_isolation:
        cmd.append("--no-build-isolation")
    for target in args.targets:
        resolved = check_install_target(target, args.editable)
        cmd += ["-e", resolved] if args.editable else [resolved]
    return cmd


def run_install(args) -> int:
    rc = run_pip(install_command(args))
    if rc == 0:
        print("installed; `runtime plugins` lists what each plugin registers")
    return rc


# -------------------------------------------------------------------- uninstall
def plugin_distributions() -> dict[str, str]:
    """Entry-point name -> distribution name of every installed plugin."""
    found = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist is not None:
            found[ep.name] = ep.dist.name
    return found


def resolve_uninstall_name(name: str) -> str:
    """The distribution to uninstall for a distribution or entry-point name."""
    plugins = plugin_distributions()
    if name in plugins:
        name = plugins[name]
    if _canonical(name) == CORE_DISTRIBUTION:
        raise ValueError(f"refusing to uninstall the core package {name!r}; use pip directly if you mean it")
    installed = ", ".join(sorted(set(plugins.values()))) or "none"
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ValueError(f"{name!r} is not installed; installed plugins: {installed}") from None
    if _canonical(name) not in {_canonical(dist) for dist in plugins.values()}:
        raise ValueError(
            f"refusing to uninstall {name!r}: it is not a runtime plugin (no entry point in the group "
            f"{ENTRY_POINT_GROUP!r}); installed plugins: {installed}; use pip directly if you mean it"
        )
    return name


def _canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def run_uninstall(args) -> int:
    cmd = [sys.executable, "-m", "pip", "uninstall"]
    if args.yes:
        cmd.append("--yes")
    cmd += [resolve_uninstall_name(name) for name in args.names]
    return run_pip(cmd)


# -------------------------------------------------------------------------- pip
def run_pip(cmd: list[str]) -> int:
    """Run pip with the terminal attached; a failure names the command and its exit code."""
    print("running: " + " ".join(cmd), file=sys.stderr)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        print(f"runtime: error: pip failed with exit code {rc}: {' '.join(cmd)}", file=sys.stderr)
    return rc
