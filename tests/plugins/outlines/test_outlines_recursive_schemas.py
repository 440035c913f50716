"""Recursive JSON schemas are refused naming the ``$ref`` that recurses. outlines-core expands a
recursive ``$ref`` a few levels and then drops it, so its regex at the cut lost a required property
(``{"v": 0,}``: not JSON) and constrained output could fail the schema. Schemas that only reuse a
definition, or hold a recursive definition they never use, still compile, and their output validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime.structured_output import GuidedKind

from test_outlines_grammar import completed_text, walk

NODE = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v", "kids"]}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}


@pytest.mark.parametrize("schema, ref, where", [
    ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, "#/$defs/node", "#/$defs/node/properties/kids/items"),
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                       "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
      "required": ["name", "next"]}, "#", "#/properties/next/anyOf/0"),
    ({"definitions": {"a": {"type": "object", "properties": {"b": {"$ref": "#/definitions/b"}}},
                      "b": {"type": "array", "items": {"$ref": "#/definitions/a"}}},
      "type": "object", "properties": {"root": {"$ref": "#/definitions/a"}}}, "#/definitions/a", "#/definitions/b/items"),
])
def test_recursive_schemas_are_refused_naming_the_ref(smollm2_backend, schema, ref, where):
    with pytest.raises(ValueError, match=re.escape(f"the JSON schema is recursive: $ref {ref!r} at {where}")):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


def test_outlines_core_cuts_recursion_into_output_that_fails_the_schema():
    """Why they are refused: the regex outlines-core builds for a recursive schema matches text that is not JSON."""
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(json.dumps({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}), r"[ \n]?")
    cut = '{"v":0,}'  # where the recursion stops: "kids" (required) dropped, a trailing comma left
    for _ in range(8):
        if re.fullmatch(regex, cut):
            break
        cut = '{"v":0,"kids":[' + cut + ']}'
    assert re.fullmatch(regex, cut), "outlines-core no longer cuts recursion this way"
    with pytest.raises(ValueError):
        json.loads(cut)


@pytest.mark.parametrize("schema", [
    {"$defs": {"point": POINT}, "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                                                  "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"]},
    {"$defs": {"node": NODE, "point": POINT}, "$ref": "#/$defs/point"},  # the recursive definition is never used
    {"$defs": {"p": {"$ref": "#/$defs/q"}, "q": POINT}, "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2},
])
def test_schemas_that_reuse_definitions_compile_and_their_output_validates(smollm2_backend, schema):
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    for seed in range(3):
        walker = grammar.fork() if seed else grammar
        text = completed_text(smollm2_backend, walk(smollm2_backend, walker, seed))
        jsonschema.validate(json.loads(text), schema)
