"""``oneOf`` kept exact: outlines-core 0.2.14 compiles it as ``anyOf`` (an alternation), so a value
matching two branches (``1`` for ``[{"type": "integer"}, {"type": "number"}]``, ``{}`` for two objects
with optional fields) was written, and fails the schema. :func:`check_one_of` refuses by name every
``oneOf`` where it cannot prove that nothing the guide writes for one branch is valid under another:
then every output matches exactly one branch, and the alternation is exact.

The proof (:func:`excludes`) uses types (``integer`` lies within ``number``), the values an
``enum``/``const`` lists (checked with jsonschema), numeric ranges, string lengths, array sizes, an
array item written at one position, and for objects the properties the guide writes: every required
one and none that the schema does not list (so a property another branch requires, or gives a
schema apart, tells them apart, as the discriminator of a tagged union does).
"""

from __future__ import annotations

from typing import Any

from runtime_outlines.numbers import bounds_of

_NUMERIC = {"integer": "number", "number": "number"}
_ALL_TYPES = frozenset({"null", "boolean", "string", "array", "object", "number"})
_MAX_POSITIONS = 8  # array positions compared


def check_one_of(branches: list, validator_class, path: str) -> None:
    """Raise ValueError where a value the guide writes for one of the ``oneOf`` ``branches`` (at ``path``)
    may be valid under another branch too."""
    for i, first in enumerate(branches):
        for j in range(i + 1, len(branches)):
            second = branches[j]
            if not (excludes(first, second, validator_class) and excludes(second, first, validator_class)):
                raise ValueError(
                    f"oneOf (at {path}) whose branches {i} and {j} may both match one value: the outlines guided "
                    "decoding backend enforces oneOf only where its branches exclude each other (by type, "
                    "const/enum values, numeric ranges, lengths, or a required property they set apart); "
                    "use anyOf where a value may match several branches"
                )


def excludes(a: Any, b: Any, validator_class) -> bool:
    """True where no value the guide writes for schema ``a`` is valid under schema ``b`` (False where
    that is not proven)."""
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(a.get(key), list):
            return all(excludes(branch, b, validator_class) for branch in a[key])
        if isinstance(b.get(key), list):
            return all(excludes(a, branch, validator_class) for branch in b[key])
    for x, y in ((a, b), (b, a)):
        values = x["enum"] if isinstance(x.get("enum"), list) else [x["const"]] if "const" in x else None
        if values is not None:
            return not any(_valid(x, v, validator_class) and _valid(y, v, validator_class) for v in values)
    checks = {"number": _numbers_apart, "string": _strings_apart, "array": _arrays_apart, "object": _objects_apart}
    for kind in _types(a) & _types(b):
        check = checks.get(kind)
        if check is None or not check(a, b, validator_class):
            return False
    return True


def _valid(schema: dict, value: Any, validator_class) -> bool:
    try:
        return validator_class(schema).is_valid(value)
    except Exception:  # a malformed schema: assume it allows the value
        return True


def _types(node: dict) -> set[str]:
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return set(_ALL_TYPES)
    return {_NUMERIC.get(t, t) for t in types if isinstance(t, str)}


def _ranges_apart(low_a, high_a, low_b, high_b) -> bool:
    """Ranges of ``(value, exclusive)`` bounds (None: unbounded) that share no value."""
    def below(high, low) -> bool:
        if high is None or low is None:
            return False
        return high[0] < low[0] or high[0] == low[0] and (high[1] or low[1])
    return below(high_a, low_b) or below(high_b, low_a)


def _numbers_apart(a: dict, b: dict, _) -> bool:
    try:
        (low_a, high_a), (low_b, high_b) = bounds_of(a), bounds_of(b)
    except ValueError:
        return False
    return _ranges_apart(low_a, high_a, low_b, high_b)


def _count_range(node: dict, low_key: str, high_key: str):
    low, high = node.get(low_key), node.get(high_key)
    low = (low, False) if isinstance(low, int) and not isinstance(low, bool) else None
    high = (high, False) if isinstance(high, int) and not isinstance(high, bool) else None
    return low, high


def _strings_apart(a: dict, b: dict, _) -> bool:
    return _ranges_apart(*_count_range(a, "minLength", "maxLength"), *_count_range(b, "minLength", "maxLength"))


def _arrays_apart(a: dict, b: dict, validator_class) -> bool:
    if _ranges_apart(*_count_range(a, "minItems", "maxItems"), *_count_range(b, "minItems", "maxItems")):
        return True
    written = min(_min_count(a), _MAX_POSITIONS)  # items at these positions are always written
    return any(excludes(_item(a, i), _item(b, i), validator_class) for i in range(written))


def _min_count(node: dict) -> int:
    low = node.get("minItems")
    low = low if isinstance(low, int) and not isinstance(low, bool) else 0
    prefix = node.get("prefixItems")  # outlines-core writes every prefix item
    return max(low, len(prefix)) if isinstance(prefix, list) else low


def _item(node: dict, position: int) -> Any:
    prefix = node.get("prefixItems")
    if isinstance(prefix, list) and position < len(prefix):
        return prefix[position]
    items = node.get("items", True)
    return items if isinstance(items, (dict, bool)) else True


def _objects_apart(a: dict, b: dict, validator_class) -> bool:
    """No object the guide writes for ``a`` is valid under ``b``: ``b`` requires a property that ``a`` never
    writes, or ``a`` always writes one whose value ``b`` forbids or gives a schema apart."""
    written = _written_names(a)
    if written is not None and any(name not in written for name in _required(b)):
        return True
    return any(excludes(_property(a, name), _property(b, name), validator_class) for name in _required(a))


def _written_names(node: dict) -> set[str] | None:
    """The property names the guide may write for ``node``; None: any (an object of any fields)."""
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    if properties or node.get("additionalProperties") is False:
        return set(properties)  # outlines-core writes only the properties listed
    return None


def _required(node: dict) -> list[str]:
    required = node.get("required")
    return [name for name in required if isinstance(name, str)] if isinstance(required, list) else []


def _property(node: dict, name: str) -> Any:
    """The schema a property ``name`` of an object valid under ``node`` meets (False: forbidden)."""
    properties = node.get("properties")
    if isinstance(properties, dict) and name in properties:
        return properties[name]
    if node.get("patternProperties"):
        return True  # not worked out: allows anything
    return node.get("additionalProperties", True)
