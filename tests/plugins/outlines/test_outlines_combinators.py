"""Combinators, boolean sub-schemas, ``$ref`` and patterns that outlines-core 0.2.14 got wrong: ``oneOf``
compiled as ``anyOf``, the keywords beside ``allOf``/``anyOf``/``oneOf`` dropped, ``not`` and
``unevaluated*`` ignored, ``$ref`` pointers with escapes refused (and an anchor read as a recursive
reference), ``\\w`` and ``\\d`` matching Unicode. Each is now exact or refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime.structured_output import GuidedKind

from test_outlines_enum_and_refs import accepts_text
from test_outlines_grammar import completed_text
from test_outlines_schema_corpus import OBJ, steered_walk, validator

INTEGER = {"type": "integer"}


def check(backend, schema: dict, allowed: list[str], refused: list[str], seeds: int = 2) -> None:
    grammar = backend.compile(GuidedKind.JSON, json.dumps(schema))
    for text in allowed:
        assert accepts_text(backend, grammar, text), text
    for text in refused:
        assert not accepts_text(backend, grammar, text), text
    for seed in range(seeds):
        validator(schema).validate(json.loads(completed_text(backend, steered_walk(backend, grammar.fork(), seed))))


# ---------------------------------------------------------------------------- oneOf
def test_outlines_core_compiles_one_of_as_any_of():
    """Why oneOf needs a check: outlines-core's regex takes 1, valid under both branches, so not under oneOf."""
    from outlines_core.json_schema import build_regex_from_schema

    schema = {"oneOf": [INTEGER, {"type": "number"}]}
    assert re.fullmatch(build_regex_from_schema(json.dumps(schema)), "1")
    assert not jsonschema.Draft202012Validator(schema).is_valid(1)


@pytest.mark.parametrize("schema, where", [
    ({"oneOf": [INTEGER, {"type": "number", "minimum": 0}]}, "#/oneOf"),
    ({"oneOf": [OBJ({"a": INTEGER}, []), OBJ({"b": INTEGER}, [])]}, "#/oneOf"),  # {} matches both
    ({"oneOf": [OBJ({"a": INTEGER}), OBJ({"a": INTEGER, "b": INTEGER})]}, "#/oneOf"),  # {"a":1,"b":2} both
    ({"oneOf": [{"type": "object"}, OBJ({"b": INTEGER})]}, "#/oneOf"),
    (OBJ({"v": {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}}), "#/properties/v/oneOf"),
    ({"oneOf": [{"type": "string", "format": "date"}, {"type": "string", "maxLength": 12}]}, "#/oneOf"),
])
def test_one_of_whose_branches_may_overlap_is_refused(smollm2_backend, schema, where):
    with pytest.raises(ValueError, match=re.escape(f"oneOf (at {where}) whose branches 0 and 1 may both match one value")):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


@pytest.mark.parametrize("schema, allowed, refused", [
    ({"oneOf": [{"type": "string", "maxLength": 2}, INTEGER, {"type": "null"}]}, ['"ab"', "null"], ["true"]),
    (OBJ({"n": {"oneOf": [{"type": "number", "exclusiveMaximum": 0}, {"type": "number", "minimum": 0, "maximum": 1}]}}),
     ['{"n":-0.5}', '{"n":0}'], ['{"n":2}']),
    ({"oneOf": [OBJ({"a": INTEGER}), OBJ({"b": INTEGER})]}, ['{"a":1}', '{"b":1}'], ['{"a":1,"b":2}']),
    ({"type": "array", "maxItems": 2, "items": {"oneOf": [OBJ({"t": {"const": "x"}, "v": INTEGER}), OBJ({"t": {"const": "y"}})]}},
     ['[{"t":"x","v":1},{"t":"y"}]'], ['[{"t":"y","v":1}]']),
    ({"oneOf": [{"type": "array", "prefixItems": [{"const": 0}, INTEGER]}, {"type": "array", "prefixItems": [{"const": 1}]}]},
     ["[0,5]", "[1]"], ["[1,5]"]),
])
def test_one_of_whose_branches_exclude_each_other_compiles(smollm2_backend, schema, allowed, refused):
    check(smollm2_backend, schema, allowed, refused)


