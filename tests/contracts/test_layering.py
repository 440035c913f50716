"""Layering of core/runtime: lower parts never reach up, and module imports form no cycle."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import runtime

ROOT = pathlib.Path(runtime.__file__).parent
LOWER_PARTS = ("scheduler", "worker", "sample", "models")
UPPER_PARTS = ("runtime.engine", "runtime.entrypoints")


def module_name(path: pathlib.Path) -> str:
    parts = ["runtime", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, top_level_only: bool) -> set[str]:
    """Modules ``path`` imports (resolved to runtime.* names); optionally only those at module level."""
    tree = ast.parse(path.read_text())
    if top_level_only:  # statements under `if`/`try` at module level run at import; function bodies do not
        deferred = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        nodes = [n for stmt in tree.body if not isinstance(stmt, deferred) for n in ast.walk(stmt)]
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "runtime" or name.startswith("runtime.")}


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def test_lower_parts_never_import_the_engine_or_entrypoints():
    offenders = []
    for name, path in MODULES.items():
        if name.split(".")[1:2] not in [[part] for part in LOWER_PARTS]:
            continue
        for target in imports_of(path, top_level_only=False):
            if target.startswith(UPPER_PARTS):
                offenders.append(f"{name} imports {target}")
    assert not offenders, "\n".join(offenders)


def test_module_level_imports_have_no_cycle():
    graph = {
        name: {t for t in imports_of(path, top_level_only=True) if t in MODULES and t != name}
        for name, path in MODULES.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            raise AssertionError("import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):]))


def test_importing_runtime_loads_no_torch():
    code = "import sys, runtime; print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
