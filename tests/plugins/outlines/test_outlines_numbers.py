"""Bounded integers and numbers (minimum / maximum / exclusive bounds), which outlines-core
0.2.14 ignores: the range regexes against Python ``re`` on random values (hypothesis), walks
through compiled grammars validated by jsonschema, and the schema rewrite's reach."""

from __future__ import annotations

import json
import math
import random
import re
from fractions import Fraction

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.structured_output import GuidedKind
from runtime_outlines.numbers import MAX_FRACTION_DIGITS, number_range_regex

from test_outlines_grammar import completed_text, walk


def exact(value) -> Fraction:
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def within(value: Fraction, schema: dict) -> bool:
    """Within the bounds, read as the decimals the schema writes; also as doubles (jsonschema)."""
    as_double = float(value)
    for key, holds in (("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b),
                       ("exclusiveMinimum", lambda v, b: v > b), ("exclusiveMaximum", lambda v, b: v < b)):
        if key in schema and not (holds(value, exact(schema[key])) and holds(as_double, float(schema[key]))):
            return False
    return True


def decimal_text(units: int, digits: int) -> str:
    """``units * 10**-digits`` written with exactly ``digits`` fraction digits (JSON form)."""
    sign = "-" if units < 0 else ""
    whole, frac = divmod(abs(units), 10**digits)
    return f"{sign}{whole}" + (f".{frac:0{digits}d}" if digits else "")


def canonical(text: str) -> bool:
    """JSON's number form without exponent, and not negative zero."""
    return bool(re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", text)) and not re.fullmatch(r"-0(\.0*)?", text)


# Bounds: None, a small integer, a large integer, or a decimal with a few fraction digits.
small_int = st.integers(-1200, 1200)
bound = st.one_of(st.none(), small_int, st.integers(-10**12, 10**12),
                  st.builds(lambda n, d: float(Fraction(n, 10**d)), st.integers(-10**5, 10**5), st.integers(1, 8)))


def schema_of(kind: str, lower, upper, lower_exclusive: bool, upper_exclusive: bool) -> dict:
    schema = {"type": kind}
    if lower is not None:
        schema["exclusiveMinimum" if lower_exclusive else "minimum"] = lower
    if upper is not None:
        schema["exclusiveMaximum" if upper_exclusive else "maximum"] = upper
    return schema


def values_around(schema: dict, rng: random.Random, count: int = 150) -> list[Fraction]:
    points = [exact(schema[k]) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema]
    points = points or [Fraction(0)]
    values = []
    for _ in range(count):
        center = rng.choice(points)
        spread = rng.choice([1, 3, 30, 1000, 10**7])
        values.append(center + Fraction(rng.randint(-spread * 10**6, spread * 10**6), 10**6))
    return values


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["integer", "number"]), lower=bound, upper=bound, lower_exclusive=st.booleans(),
       upper_exclusive=st.booleans(), seed=st.integers(0, 2**32))
def test_range_regex_is_sound_and_complete(kind, lower, upper, lower_exclusive, upper_exclusive, seed):
    schema = schema_of(kind, lower, upper, lower_exclusive, upper_exclusive)
    try:
        regex = re.compile(number_range_regex(schema))
    except ValueError as exc:
        assert "satisfies" in str(exc)
        digits = MAX_FRACTION_DIGITS if kind == "number" else 0
        # Truly empty at this precision: the smallest multiples of 10**-digits from the lower
        # bound on (the first one within the bounds, if any) are all outside.
        assert lower is not None and upper is not None
        start = math.floor(exact(lower) * 10**digits) - 2
        assert not any(within(Fraction(start + k, 10**digits), schema) for k in range(6))
        return
    rng = random.Random(seed)
    digits_choices = [0] if kind == "integer" else list(range(0, MAX_FRACTION_DIGITS + 3))
    for value in values_around(schema, rng):
        for digits in {0, rng.choice(digits_choices)}:
            units = round(value * 10**digits)
            text = decimal_text(units, digits)
            matched = bool(regex.fullmatch(text))
            written = Fraction(units, 10**digits)
            if matched:  # sound: every match is a canonical number within the bounds
                assert canonical(text) and within(written, schema), (schema, text)
            elif canonical(text) and within(written, schema) and digits <= (MAX_FRACTION_DIGITS if kind == "number" else 0):
                pytest.fail(f"{text} is within {schema} but not matched")  # complete up to 6 fraction digits
    for text in ["-0", "-0.0", "00", "01", "1e3", "1.", ".5", "+1", " 1", "1 ", "--1", "1.0000000"]:
        assert not regex.fullmatch(text), (schema, text)