# ---------------------------------------------------------------------------- keywords beside combinators
@pytest.mark.parametrize("schema, allowed, refused", [
    # outlines-core kept the allOf branch and dropped the rest, or the reverse: -84 came out
    ({"type": "integer", "maximum": 5, "allOf": [{"minimum": 0}]}, ["5", "0"], ["-84", "6"]),
    ({"allOf": [OBJ({"a": INTEGER}), {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
     ['{"a":1,"b":true}'], ['{"a":1}', '{"b":true}{"a":1}']),
    ({"type": "object", "properties": {"a": INTEGER, "b": INTEGER}, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
     ['{"a":1}', '{"b":2}', '{"a":1,"b":2}'], ["{}"]),
    # a branch none of whose values the keywords beside allow is left out: "abcdef" came out
    ({"type": "string", "maxLength": 3, "oneOf": [{"const": "abc"}, {"const": "abcdef"}]}, ['"abc"'], ['"abcdef"']),
    (OBJ({"n": {"type": "integer", "anyOf": [{"minimum": 3, "maximum": 5}, {"minimum": -5, "maximum": -3}]}}),
     ['{"n":4}', '{"n":-3}'], ['{"n":0}', '{"n":6}']),
])
def test_keywords_beside_combinators_are_enforced(smollm2_backend, schema, allowed, refused):
    check(smollm2_backend, schema, allowed, refused)


@pytest.mark.parametrize("schema, message", [
    ({"allOf": [{"type": "object", "additionalProperties": False}, {"properties": {"a": INTEGER}}]},
     "allOf (at #) whose sub-schemas both set additionalProperties, properties"),
    ({"allOf": [{"type": "string"}, INTEGER]}, "allOf (at #) whose sub-schemas allow no common type"),
    ({"anyOf": [INTEGER], "oneOf": [INTEGER]}, "anyOf together with oneOf (at #)"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "the required property 'a' has the schema false"),
    ({"type": "array", "items": False, "minItems": 1}, "items false with minItems 1 (at #): no array can match"),
    ({"type": "integer", "not": {"const": 3}}, "not (at #) is not supported"),
])
def test_combinations_that_cannot_be_kept_exact_are_refused(smollm2_backend, schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


@pytest.mark.parametrize("schema, allowed, refused", [
    # ignored by outlines-core: any items, any properties came out
    ({"type": "array", "unevaluatedItems": False}, ["[]"], ["[1]"]),
    ({"type": "object", "unevaluatedProperties": INTEGER}, ['{"k":1}'], ['{"k":"x"}']),
    # outlines-core wrote every prefix item, past maxItems
    ({"type": "array", "prefixItems": [INTEGER, {"type": "string"}], "maxItems": 1}, ["[3]"], ['[3,"x"]']),
    # outlines-core refused true/false sub-schemas
    (OBJ({"a": INTEGER, "b": False}, ["a"]), ['{"a":1}'], ['{"a":1,"b":1}']),
    # enum values checked against every other keyword: 4 came out of multipleOf 3, "nope" as a date
    ({"enum": [3, 4], "multipleOf": 3}, ["3"], ["4"]),
    ({"type": "string", "format": "date", "enum": ["2024-01-01", "nope"]}, ['"2024-01-01"'], ['"nope"']),
])
def test_keywords_outlines_core_ignored_are_enforced(smollm2_backend, schema, allowed, refused):
    check(smollm2_backend, schema, allowed, refused)


# ---------------------------------------------------------------------------- $ref
def test_ref_pointers_with_escapes_anchors_and_ids_resolve(smollm2_backend):
    """outlines-core refused ``~1`` (``/``), ``~0`` (``~``) and percent-escapes, and the recursion check read
    the anchor ``#n`` as ``#`` (the root: "recursive")."""
    schema = {"$id": "https://example.com/s.json", "type": "object",
              "$defs": {"a/b": {"type": "integer", "minimum": 1, "maximum": 3}, "t~n": {"type": "boolean"},
                        "p%": {"$anchor": "n", "type": "null"}, "sp ace": {"enum": ["x", "y"]}},
              "properties": {"w": {"$ref": "#/$defs/a~1b"}, "x": {"$ref": "#/$defs/t~0n"}, "y": {"$ref": "#n"},
                             "z": {"$ref": "#/$defs/sp%20ace"}, "q": {"$ref": "s.json#/$defs/p%25"}},
              "required": ["w", "x", "y", "z", "q"]}
    check(smollm2_backend, schema, ['{"w":3,"x":true,"y":null,"z":"y","q":null}'],
          ['{"w":4,"x":true,"y":null,"z":"y","q":null}', '{"w":3,"x":true,"y":null,"z":"a","q":null}'])


@pytest.mark.parametrize("schema, message", [
    ({"$ref": "https://example.com/other.json"}, "the $ref 'https://example.com/other.json' at # names no sub-schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
     "the $ref '#/$defs/missing' at #/properties/a names no sub-schema"),
    ({"type": "array", "items": {"$ref": "#nowhere"}}, "the $ref '#nowhere' at #/items names no sub-schema"),
    ({"$defs": {"n": {"$anchor": "node", "type": "array", "items": {"$ref": "#node"}}}, "$ref": "#node"},
     "the JSON schema is recursive: $ref '#node' at #node/items"),
    ({"$defs": {f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(14)}
     | {"d14": INTEGER}, "$ref": "#/$defs/d0"}, "the JSON schema's $refs expand to more than 5000 sub-schemas"),
])
def test_refs_that_cannot_be_written_out_are_refused_by_name(smollm2_backend, schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


# ---------------------------------------------------------------------------- patterns
@pytest.mark.parametrize("pattern, allowed, refused", [
    ("^\\d{3}$", ['"123"'], ['"๑๒๓"', '"１２３"']),  # Unicode digits: outlines-core's (Rust's) \d
    ("^\\w{2}$", ['"a_"'], ['"‿‿"', '"éé"']),  # Python's \w refuses "‿", which Rust's took
    ("^a\\sb$", ['"a b"'], ['"a\\nb"', '"a\\tb"']),  # was refused: \s matches control characters
])
def test_pattern_shorthands_match_what_every_validator_accepts(smollm2_backend, pattern, allowed, refused):
    check(smollm2_backend, {"type": "string", "pattern": pattern}, allowed, refused)


@pytest.mark.parametrize("schema, message", [
    ({"anyOf": [{"$ref": "https://example.com/x"}, None]}, "is neither an object nor a boolean"),
    ({"enum": [1, 2], "type": 3}, "the schema of the enum/const [1, 2] is malformed"),
    ({"enum": [{"a": 1}], "additionalProperties": {"$ref": 5}}, "is malformed"),
    ({"allOf": [5, INTEGER]}, "allOf (at #) with a sub-schema that is not a JSON object or boolean: 5"),
])
def test_malformed_schemas_are_bad_requests_not_crashes(smollm2_backend, schema, message):
    """Found by fuzzing the compile: jsonschema and referencing raised TypeError/AttributeError (a 500)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        smollm2_backend.to_regex(GuidedKind.JSON, json.dumps(schema))
