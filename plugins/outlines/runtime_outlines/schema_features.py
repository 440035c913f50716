"""JSON-schema features that outlines-core 0.2.14 gets wrong: refused by name, or given our own regex.

``build_regex_from_schema`` silently ignores many keywords, so a schema using them would constrain
nothing (``multipleOf``, ``uniqueItems``, ``contains``, ``minProperties`` ...), and some it turns
into regexes whose matches are not valid JSON or not valid for the schema: ``allOf`` of two
objects becomes two objects back to back (:mod:`runtime_outlines.schema_merge` merges them), and
``format`` strings use ``\\d`` (any Unicode digit in Rust regex syntax: ``"๐4১௮-06-16"`` was a
``date``), years of any length, optional time zones, and classes such as ``[^\\s:@]`` that let a
``uri`` or ``email`` hold a bare ``"``.

:func:`check_supported` raises ValueError naming the first such feature and where it is;
:func:`format_regex` gives the regex (quotes included) of a ``date``, ``time``, ``date-time``,
``email`` or ``uri`` string, in ASCII, matching only values that RFC 3339 / JSON Schema's format
checkers accept, for :func:`runtime_outlines.numbers.replace_subschemas`, as :func:`pattern_schema`
does for patterns and :func:`enum_schema` for the values an ``enum``/``const`` lists.
"""

from __future__ import annotations

import json
import re
from typing import Any

from runtime_outlines.numbers import subschemas

_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_ATOM = r"[a-z0-9!#$%'*+/=?^_`{|}~-]+"
_LABEL = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
_URI_CHARS = r"[A-Za-z0-9._~!$'()*+,;=:@%/-]"
FORMATS = {
    "date": DATE,
    "time": TIME,
    "date-time": f"{DATE}T{TIME}",
    "email": rf"{_ATOM}(?:\.{_ATOM})*@(?:{_LABEL}\.)+{_LABEL}",
    "uri": (rf"(?:(?:https?|ftp)://(?:[A-Za-z0-9._~-]+(?::[A-Za-z0-9._~-]*)?@)?(?:[A-Za-z0-9.-]+\.[A-Za-z]{{2,}}|localhost)"
            rf"(?::[0-9]{{1,5}})?(?:/{_URI_CHARS}*)?(?:\?(?:{_URI_CHARS}|\?)*)?(?:#(?:{_URI_CHARS}|\?)*)?"
            rf"|urn:[A-Za-z0-9][A-Za-z0-9-]{{0,31}}:{_URI_CHARS}+)"),
}

# Keywords outlines-core ignores: a schema that uses them would not be enforced.
_IGNORED = {
    "multipleOf": "multipleOf",
    "contains": "contains (minContains, maxContains)",
    "minContains": "contains (minContains, maxContains)",
    "maxContains": "contains (minContains, maxContains)",
    "propertyNames": "propertyNames",
    "patternProperties": "patternProperties",
    "if": "if/then/else",
    "then": "if/then/else",
    "else": "if/then/else",
    "dependentRequired": "dependentRequired",
    "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies",
    "not": "not",
}


def format_regex(node: Any) -> str | None:
    """The regex (with its quotes) of a string schema whose ``format`` is in :data:`FORMATS`; None
    for any other schema."""
    if not isinstance(node, dict) or node.get("type") != "string" or {"enum", "const", "pattern"} & set(node):
        return None  # (outlines-core follows a pattern given with a format)
    regex = FORMATS.get(node.get("format"))
    return None if regex is None else f'"{regex}"'


def check_supported(schema: Any, *, keywords_only: bool = False) -> None:
    """Raise ValueError naming the first feature of ``schema`` that the outlines backend would not
    enforce (see the module docstring), and the sub-schema's path. ``keywords_only``: check only the
    keywords refused wherever they are (before $refs are inlined and combinators merged, when a branch
    may still list a required property that its siblings define)."""
    stack = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _keyword_problem(node) if keywords_only else _keyword_problem(node) or _problem(node)
        if problem is not None:
            raise ValueError(f"{problem} (at {path}) is not supported by the outlines guided decoding backend")
        stack.extend((child, f"{path}/{key}") for key, child in subschemas(node))


# Keywords that may stand beside a ``$ref`` without constraining anything (outlines-core follows the
# ``$ref`` alone and drops every other keyword of its schema).
_ANNOTATIONS = {"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title", "description",
                "default", "examples", "deprecated", "readOnly", "writeOnly"}


