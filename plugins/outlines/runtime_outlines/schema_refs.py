"""Recursive JSON schemas (a ``$ref`` back to a schema that holds it: trees, linked lists) are
refused by name. outlines-core 0.2.14 expands a recursive ``$ref`` a fixed number of levels and
then drops it: at the cut an object loses its required property (``{"v": 0,}``, not even valid
JSON) or an array item, so the regex admits output that fails the schema, or only such output.
A regular expression cannot describe unbounded nesting, so there is no exact regex to give instead.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from runtime_outlines.numbers import subschemas

_DEFINITION_MAPS = ("$defs/", "definitions/")  # schemas reached only through a $ref


def check_not_recursive(schema: Any) -> None:
    """Raise ValueError naming a ``$ref`` of ``schema`` (reached from its root) that refers back to a
    schema holding it. Iterative depth-first search, so long ``$ref`` chains cannot overflow the stack."""
    on_path: set[int] = set()  # ids of the schemas from the root to the current one
    done: set[int] = set()  # ids of schemas fully searched without finding a cycle
    stack: list[tuple[Any, str, bool]] = [(schema, "#", False)]
    while stack:
        node, path, leaving = stack.pop()
        if leaving:
            on_path.discard(id(node))
            done.add(id(node))
            continue
        if not isinstance(node, dict) or id(node) in done:
            continue
        on_path.add(id(node))
        stack.append((node, path, True))
        for key, child in subschemas(node):
            if not key.startswith(_DEFINITION_MAPS) and isinstance(child, dict):
                stack.append((child, f"{path}/{key}", False))
        ref = node.get("$ref")
        target = _resolve(schema, ref) if isinstance(ref, str) else None
        if target is None:
            continue
        if id(target) in on_path:
            raise ValueError(
                f"the JSON schema is recursive: $ref {ref!r} at {path} refers back to a schema that holds it; the "
                "outlines guided decoding backend does not support recursive schemas (it would cut them at a fixed "
                "depth, where the output could violate the schema)"
            )
        stack.append((target, ref, False))


def _resolve(root: Any, ref: str) -> Any:
    """The sub-schema a local ``$ref`` (``#``, ``#/$defs/name``, any JSON pointer) names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    pointer = urllib.parse.unquote(ref[1:])
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None
