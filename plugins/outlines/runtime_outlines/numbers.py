"""Bounded JSON numbers: ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum``
of ``integer`` and ``number`` schemas as regular expressions.

outlines-core 0.2.14's ``build_regex_from_schema`` ignores numeric bounds, so the backend swaps
every bounded integer/number sub-schema for a placeholder string constant before calling it
(:func:`replace_bounded_numbers`), and then substitutes each placeholder's literal in the
produced regex by the regex of :func:`number_range_regex`.

What the regexes match (every match lies within the bounds; see the tests):

* ``integer``: exactly the integers within the bounds, in JSON's form: an optional ``-``, no
  leading zeros, never ``-0``, no fraction or exponent.
* ``number``: every decimal within the bounds with at most :data:`MAX_FRACTION_DIGITS` digits
  after the point (``3``, ``-0.25``, ``1.50``), integers included. No exponents. Trailing zeros
  in the fraction are allowed, ``-0`` and ``-0.0`` are not produced.
* A missing side is unbounded: ``{"minimum": 0}`` allows ``0``, ``7``, ``123456789...`` of any
  length.

``multipleOf`` is not enforced (outlines-core ignores it too). Bounds must be JSON numbers
(draft-4 boolean ``exclusiveMinimum``/``exclusiveMaximum`` next to ``minimum``/``maximum`` are
understood); anything else, or bounds that no value satisfies, raise ValueError.

The regexes are in the common subset of Rust (outlines-core) and Python regex syntax. Because
outlines-core's automaton has leftmost-first semantics (an alternative that has completed a
match cuts off lower-priority alternatives that would go on, where nothing follows), every
alternation lists longer integer parts first and optional parts are greedy.
"""

from __future__ import annotations

import math
import secrets
from fractions import Fraction
from typing import Any

MAX_FRACTION_DIGITS = 6

BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
NUMERIC_TYPES = ("integer", "number")