def _keyword_problem(node: dict) -> str | None:
    for key in ("enum", "anyOf", "oneOf", "type"):
        if node.get(key) == []:
            return f"an empty {key} list (no value can match it)"
    if "$ref" in node:
        beside = sorted(set(node) - _ANNOTATIONS)
        if beside:
            return f"$ref together with {', '.join(beside)} (outlines-core would drop them)"
    if "enum" in node or "const" in node:
        return None  # the listed values are the output, each checked against the rest (enum_schema)
    for key, name in _IGNORED.items():
        if key in node and not _trivial(key, node):
            return name
    return None


def _problem(node: dict) -> str | None:
    if "enum" in node or "const" in node:
        return None
    if node.get("uniqueItems") is True and not (isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1):
        return "uniqueItems"
    for key in ("pattern", "format"):
        if key in node and ("minLength" in node or "maxLength" in node):
            return f"{key} together with minLength/maxLength"
    low, high = node.get("minItems"), node.get("maxItems")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        return "minItems larger than maxItems (no array can match)"
    prefix = node.get("prefixItems")
    if isinstance(prefix, list) and isinstance(node.get("minItems"), int) and node["minItems"] > len(prefix):
        return "minItems larger than the number of prefixItems"
    return _object_problem(node)


def _trivial(key: str, node: dict) -> bool:
    """True where ``node[key]`` constrains nothing (an integer's ``multipleOf: 1``, an empty map)."""
    value = node[key]
    if key == "multipleOf":
        return value == 1 and not isinstance(value, bool) and node.get("type") == "integer"
    if key in ("contains", "minContains", "maxContains", "if", "then", "else", "not"):
        return False
    return value is True or (isinstance(value, dict) and not value)


def _object_problem(node: dict) -> str | None:
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = node.get("required")
    required = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
    for name in properties:
        if any(ch in '"\\' or ord(ch) < 0x20 for ch in name):  # outlines-core writes the name unescaped
            return f"the property name {name!r}, which JSON must escape,"
    missing = [name for name in required if name not in properties]
    if missing:
        return f"required property {missing[0]!r} not listed in properties"
    low = node.get("minProperties")
    if isinstance(low, int) and not isinstance(low, bool) and low > len(set(required)):
        return "minProperties larger than the number of required properties"
    high = node.get("maxProperties")
    if isinstance(high, int) and not isinstance(high, bool) and (not properties or high < len(properties)):
        return "maxProperties smaller than the number of properties"
    return None


# ---------------------------------------------------------------------------- enum and const
def enum_schema(node: Any, validator_class=None) -> dict | None:
    """For :func:`runtime_outlines.numbers.replace_subschemas`: an ``enum``/``const`` schema whose other
    keywords (which outlines-core ignores there, writing every listed value) are applied to the listed
    values with jsonschema (``validator_class``, formats checked too), as ``{"enum": values kept}``;
    ValueError where no value is left; None for any other schema and where every value is kept."""
    if not isinstance(node, dict) or not {"enum", "const"} & set(node):
        return None
    values = node["enum"] if "enum" in node else [node["const"]]
    if not isinstance(values, list):
        return None  # outlines-core names a malformed enum itself
    from jsonschema import Draft202012Validator, SchemaError

    validator_class = validator_class or Draft202012Validator
    try:
        validator_class.check_schema(node)
    except SchemaError as exc:
        raise ValueError(f"the schema of the enum/const {_short_json(values)} is malformed: {exc.message}") from None
    validator = validator_class(node, format_checker=validator_class.FORMAT_CHECKER)
    kept = [value for value in values if validator.is_valid(value)]
    if not kept:
        if "const" in node:
            raise ValueError(f"the const {_short_json(node['const'])} does not satisfy the rest of its schema")
        raise ValueError(f"no value of the enum {_short_json(values)} satisfies the rest of its schema")
    both = "const" in node and "enum" in node  # outlines-core would follow one of them
    return None if len(kept) == len(values) and not both else {"enum": kept}


def _short_json(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:120] + "..."


# ---------------------------------------------------------------------------- string patterns
# What a pattern's ``.`` and negated classes may match inside a JSON string without escaping.
_JSON_UNSAFE = r'"\\\x00-\x1F'


def pattern_schema(node: Any) -> dict | None:
    """For :func:`runtime_outlines.numbers.replace_subschemas`: a string schema whose ``pattern``
    could match ``"``, ``\\`` or a control character (outlines-core writes them into the JSON string
    unescaped: ``.{2}`` gave ``"a""``) with ``.`` and negated classes kept off them, and ``\\d``, ``\\w``,
    ``\\s`` kept to the characters every validator agrees on (:func:`_common_shorthands`); ValueError
    where the pattern names such a character itself; None for any other schema."""
    if not isinstance(node, dict) or not isinstance(node.get("pattern"), str) or {"enum", "const"} & set(node):
        return None
    given = node["pattern"]
    pattern = _common_shorthands(given)
    grouped = _grouped(pattern)
    if not _may_match_unsafe(pattern):
        return None if grouped == given else {**node, "pattern": grouped}
    safe = _exclude_unsafe(pattern)
    if _may_match_unsafe(safe):
        raise ValueError(f"the pattern {given!r} can match '\"', '\\' or a control character, which the outlines "
                         "guided decoding backend cannot escape in a JSON string")
    return {**node, "pattern": _grouped(safe)}


