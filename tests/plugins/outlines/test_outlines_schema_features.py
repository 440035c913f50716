"""JSON-schema features outlines-core 0.2.14 ignores or gets wrong: refused with a ValueError that
names them (never silently unconstrained output), and ``format`` strings compiled from our own
ASCII regexes, whose every completion the format checkers of jsonschema accept."""

from __future__ import annotations

import datetime
import json
import re

import jsonschema
import pytest

from runtime.structured_output import GuidedKind
from runtime_outlines.schema_features import FORMATS

from test_outlines_grammar import completed_text, walk

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.mark.parametrize("schema, feature", [
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, "patternProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}}, "if/then/else"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]},
     "allOf (at #) whose sub-schemas set pattern to different values ('^a' and 'b$')"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "minProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "maxProperties": 1},
     "maxProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "required property 'b'"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "minItems"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "a+", "maxLength": 3}}}, "pattern together"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date", "minLength": 3}}}, "format together"),
    ({"$defs": {"n": {"type": "integer", "multipleOf": 2}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
     "multipleOf (at #/$defs/n)"),
])
def test_features_outlines_core_ignores_are_refused_by_name(smollm2_backend, schema, feature):
    """outlines-core compiled each of these into a regex that ignores the feature (any integer for
    multipleOf, repeated items, ``{}`` for minProperties, one allOf sub-schema's pattern for two)."""
    with pytest.raises(ValueError, match=re.escape(feature)):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 1},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 1, "maxProperties": 1},
    {"allOf": [{"type": "integer"}]},
    {"type": "object", "properties": {"c": {"enum": [3, 6], "multipleOf": 3}}, "patternProperties": {}},
    {"type": "object", "properties": {"e": {"type": "string", "format": "email", "pattern": "^[a-z]{1,8}@x\\.org$"}}},
])
def test_features_that_constrain_nothing_more_still_compile(smollm2_backend, schema):
    smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


def test_the_date_regex_is_exactly_the_valid_dates():
    pattern = re.compile(FORMATS["date"])
    for year in (1, 4, 99, 100, 400, 1900, 1999, 2000, 2023, 2024, 2100, 9999):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = datetime.date.fromisoformat(text) is not None
                except ValueError:
                    valid = False
                assert bool(pattern.fullmatch(text)) == valid, text
    assert not pattern.fullmatch("0000-01-01") and not pattern.fullmatch("๐4১௮-06-16")


@pytest.mark.parametrize("fmt", ["date", "time", "date-time"])
def test_format_walks_are_valid_json_in_their_format(smollm2_backend, fmt):
    """outlines-core's format regexes use ``\\d`` (any Unicode digit: ``"๐4১௮-06-16"`` was a date),
    allow years of any length and leave out the time zone RFC 3339 requires."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    for seed in range(10):
        tokens = walk(smollm2_backend, grammar.fork(), seed)
        value = json.loads(completed_text(smollm2_backend, tokens))
        jsonschema.validate(value, schema, format_checker=FORMAT_CHECKER)
        assert value["v"].isascii() and re.fullmatch(FORMATS[fmt], value["v"]), value


@pytest.mark.parametrize("fmt, good, bad", [
    ("email", ["a.b@c.de", "x+y@mail.example.org"], ['"a"@b.cd', "a\\b@c.de", "a@b", "é@b.cd"]),
    ("uri", ["http://a.bc/x?y#z", "https://u:p@localhost:8080/a/b", "urn:isbn:0451450523"],
     ['http://a"b.com', "http://a.bc/\\", "http://a.bc/ x", "http://a.bc/\n"]),
])
def test_email_and_uri_hold_no_character_json_must_escape(smollm2_backend, fmt, good, bad):
    """outlines-core's ``[^\\s:@]`` and quoted local parts let a uri or an email hold a bare ``"``
    or ``\\`` (the output was not JSON)."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    assert all(re.fullmatch(FORMATS[fmt], text) for text in good)
    assert not any(re.fullmatch(FORMATS[fmt], text) for text in bad)
    assert not re.search(r'["\\\x00-\x1f]', FORMATS[fmt].replace("\\.", "").replace("\\?", ""))


@pytest.mark.parametrize("pattern", [".{2,4}", "^[^a]+$", "\\S\\S", "^.{1,3}@.{1,3}$"])
def test_pattern_walks_are_valid_json(smollm2_backend, pattern):
    """outlines-core put a pattern's ``.`` / ``[^a]`` / ``\\S`` into the JSON string unescaped:
    a bare ``"`` or ``\\`` ended or broke the string (``.{2}`` gave ``"a""``)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    quote = smollm2_backend.tokenizer.convert_tokens_to_ids('"')
    for seed in range(8):
        walker = grammar.fork()
        assert walker.accept_tokens(smollm2_backend.tokenizer.encode('{"s": "x', add_special_tokens=False))
        assert walker.validate_tokens([quote]) == (1 if re.fullmatch(pattern, "x") else 0)
        tokens = walk(smollm2_backend, grammar.fork(), seed)
        jsonschema.validate(json.loads(completed_text(smollm2_backend, tokens)), schema)


@pytest.mark.parametrize("pattern", ['[a"]+', "[\\\\]", "[ -~]+", 'a"b'])
def test_patterns_naming_characters_json_escapes_are_refused(smollm2_backend, pattern):
    schema = {"type": "string", "pattern": pattern}
    with pytest.raises(ValueError, match="cannot escape in a JSON string"):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