# Keywords whose value is one sub-schema, a list of sub-schemas, or a name -> sub-schema map.
_SCHEMA_KEYS = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# ---------------------------------------------------------------------------- bounds
def _as_fraction(value: Any, key: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the JSON schema's {key} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"the JSON schema's {key} must be finite, got {value!r}")
    # A float bound means the decimal the schema wrote (0.1 is 1/10, not the binary double
    # next to it): "0.1" then meets minimum 0.1, as validators comparing doubles agree.
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def bounds_of(schema: dict) -> tuple[tuple[Fraction, bool] | None, tuple[Fraction, bool] | None]:
    """``(lower, upper)`` of a schema, each ``(value, exclusive)`` or None; the tighter one where
    both an inclusive and an exclusive bound are given."""

    def side(inclusive_key: str, exclusive_key: str, tighter) -> tuple[Fraction, bool] | None:
        found = []
        exclusive = schema.get(exclusive_key)
        if exclusive is True or exclusive is False:  # draft 4: a flag on minimum/maximum
            if inclusive_key in schema:
                found.append((_as_fraction(schema[inclusive_key], inclusive_key), exclusive))
            elif exclusive:
                raise ValueError(f"the JSON schema's {exclusive_key}: true needs a {inclusive_key}")
        else:
            if inclusive_key in schema:
                found.append((_as_fraction(schema[inclusive_key], inclusive_key), False))
            if exclusive is not None:
                found.append((_as_fraction(exclusive, exclusive_key), True))
        if not found:
            return None
        return tighter(found)

    # Lower: the larger value wins; at equal values the exclusive one.
    lower = side("minimum", "exclusiveMinimum", lambda f: max(f, key=lambda b: (b[0], b[1])))
    upper = side("maximum", "exclusiveMaximum", lambda f: min(f, key=lambda b: (b[0], -b[1])))
    return lower, upper


def scaled_range(lower, upper, fraction_digits: int) -> tuple[int | None, int | None]:
    """The bounds in units of ``10**-fraction_digits``: the smallest and largest such multiples
    within the bounds (None: unbounded)."""
    scale = 10**fraction_digits
    lo = hi = None
    if lower is not None:
        value, exclusive = lower
        lo = math.floor(value * scale) + 1 if exclusive else math.ceil(value * scale)
    if upper is not None:
        value, exclusive = upper
        hi = math.ceil(value * scale) - 1 if exclusive else math.floor(value * scale)
    return lo, hi


# ---------------------------------------------------------------------------- regexes
def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"


def _digit_class(low: int, high: int) -> str:
    if low == high:
        return str(low)
    if low == 0 and high == 9:
        return "[0-9]"
    return f"[{low}-{high}]"


def _repeat(atom: str, low: int, high: int | None) -> str:
    """``atom`` repeated ``low`` to ``high`` (None: unbounded) times."""
    if high is None:
        return atom + ("*" if low == 0 else "+" if low == 1 else f"{{{low},}}")
    if high == 0:
        return ""
    if low == high:
        return atom if low == 1 else f"{atom}{{{low}}}"
    if (low, high) == (0, 1):
        return atom + "?"
    return f"{atom}{{{low},{high}}}"


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives matching the digit strings of ``len(low) == len(high)`` digits from ``low``
    to ``high`` (as numbers, leading zeros and all)."""
    n = len(low)
    if low == high:
        return [low]
    if low == "0" * n and high == "9" * n:
        return [_repeat("[0-9]", n, n)]
    first_low, first_high = int(low[0]), int(high[0])
    if n == 1:
        return [_digit_class(first_low, first_high)]
    rest = n - 1
    if first_low == first_high:
        return [low[0] + _group(_same_length(low[1:], high[1:]))]
    out = []
    start, end = first_low, first_high
    if low[1:] != "0" * rest:
        out.append(low[0] + _group(_same_length(low[1:], "9" * rest)))
        start += 1
    tail = None
    if high[1:] != "9" * rest:
        tail = high[0] + _group(_same_length("0" * rest, high[1:]))
        end -= 1
    if start <= end:
        out.append(_digit_class(start, end) + _repeat("[0-9]", rest, rest))
    if tail is not None:
        out.append(tail)
    return out


def natural_range(low: int, high: int | None) -> list[str]:
    """Alternatives matching the decimal forms (no leading zeros) of the integers ``low`` to
    ``high`` (``0 <= low``; None: unbounded), longer numbers first."""
    if low < 0 or (high is not None and high < low):
        raise ValueError(f"bad natural range {low}..{high}")
    out: list[str] = []
    low_digits = len(str(low))
    if high is None:
        # Everything longer than low, then low's own length.
        out.append("[1-9]" + _repeat("[0-9]", low_digits, None))
        top_digits = low_digits
        high_same = 10**low_digits - 1
    else:
        top_digits = len(str(high))
        high_same = high
    for digits in range(top_digits, low_digits - 1, -1):
        first = 10 ** (digits - 1) if digits > 1 else 0
        last = 10**digits - 1
        a, b = max(low, first), min(high_same, last)
        if a <= b:
            out.extend(_same_length(str(a), str(b)))
    return out


def _fraction_alternatives(low: str, high: str) -> list[str]:
    """Alternatives matching the non-empty digit strings ``s`` of at most ``len(low)`` digits
    whose value as a fraction (``0.s``) lies from ``0.low`` to ``0.high`` (same length)."""
    m = len(low)
    if low == "0" * m and high == "9" * m:
        return [_repeat("[0-9]", 1, m)]
    rest = m - 1

    def then(low_rest: str, high_rest: str) -> str:
        # The digits after the first: none (when allowed) or a non-empty string in range.
        if rest == 0:
            return ""
        inner = _group(_fraction_alternatives(low_rest, high_rest))
        if low_rest == "0" * rest:  # an empty rest is 0.d000..., within range
            return f"(?:{inner})?"
        return inner

    first_low, first_high = int(low[0]), int(high[0])
    if first_low == first_high:
        return [low[0] + then(low[1:], high[1:])]
    out = [low[0] + then(low[1:], "9" * rest)]
    if first_high - first_low > 1:
        out.append(_digit_class(first_low + 1, first_high - 1) + _repeat("[0-9]", 0, rest))
    out.append(high[0] + then("0" * rest, high[1:]))
    return out


def _fraction_regex(low: int, high: int, digits: int) -> tuple[str, bool]:
    """``(regex, optional)``: the fraction (``\\.`` and digits) of a decimal whose fraction in
    units of ``10**-digits`` lies from ``low`` to ``high``; ``optional`` when no fraction at all
    (the integer) is within that range too."""
    alternatives = _fraction_alternatives(str(low).zfill(digits), str(high).zfill(digits))
    return r"\." + _group(alternatives), low == 0


def _with_fraction(integer: str, fraction: tuple[str, bool]) -> str:
    regex, optional = fraction
    return f"{integer}(?:{regex})?" if optional else integer + regex


def nonnegative_decimal(low: int, high: int | None, digits: int) -> list[str]:
    """Alternatives for the non-negative decimals from ``low`` to ``high`` (in units of
    ``10**-digits``; None: unbounded) with at most ``digits`` fraction digits, longer integer
    parts first."""
    scale = 10**digits
    int_low, frac_low = divmod(low, scale)
    if high is not None:
        int_high, frac_high = divmod(high, scale)
    if digits == 0:
        return natural_range(low, high)
    if high is not None and int_low == int_high:
        return [_with_fraction(str(int_low), _fraction_regex(frac_low, frac_high, digits))]
    any_fraction = (r"\." + _repeat("[0-9]", 1, digits), True)
    out = []
    middle_low = int_low if frac_low == 0 else int_low + 1
    middle_high = None if high is None else (int_high if frac_high == scale - 1 else int_high - 1)
    if high is not None and frac_high != scale - 1:  # the largest integer part, first
        out.append(_with_fraction(str(int_high), _fraction_regex(0, frac_high, digits)))
    if middle_high is None or middle_low <= middle_high:
        out.extend(_with_fraction(alt, any_fraction) for alt in natural_range(middle_low, middle_high))
    if frac_low != 0:  # the smallest integer part, last (it needs a fraction)
        out.append(_with_fraction(str(int_low), _fraction_regex(frac_low, scale - 1, digits)))
    return out


def decimal_range_regex(low: int | None, high: int | None, digits: int) -> str:
    """The regex of the decimals from ``low`` to ``high`` (in units of ``10**-digits``, None:
    unbounded) with at most ``digits`` fraction digits, in JSON's form (see the module doc)."""
    if low is not None and high is not None and low > high:
        raise ValueError("empty range")
    out = []
    if high is None or high >= 0:
        out.extend(nonnegative_decimal(max(low, 0) if low is not None else 0, high, digits))
    if low is None or low < 0:
        # Negative values: '-' and the magnitude, at least one unit (no -0, no -0.0).
        magnitude_low = max(-high, 1) if high is not None else 1
        negatives = nonnegative_decimal(magnitude_low, -low if low is not None else None, digits)
        out.append("-" + _group(negatives))
    return _group(out)


def number_range_regex(schema: dict, fraction_digits: int = MAX_FRACTION_DIGITS) -> str:
    """The regex of the values of a bounded ``integer`` or ``number`` schema (its ``type`` says
    which; ``number`` when it has both). ValueError when no value satisfies the bounds."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or ())
    digits = fraction_digits if "number" in types else 0
    lower, upper = bounds_of(schema)
    low, high = scaled_range(lower, upper, digits)
    if low is not None and high is not None and low > high:
        what = "integer" if digits == 0 else f"number with at most {digits} fraction digits"
        raise ValueError(f"no {what} satisfies the JSON schema's bounds {_describe(schema)}")
    return decimal_range_regex(low, high, digits)


def _describe(schema: dict) -> str:
    return "{" + ", ".join(f"{k}: {schema[k]!r}" for k in BOUND_KEYS if k in schema) + "}"


# ---------------------------------------------------------------------------- schema rewriting
def is_bounded_number(schema: Any) -> bool:
    """A schema whose type is integer/number (or a list holding one), with a bound, and without
    enum/const (those already list the allowed values)."""
    if not isinstance(schema, dict) or "enum" in schema or "const" in schema:
        return False
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not any(t in NUMERIC_TYPES for t in types):
        return False
    return any(k in schema for k in BOUND_KEYS)


def bounded_number_regex(node: Any) -> str | dict | None:
    """For :func:`replace_subschemas`: the regex of a bounded integer/number schema; for one
    whose type also allows other types (``["integer", "null"]``) an ``anyOf`` of the numeric
    part and the other types; None for any other schema."""
    if not is_bounded_number(node):
        return None
    types = node["type"]
    if isinstance(types, str) or all(t in NUMERIC_TYPES for t in types):
        return number_range_regex(node)
    numeric = [t for t in types if t in NUMERIC_TYPES]
    kept = {k: v for k, v in node.items() if k not in BOUND_KEYS and k != "type"}
    return {"anyOf": [{**node, "type": numeric}] + [{**kept, "type": t} for t in types if t not in NUMERIC_TYPES]}


def replace_subschemas(schema: Any, regex_for, used_text: str = "") -> tuple[Any, dict[str, str]]:
    """A copy of ``schema`` where every sub-schema (the root, properties, items, prefixItems,
    anyOf/oneOf/allOf branches, $defs/definitions, additionalProperties, ...) for which
    ``regex_for(sub)`` gives a regex is replaced by a placeholder ``{"const": "<token>"}``
    (a dict answer replaces the sub-schema and is rewritten in turn), and ``{token: regex}``.
    Tokens are letters and digits, unique, and absent from ``used_text``; outlines-core writes
    the placeholder as the literal ``"<token>"`` (quotes included) in its regex."""
    nonce = secrets.token_hex(4)
    while nonce in used_text:
        nonce = secrets.token_hex(4)
    regexes: dict[str, str] = {}

    def rewrite(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        found = regex_for(node)
        if isinstance(found, str):
            token = f"RTSUB{nonce}x{len(regexes)}Q"
            regexes[token] = found
            return {"const": token}
        if isinstance(found, dict):
            node = found
        out = dict(node)
        for key in _SCHEMA_KEYS:
            if isinstance(out.get(key), dict):
                out[key] = rewrite(out[key])
        for key in _SCHEMA_LIST_KEYS:
            if isinstance(out.get(key), list):
                out[key] = [rewrite(item) for item in out[key]]
        for key in _SCHEMA_MAP_KEYS:
            if isinstance(out.get(key), dict):
                out[key] = {name: rewrite(sub) for name, sub in out[key].items()}
        return out

    return rewrite(schema), regexes


def subschema_depth(schema: Any) -> int:
    """Levels of sub-schemas in ``schema`` (the root alone: 1), through the keys that
    :func:`replace_subschemas` follows; ``$ref`` targets are not followed. Iterative, so a
    schema nested thousands deep is measured rather than overflowing the stack."""
    deepest, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for _, child in subschemas(node))
    return deepest


def subschemas(node: dict) -> list[tuple[str, Any]]:
    """``(path, sub-schema)`` of each direct sub-schema of ``node`` (``"items"``, ``"anyOf/0"``,
    ``"properties/name"``), through the keys that :func:`replace_subschemas` follows."""
    children = [(key, node[key]) for key in _SCHEMA_KEYS if isinstance(node.get(key), dict)]
    children += [(f"{key}/{i}", item) for key in _SCHEMA_LIST_KEYS if isinstance(node.get(key), list)
                 for i, item in enumerate(node[key])]
    children += [(f"{key}/{name}", sub) for key in _SCHEMA_MAP_KEYS if isinstance(node.get(key), dict)
                 for name, sub in node[key].items()]
    return children