def test_small_integer_ranges_exactly():
    for low in range(-25, 26, 3):
        for high in range(low, 130, 7):
            regex = re.compile(number_range_regex({"type": "integer", "minimum": low, "maximum": high}))
            matched = {n for n in range(-200, 300) if regex.fullmatch(str(n))}
            assert matched == set(range(low, high + 1)), (low, high)
    regex = re.compile(number_range_regex({"type": "integer", "minimum": 0}))
    assert all(regex.fullmatch(str(n)) for n in [0, 9, 10, 99, 100, 12345678901234567890])
    assert not any(regex.fullmatch(str(n)) for n in [-1, -10])
    regex = re.compile(number_range_regex({"type": "integer", "exclusiveMaximum": -3}))
    assert all(regex.fullmatch(str(n)) for n in [-4, -10, -99, -1000, -987654321])
    assert not any(regex.fullmatch(str(n)) for n in [-3, -2, 0, 5])


def test_fractional_bounds_and_draft4_flags():
    regex = re.compile(number_range_regex({"type": "number", "minimum": 0.25, "maximum": 1.5}))
    assert all(regex.fullmatch(t) for t in ["0.25", "0.3", "0.999999", "1", "1.0", "1.5", "1.500"])
    assert not any(regex.fullmatch(t) for t in ["0.2", "0.249999", "1.5000001", "1.6", "2", "0"])
    regex = re.compile(number_range_regex({"type": "integer", "minimum": 0.5, "maximum": 3.5}))
    assert [n for n in range(-2, 6) if regex.fullmatch(str(n))] == [1, 2, 3]
    regex = re.compile(number_range_regex({"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3}))
    assert [n for n in range(-2, 6) if regex.fullmatch(str(n))] == [1, 2, 3]


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer satisfies"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "no integer satisfies"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "no integer satisfies"),
    ({"type": "number", "minimum": 0.0000001, "maximum": 0.0000009}, "no number with at most 6 fraction digits"),
    ({"type": "integer", "minimum": "0"}, "minimum must be a number"),
    ({"type": "number", "maximum": True}, "maximum must be a number"),
    ({"type": "number", "exclusiveMaximum": True}, "needs a maximum"),
])
def test_unsatisfiable_or_bad_bounds_raise(smollm2_backend, schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        number_range_regex(schema)
    with pytest.raises(ValueError, match="unsupported or invalid JSON schema: .*" + re.escape(message)):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps({"type": "object", "properties": {"x": schema}}))


# ---------------------------------------------------------------------------- the schema rewrite
BOUNDED = {"type": "integer", "minimum": 0, "maximum": 120}
REACH = {
    "type": "object",
    "$defs": {"pct": {"type": "number", "minimum": 0, "maximum": 100}},
    "definitions": {"small": {"type": "integer", "minimum": -3, "maximum": 3}},
    "properties": {
        "age": BOUNDED,
        "ages": {"type": "array", "items": BOUNDED, "maxItems": 3},
        "pair": {"type": "array", "prefixItems": [BOUNDED, {"type": "integer", "minimum": 5, "maximum": 6}],
                 "minItems": 2, "maxItems": 2},
        "either": {"anyOf": [BOUNDED, {"type": "string", "maxLength": 3}]},
        "one": {"oneOf": [{"type": "integer", "minimum": 1000, "maximum": 1001}, {"type": "boolean"}]},
        "all": {"allOf": [BOUNDED]},
        "pct": {"$ref": "#/$defs/pct"},
        "small": {"$ref": "#/definitions/small"},
        "maybe": {"type": ["integer", "null"], "minimum": 1, "maximum": 2},
        "map": {"type": "object", "additionalProperties": BOUNDED},
        "free": {"type": "integer"},
        "level": {"enum": [1, 2.5, 300]},
        "version": {"const": 2018},
        "capped_enum": {"type": "integer", "minimum": 0, "maximum": 5, "enum": [3, 7]},  # 7: out of bounds
    },
}


def test_rewrite_reaches_every_place(smollm2_backend):
    regex = re.compile(smollm2_backend.to_regex(GuidedKind.JSON, json.dumps(REACH)))
    assert "RTSUB" not in regex.pattern

    def ok(**fields):
        return bool(regex.fullmatch(json.dumps(fields, separators=(",", ":"))))

    good = dict(age=120, ages=[0, 7], pair=[3, 5], either=99, one=1001, all=1, pct=99.5, small=-3, maybe=None,
                free=-123456, level=300, version=2018, capped_enum=3)
    assert ok(**good)
    for key, bad in [("age", 121), ("age", -1), ("ages", [0, 2018]), ("pair", [3, 7]), ("either", 121), ("one", 999),
                     ("all", 2018), ("pct", 100.5), ("small", 4), ("maybe", 3), ("level", 3), ("version", 2019),
                     ("capped_enum", 7), ("capped_enum", 4)]:
        assert not ok(**{**good, key: bad}), (key, bad)
    assert ok(**{**good, "maybe": 2, "either": "abc"})
    map_regex = re.compile(smollm2_backend.to_regex(GuidedKind.JSON, json.dumps(REACH["properties"]["map"])))
    assert map_regex.fullmatch('{"a":1,"b":120}') and not map_regex.fullmatch('{"a":1,"b":121}')


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"age": BOUNDED, "t": {"type": "number", "minimum": -5, "exclusiveMaximum": 5}},
     "required": ["age", "t"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 1, "maxItems": 3},
    {"type": "integer", "minimum": -7},
])
def test_walks_validate(smollm2_backend, schema):
    """Random walks through the compiled grammar on SmolLM2's tokens: every completion is
    within the bounds (outlines-core alone writes any integer)."""
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    for seed in range(12):
        tokens = walk(smollm2_backend, grammar.fork(), seed)
        jsonschema.validate(json.loads(completed_text(smollm2_backend, tokens)), schema)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(low=st.integers(-150, 150), span=st.integers(0, 150), data=st.data())
