"""Combinators and boolean sub-schemas rewritten into schemas outlines-core 0.2.14 follows exactly
(:func:`normalize`, on a schema whose ``$ref`` are inlined).

outlines-core follows an ``allOf`` of one sub-schema and drops the keywords beside it
(``{"type": "integer", "maximum": 5, "allOf": [{"minimum": 0}]}`` gave ``-84``), makes
``anyOf``/``oneOf`` an alternation of their branches alone (``{"maxLength": 3, "oneOf": [...]}`` gave
``"abcdef"``), and refuses ``true``/``false`` sub-schemas. Here the keywords beside a combinator go
into each of its branches, the sub-schemas of an ``allOf`` are merged into one schema (where their
keywords can be merged exactly; otherwise ValueError names them), ``true`` becomes ``{}``, a
``false`` property is left out, ``prefixItems`` longer than ``maxItems`` are cut to it, and
``unevaluatedProperties``/``unevaluatedItems`` (ignored by outlines-core: ``{"type": "array",
"unevaluatedItems": false}`` gave ``[-534, 7]``) become the ``additionalProperties``/``items`` they
amount to. Each ``oneOf`` is then checked by :mod:`runtime_outlines.schema_oneof`.
"""

from __future__ import annotations

from typing import Any, Callable

from runtime_outlines.numbers import subschemas
from runtime_outlines.schema_features import enum_schema
from runtime_outlines.schema_oneof import check_one_of

# Keywords that constrain nothing (they may differ between merged schemas; the first one is kept).
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "$anchor", "discriminator", "nullable"})
# Keywords whose meaning depends on the others of their group in the same schema: merged only as a whole.
_GROUPS = (
    frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"}),
    frozenset({"prefixItems", "items", "additionalItems", "unevaluatedItems"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"if", "then", "else"}),
)
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_COMBINATORS = ("anyOf", "oneOf")
DROP = object()  # see map_subschemas


def map_subschemas(node: dict, function: Callable[[str, Any], Any]) -> dict:
    """A copy of ``node`` with each direct sub-schema (see :func:`runtime_outlines.numbers.subschemas`)
    replaced by ``function(key, sub)``; ``DROP`` leaves a list item or map entry out."""
    out = dict(node)
    copied: set[str] = set()  # the lists and maps of sub-schemas copied into ``out``
    for key, child in subschemas(node):
        value = function(key, child)
        name, _, rest = key.partition("/")
        if not rest:
            out[name] = value
            continue
        if name not in copied:
            out[name] = list(node[name]) if isinstance(node[name], list) else dict(node[name])
            copied.add(name)
        if isinstance(out[name], list):
            out[name][int(rest)] = value
        else:
            out[name][rest] = value
    for name in copied:
        if isinstance(out[name], list):
            out[name] = [item for item in out[name] if item is not DROP]
        else:
            out[name] = {k: v for k, v in out[name].items() if v is not DROP}
    return out


# ---------------------------------------------------------------------------- merging (allOf)
def merge(a: Any, b: Any, what: str) -> Any:
    """One schema of the values that both ``a`` and ``b`` allow; ValueError (naming ``what``) where
    their keywords cannot be merged exactly."""
    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise ValueError(f"{what} with a sub-schema that is not a JSON object or boolean: {_short(b)}")
    for group in _GROUPS:
        in_a, in_b = group & set(a), group & set(b)
        if in_a and in_b and not in_a == in_b == {"properties"} and any(a.get(k) != b.get(k) for k in group):
            raise ValueError(f"{what} whose sub-schemas both set {', '.join(sorted(in_a | in_b))}")
    if _draft4_bounds(a) or _draft4_bounds(b):
        for side in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if any(k in a for k in side) and any(k in b for k in side) and any(a.get(k) != b.get(k) for k in side):
                raise ValueError(f"{what} whose sub-schemas both set {' / '.join(side)}")
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif key not in ANNOTATIONS and not _same(out[key], value):
            out[key] = _merge_values(key, out[key], value, what)
    return out


def _merge_values(key: str, mine: Any, theirs: Any, what: str) -> Any:
    if key == "type":
        return _common_types(mine, theirs, what)
    if key == "required" and isinstance(mine, list) and isinstance(theirs, list):
        return list(dict.fromkeys(mine + theirs))
    if key == "properties" and isinstance(mine, dict) and isinstance(theirs, dict):
        out = dict(mine)
        for name, sub in theirs.items():
            out[name] = merge(out[name], sub, what) if name in out else sub
        return out
    if _is_number(mine) and _is_number(theirs) and key in _LOWER_BOUNDS + _UPPER_BOUNDS:
        return max(mine, theirs) if key in _LOWER_BOUNDS else min(mine, theirs)
    raise ValueError(f"{what} whose sub-schemas set {key} to different values ({_short(mine)} and {_short(theirs)})")


