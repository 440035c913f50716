"""``$ref`` of a JSON schema, resolved by us and written in place (:func:`inline_refs`).

outlines-core 0.2.14 follows only plain pointers: it refused ``#/$defs/a~1b`` (the name ``a/b``),
``~0`` and percent-escapes, and read the anchor ``#foo`` as a pointer. The ``referencing`` library
(jsonschema's) resolves every local form: JSON pointers with their escapes, anchors, ``$id`` bases.
Remote references are refused by name.

Recursive schemas (a ``$ref`` back to a schema that holds it: trees, linked lists) are refused by
name too. outlines-core expands a recursive ``$ref`` a fixed number of levels and then drops it: at
the cut an object loses its required property (``{"v": 0,}``, not even valid JSON). A regular
expression cannot describe unbounded nesting, so there is no exact regex to give instead.
"""

from __future__ import annotations

from typing import Any

from runtime_outlines.schema_merge import map_subschemas

# Keys of a schema that only hold schemas reached through a $ref: dropped once every $ref is inlined
# (with the ids and anchors such a $ref could name).
_DEFINITION_KEYS = ("$defs", "definitions")
_DROPPED_KEYS = {"$defs", "definitions", "$id", "$anchor", "$dynamicAnchor"}
# Limits on the inlined schema: sub-schemas written in all (a definition used twice is written twice;
# reuse nested n levels deep multiplies by 2**n) and $refs followed in a row.
MAX_INLINED_SUBSCHEMAS = 5000
MAX_REF_NESTING = 100


class _Inliner:
    def __init__(self, schema: dict):
        import referencing
        import referencing.jsonschema

        self.spec = referencing.jsonschema.specification_with(
            schema.get("$schema", ""), default=referencing.jsonschema.DRAFT202012)
        resource = self.spec.create_resource(schema)
        registry = referencing.Registry().with_resource(resource.id() or "", resource)
        self.root_resolver = registry.resolver(base_uri=resource.id() or "")
        self.unresolvable = referencing.exceptions.Unresolvable
        self.count = 0
        self.inlined: dict[int, tuple[Any, int]] = {}  # id of a $ref's target -> (it inlined, its size)

    def expand(self, node: Any, resolver, path: str, on_path: frozenset, depth: int) -> Any:
        if not isinstance(node, dict):
            return node
        if depth > MAX_REF_NESTING:
            raise ValueError(f"the JSON schema's $refs nest more than {MAX_REF_NESTING} levels (at {path})")
        resource = self.spec.create_resource(node)
        if resource.id() is not None:  # a new base URI for the $refs below
            resolver = resolver.in_subresource(resource)
        if isinstance(node.get("$ref"), str):
            return self._follow(node["$ref"], resolver, path, on_path | {id(node)}, depth)
        self._count(1)
        on_path = on_path | {id(node)}

        def expand_child(key: str, child: Any) -> Any:
            if key.startswith(_DEFINITION_KEYS):
                return child  # dropped below
            return self.expand(child, resolver, f"{path}/{key}", on_path, depth + 1)

        out = map_subschemas(node, expand_child)
        return {key: value for key, value in out.items() if key not in _DROPPED_KEYS}

    def _follow(self, ref: str, resolver, path: str, on_path: frozenset, depth: int) -> Any:
        try:
            resolved = resolver.lookup(ref)
        except self.unresolvable:
            raise ValueError(
                f"the $ref {ref!r} at {path} names no sub-schema of the JSON schema; the outlines guided decoding "
                "backend follows references within the schema only (JSON pointers such as '#/$defs/name', "
                "anchors, $id)"
            ) from None
        except (AttributeError, TypeError):  # referencing met a sub-schema that is not an object or boolean
            raise ValueError(f"the $ref {ref!r} at {path} cannot be followed: the JSON schema holds a sub-schema "
                             "that is neither an object nor a boolean") from None
        target = resolved.contents
        if id(target) in on_path:
            raise ValueError(
                f"the JSON schema is recursive: $ref {ref!r} at {path} refers back to a schema that holds it; the "
                "outlines guided decoding backend does not support recursive schemas (it would cut them at a fixed "
                "depth, where the output could violate the schema)"
            )
        if id(target) in self.inlined:  # the same definition again: shared here, counted again
            inlined, size = self.inlined[id(target)]
            self._count(size)
            return inlined
        before = self.count
        inlined = self.expand(target, resolved.resolver, ref, on_path, depth + 1)
        self.inlined[id(target)] = (inlined, self.count - before)
        return inlined

    def _count(self, size: int) -> None:
        self.count += size
        if self.count > MAX_INLINED_SUBSCHEMAS:
            raise ValueError(f"the JSON schema's $refs expand to more than {MAX_INLINED_SUBSCHEMAS} sub-schemas; "
                             "the outlines guided decoding backend writes each use of a definition out in full")


def inline_refs(schema: dict) -> dict:
    """``schema`` with each ``$ref`` replaced by the sub-schema it names (the keywords beside a ``$ref``
    are annotations by then: :func:`runtime_outlines.schema_features.check_supported` refuses others)
    and its ``$defs``/``definitions`` dropped. ValueError names a recursive or unresolvable ``$ref``."""
    inliner = _Inliner(schema)
    return inliner.expand(schema, inliner.root_resolver, "#", frozenset(), 0)