def test_walks_validate_random_bounds(smollm2_backend, low, span, data):
    kind = data.draw(st.sampled_from(["integer", "number"]))
    schema = {"type": "object", "properties": {"x": {"type": kind, "minimum": low, "maximum": low + span}}, "required": ["x"]}
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    for seed in range(4):
        tokens = walk(smollm2_backend, grammar.fork(), data.draw(st.integers(0, 2**31)))
        jsonschema.validate(json.loads(completed_text(smollm2_backend, tokens)), schema)


def test_every_integer_in_range_is_reachable(smollm2_backend, smollm2_tokenizer):
    """Completeness through the automaton too: outlines-core's leftmost-first matching would cut
    off "12" after "1" if a shorter alternative came first, at the end of the output."""
    for low, high in [(10, 20), (-12, 7), (0, 120), (95, 1005)]:
        grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps({"type": "integer", "minimum": low, "maximum": high}))
        for n in range(low - 3, high + 4):
            g = grammar.fork()
            ids = smollm2_tokenizer.encode(str(n), add_special_tokens=False)
            inside = low <= n <= high
            assert (g.accept_tokens(ids) and g.is_final()) == inside, n


def test_numeric_enum_and_const_untouched(smollm2_backend):
    schema = {"type": "object", "properties": {"v": {"const": 2}, "l": {"enum": [1, 2, 3]}}, "required": ["v", "l"]}
    from outlines_core.json_schema import build_regex_from_schema

    ours = smollm2_backend.to_regex(GuidedKind.JSON, json.dumps(schema))
    assert ours == build_regex_from_schema(json.dumps(schema), smollm2_backend.whitespace_pattern)


def test_nested_generic_object_uses_the_small_regex(smollm2_backend):
    """A tool without parameters ({"type": "object"}) inside a tool-calling schema: outlines-core's
    own any-object regex tripled the automaton (3.4 s -> 1.2 s to compile on SmolLM2)."""
    now = {"type": "object", "properties": {"name": {"type": "string", "enum": ["now"]}, "parameters": {"type": "object"}},
           "required": ["name", "parameters"]}
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [now]}}
    regex = smollm2_backend.to_regex(GuidedKind.JSON, json.dumps(schema))
    assert len(regex) < 5000
    for text in ['[{"name": "now", "parameters": {}}]', '[{"name":"now","parameters":{"tz": "UTC", "n": [1, 2]}}]']:
        assert re.fullmatch(regex, text), text
    assert not re.fullmatch(regex, '[{"name": "now", "parameters": []}]')
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    ids = smollm2_backend.tokenizer.encode('[{"name": "now", "parameters": {"k": 1}}]', add_special_tokens=False)
    assert grammar.accept_tokens(ids) and grammar.is_final()