# What ``\d``, ``\w``, ``\s`` match in every validator's regex flavour: ECMA-262's (JSON Schema's: ASCII
# digits and word characters), Python's and Rust's (outlines-core's: Unicode, so ``\w`` wrote "‿", which
# Python's ``\w`` refuses, and ``\d`` "๑"). ``\s`` without the control characters a JSON string escapes.
_SHORTHANDS = {"d": "0-9", "w": "A-Za-z0-9_",
               "s": " \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"}


def _common_shorthands(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\s`` written as the classes of :data:`_SHORTHANDS`, outside
    character classes and inside those not negated (where the Unicode ones exclude more: kept)."""
    out, i, in_class, negated = [], 0, False, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            letter = pattern[i + 1:i + 2]
            if letter in _SHORTHANDS and not negated:
                out.append(_SHORTHANDS[letter] if in_class else f"[{_SHORTHANDS[letter]}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            negated = pattern[i + 1:i + 2] == "^"
            start = i + 1 + negated
            start += pattern[start:start + 1] == "]"  # a leading ] is a literal
            out.append(pattern[i:start])
            in_class, i = True, start
            continue
        if ch == "]" and in_class:
            in_class = negated = False
        out.append(ch)
        i += 1
    return "".join(out)


def _grouped(pattern: str) -> str:
    """``pattern`` with a top-level alternation in one group, each alternative's own ``^``/``$`` dropped:
    outlines-core puts the pattern between the string's quotes as it is, so ``ab|cd`` allowed ``"ab``
    and ``cd"`` (a full match of an alternative also matches the pattern as JSON Schema searches it)."""
    alternatives, depth, start, i = [], 0, 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 1
        elif ch == "[":
            i += 1 + (pattern[i + 1:i + 2] == "^")
            i += pattern[i:i + 1] == "]"  # a leading ] is a literal
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            alternatives.append(pattern[start:i])
            start = i + 1
        i += 1
    if not alternatives:
        return pattern
    alternatives.append(pattern[start:])
    return "(?:" + "|".join(_strip_anchors(alt) for alt in alternatives) + ")"


def _strip_anchors(pattern: str) -> str:
    pattern = pattern[1:] if pattern.startswith("^") else pattern
    if pattern.endswith("$") and (len(pattern) - len(pattern[:-1].rstrip("\\")) - 1) % 2 == 0:
        pattern = pattern[:-1]  # not an escaped \$
    return pattern


def _may_match_unsafe(pattern: str) -> bool:
    """True where an atom of ``pattern`` (a character, escape, class or ``.``) matches a character that a
    JSON string must escape."""
    for atom in _ATOMS.findall(pattern):
        try:
            atom_regex = re.compile(atom)
        except re.error:  # Rust-only syntax (\p{L}): only a negated Unicode class reaches them
            if atom.startswith("\\P"):
                return True
            continue
        if any(atom_regex.fullmatch(ch) for ch in _UNSAFE_CHARS):
            return True
    return False


_UNSAFE_CHARS = ['"', "\\"] + [chr(c) for c in range(0x20)]
_ATOMS = re.compile(r"\\x[0-9A-Fa-f]{2}|\\u[0-9A-Fa-f]{4}|\\x\{[0-9A-Fa-f]+\}|\\[pP]\{[^}]*\}|\\."
                    r"|\[\^?\]?(?:\\.|[^\]])*\]|[^\\\[\]().*+?{}|^$]|\.")


def _exclude_unsafe(pattern: str) -> str:
    """``pattern`` with ``.``, ``\\S``/``\\W``/``\\D`` outside classes and every negated class kept off the
    unsafe characters."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            escape = pattern[i:i + 2]
            out.append(f"[^{escape.lower()}{_JSON_UNSAFE}]" if escape in ("\\S", "\\W", "\\D") else escape)
            i += 2
        elif ch == ".":
            out.append(f"[^{_JSON_UNSAFE}]")
            i += 1
        elif ch == "[":
            end = i + 1 + (pattern[i + 1:i + 2] == "^")
            end += pattern[end:end + 1] == "]"  # a leading ] is a literal
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            body = pattern[i:end]
            out.append(body + _JSON_UNSAFE + "]" if body.startswith("[^") else body + "]")
            i = end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)
