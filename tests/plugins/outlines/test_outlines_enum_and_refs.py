"""Schemas whose keywords outlines-core 0.2.14 drops without a word: the ``type``, bounds and lengths
beside an ``enum``/``const`` (it wrote every listed value: ``{"type": "string", "enum": ["a", 1]}``
gave ``1``), every keyword beside a ``$ref`` (``{"$ref": <integer>, "maximum": 3}`` gave ``589``), and
empty ``enum``/``anyOf``/``oneOf``/``type`` lists (compiled to an empty regex: the output ``""`` or
``{"a":}``). The listed values are now filtered by the rest of their schema, and the others are
refused with a ValueError that names them (a 400 from the server). Also: patterns with a top-level
``|``, objects/arrays in enums and property names that JSON must escape (outlines-core wrote output
that is not JSON), any-value sub-schemas (minutes to compile) and objects with no fields allowed."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime.structured_output import GuidedKind

from test_outlines_grammar import completed_text, walk


def accepts_text(backend, grammar, text: str) -> bool:
    """True where the grammar takes ``text`` (as the tokenizer encodes it) followed by EOS."""
    tokens = backend.tokenizer.encode(text, add_special_tokens=False) + [backend.vocab.eos_token_id]
    return grammar.fork().validate_tokens(tokens) == len(tokens)


def check_grammar(backend, schema: dict, allowed: list[str], refused: list[str]) -> None:
    """The schema's grammar accepts each allowed text and refuses each refused one, and its random walks
    (6 seeds) end in JSON that validates against the schema."""
    grammar = backend.compile(GuidedKind.JSON, json.dumps(schema))
    for text in allowed:
        assert accepts_text(backend, grammar, text), text
    for text in refused:
        assert not accepts_text(backend, grammar, text), text
    for seed in range(6):
        tokens = walk(backend, grammar.fork(), seed)
        jsonschema.validate(json.loads(completed_text(backend, tokens)), schema)


@pytest.mark.parametrize("schema, allowed, refused", [
    ({"type": "string", "enum": ["a", 1, "b"]}, ['"a"', '"b"'], ["1"]),
    ({"type": "integer", "enum": [1, 50, True, 2.5], "maximum": 10}, ["1"], ["50", "true", "2.5"]),
    ({"type": "string", "enum": ["ab", "abcdef"], "maxLength": 3}, ['"ab"'], ['"abcdef"']),
    ({"type": "object", "properties": {"v": {"type": ["string", "null"], "enum": ["x", 3, None]}}, "required": ["v"]},
     ['{"v":"x"}', '{"v":null}'], ['{"v":3}']),
    ({"enum": [1, 2, 3], "const": 2}, ["2"], ["1", "3"]),
    ({"type": "number", "const": 4, "exclusiveMinimum": 0}, ["4"], ["5"]),
])
def test_enum_values_are_kept_to_the_rest_of_their_schema(smollm2_backend, schema, allowed, refused):
    check_grammar(smollm2_backend, schema, allowed, refused)


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "const": 5}, "the const 5 does not satisfy"),
    ({"type": "object", "properties": {"a": {"type": "boolean", "enum": [1, "x"]}}}, 'no value of the enum [1, "x"]'),
    ({"enum": []}, "an empty enum list"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "an empty enum list (no value can match it) (at #/properties/a)"),
    ({"anyOf": []}, "an empty anyOf list"),
    ({"type": "object", "properties": {"a": {"oneOf": []}}, "required": ["a"]}, "an empty oneOf list"),
    ({"type": []}, "an empty type list"),
    ({"$defs": {"p": {"type": "integer"}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/p", "minimum": 0, "maximum": 3}}, "required": ["x"]},
     "$ref together with maximum, minimum (outlines-core would drop them) (at #/properties/x)"),
    ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "type": "string"}, "$ref together with type"),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 1}, "minItems larger than maxItems"),
])
def test_schemas_outlines_core_would_get_wrong_are_refused_by_name(smollm2_backend, schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


def test_ref_with_annotations_only_still_compiles(smollm2_backend):
    schema = {"$defs": {"p": {"type": "integer", "minimum": 0, "maximum": 3}}, "type": "object",
              "properties": {"x": {"$ref": "#/$defs/p", "title": "X", "description": "an x", "default": 1}},
              "required": ["x"]}
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    assert accepts_text(smollm2_backend, grammar, '{"x":2}')
    assert not accepts_text(smollm2_backend, grammar, '{"x":7}')


# ---------------------------------------------------------------------------- strings outlines-core left unescaped
@pytest.mark.parametrize("schema, allowed, refused", [
    # a top-level alternation in a pattern: outlines-core allowed '"ab' and 'cd"' (not JSON)
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "ab|cd"}}, "required": ["p"]},
     ['{"p":"ab"}', '{"p":"cd"}'], ['{"p":"ab}', '{"p":cd"}']),
    ({"type": "string", "pattern": "a$|^b"}, ['"a"', '"b"'], ['"a', 'b"']),
    # objects and arrays listed by enum/const: outlines-core wrote the key 'k"' as "k""
    ({"enum": [{"k\"": "v\\"}, [1, "\n"]]}, [r'{"k\"":"v\\"}', r'[1,"\n"]'], ['{"k"":"v\\"}']),
    ({"type": "object", "properties": {"c": {"const": {"x\\": None}}}, "required": ["c"]},
     [r'{"c":{"x\\":null}}'], [r'{"c":{"x\":null}}']),
])
def test_pattern_alternatives_and_listed_values_stay_json(smollm2_backend, schema, allowed, refused):
    check_grammar(smollm2_backend, schema, allowed, refused)


@pytest.mark.parametrize("name", ['a"b', "c\\d", "x\ny"])
def test_property_names_json_must_escape_are_refused(smollm2_backend, name):
    """outlines-core wrote them as they are: '{"a"b": true}' is not JSON."""
    schema = {"type": "object", "properties": {name: {"type": "boolean"}}, "required": [name]}
    with pytest.raises(ValueError, match=re.escape(f"the property name {name!r}, which JSON must escape")):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {}, "maxItems": 2},
    {"type": "object", "properties": {"a": {"description": "anything"}}, "required": ["a"]},
])
def test_any_value_subschemas_get_the_small_generic_regex(smollm2_backend, schema):
    """An array of any items compiled for six minutes on SmolLM2 with outlines-core's own any-value regex."""
    assert len(smollm2_backend.to_regex(GuidedKind.JSON, json.dumps(schema))) < 12000
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    for seed in range(4):
        tokens = walk(smollm2_backend, grammar.fork(), seed)
        jsonschema.validate(json.loads(completed_text(smollm2_backend, tokens)), schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "additionalProperties": False},
    {"type": "object", "properties": {"none": {"type": "object", "additionalProperties": False}}, "required": ["none"],
     "additionalProperties": False},
])
def test_objects_with_no_fields_allowed_compile(smollm2_backend, schema):
    """outlines-core refused them ("Unsupported JSON Schema structure false") unless ``properties: {}``
    was given too; OpenAI's strict mode writes such schemas for a tool without parameters."""
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    text = '{"none":{}}' if "properties" in schema else "{}"
    assert accepts_text(smollm2_backend, grammar, text)
    assert not accepts_text(smollm2_backend, grammar, '{"none":{"a":1}}' if "properties" in schema else '{"a":1}')
    tokens = walk(smollm2_backend, grammar.fork(), 0)
    jsonschema.validate(json.loads(completed_text(smollm2_backend, tokens)), schema)