def _common_types(mine: Any, theirs: Any, what: str) -> Any:
    mine = [mine] if isinstance(mine, str) else mine
    theirs = [theirs] if isinstance(theirs, str) else theirs
    if not isinstance(mine, list) or not isinstance(theirs, list):
        raise ValueError(f"{what} whose sub-schemas give a malformed type")
    common = [t for t in mine if t in theirs or t == "integer" and "number" in theirs]
    common += [t for t in theirs if t == "integer" and "number" in mine and t not in common]
    if not common:
        raise ValueError(f"{what} whose sub-schemas allow no common type ({_short(mine)} and {_short(theirs)})")
    return common[0] if len(common) == 1 else common


def _draft4_bounds(node: dict) -> bool:
    return isinstance(node.get("exclusiveMinimum"), bool) or isinstance(node.get("exclusiveMaximum"), bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(a: Any, b: Any) -> bool:
    return a == b and type(a) is type(b)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


# ---------------------------------------------------------------------------- normalizing
def normalize(schema: Any, validator_class, path: str = "#") -> Any:
    """``schema`` (no ``$ref`` left) rewritten as the module docstring says; ValueError names what
    cannot be rewritten exactly, and each ``oneOf`` whose branches may overlap."""
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        return schema
    node = _merge_all_of(schema, path)
    node = _distribute(node, validator_class, path)
    node = _plain_keywords(node, path)
    node = map_subschemas(node, lambda key, child: _child(node, key, child, validator_class, path))
    if "oneOf" in node:
        check_one_of(node["oneOf"], validator_class, f"{path}/oneOf")
    return node


def _plain_keywords(node: dict, path: str) -> dict:
    """``unevaluatedProperties``/``unevaluatedItems`` (outlines-core ignores them) as the
    ``additionalProperties``/``items`` they amount to in a schema without combinators, boolean ``items``
    as array sizes, and ``prefixItems`` cut to ``maxItems`` (outlines-core writes every prefix item)."""
    node = dict(node)
    for unevaluated, plain in (("unevaluatedProperties", "additionalProperties"), ("unevaluatedItems", "items")):
        if unevaluated in node:
            node.setdefault(plain, node.pop(unevaluated))  # beside ``plain``, nothing is left unevaluated
    items = node.get("items")
    if isinstance(items, bool) and "prefixItems" not in node:
        del node["items"]
        if items is False:  # no item at all
            low = node.get("minItems")
            if _is_number(low) and low > 0:
                raise ValueError(f"items false with minItems {low} (at {path}): no array can match")
            node["maxItems"] = 0
    prefix, high = node.get("prefixItems"), node.get("maxItems")
    if isinstance(prefix, list) and _is_number(high) and high < len(prefix):
        node["prefixItems"] = prefix[:max(int(high), 0)]
        if not node["prefixItems"]:
            del node["prefixItems"]
            node["maxItems"] = 0
    return node


def _child(node: dict, key: str, child: Any, validator_class, path: str) -> Any:
    if child is False:
        name = key.partition("/")[2]
        if key.startswith("properties/"):
            required = node.get("required")
            if isinstance(required, list) and name in required:
                raise ValueError(f"the required property {name!r} has the schema false (at {path}/{key}): "
                                 "no value can match it")
            return DROP  # never written: outlines-core writes only the properties listed
        if key.startswith(_COMBINATORS):
            return DROP
        raise ValueError(f"the sub-schema false (at {path}/{key}) is not supported by the outlines guided decoding "
                         "backend")
    return normalize(child, validator_class, f"{path}/{key}")


def _merge_all_of(node: dict, path: str) -> dict:
    while isinstance(node.get("allOf"), list):
        parts = node["allOf"]
        merged: Any = {k: v for k, v in node.items() if k != "allOf"}
        for part in parts:
            merged = merge(merged, part, f"allOf (at {path})")
        if merged is False:
            raise ValueError(f"allOf with the sub-schema false (at {path}): no value can match it")
        node = merged
    return node


def _may_match(branch: dict, validator_class) -> bool:
    try:
        enum_schema(branch, validator_class)
    except ValueError:  # an enum/const of values the rest of the branch refuses
        return False
    return True


def _distribute(node: dict, validator_class, path: str) -> dict:
    """The keywords beside an ``anyOf``/``oneOf`` moved into each of its branches; branches that list
    values none of which the keywords allow are left out."""
    present = [key for key in _COMBINATORS if isinstance(node.get(key), list)]
    if not present:
        return node
    if len(present) > 1:
        raise ValueError(f"anyOf together with oneOf (at {path}) is not supported by the outlines guided decoding "
                         "backend")
    (key,) = present
    beside = {k: v for k, v in node.items() if k not in ANNOTATIONS and k != key}
    if not beside:
        return node
    what = f"{key} (at {path}) with keywords beside it"
    branches = [merge(beside, branch, what) for branch in node[key] if branch is not False]
    branches = [branch for branch in branches if _may_match(branch, validator_class)]
    if not branches:
        raise ValueError(f"{key} with only false sub-schemas (at {path}): no value can match it")
    return {**{k: v for k, v in node.items() if k in ANNOTATIONS}, key: branches}
