"""A property test of the JSON-schema guide: for a corpus of varied schemas (formats, patterns,
lengths, bounds, nested and closed objects, arrays, enums and consts, nullable types, combinators,
``$ref``), random walks through the compiled guide (random allowed tokens of SmolLM2's tokenizer, then
steered to the nearest end) end in JSON that jsonschema validates, formats included; hand-written
valid instances are accepted, token for token. Every keyword jsonschema enforces is in a schema of the
corpus or in a schema the backend refuses by name (:data:`REFUSED`), so none is silently ignored.

Valid instances avoid a top-level scalar that goes on after a complete match (``-2`` then ``.5``):
outlines-core 0.2.14 refuses some such tokens (test_outlines_grammar.py documents that bug)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from runtime.structured_output import GuidedKind, allocate_token_bitmask

from test_outlines_grammar import VOCAB, allowed_mask, completed_text


def OBJ(properties: dict, required: list | None = None, **keywords) -> dict:
    """An object schema; every property required unless ``required`` says which."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **keywords}


DRAFT4 = "http://json-schema.org/draft-04/schema#"
# (name, schema, valid instances as the guide writes them: compact, properties in schema order)
CORPUS = [
    ("str_len", {"type": "string", "minLength": 2, "maxLength": 5}, ['"ab"', '"abcde"']),
    ("str_pattern", OBJ({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}), ['{"code":"AB-123"}']),
    ("fmt_date", OBJ({"d": {"type": "string", "format": "date"}}), ['{"d":"2024-02-29"}']),
    ("fmt_datetime", OBJ({"t": {"type": "string", "format": "date-time"}}), ['{"t":"2024-01-02T03:04:05Z"}']),
    ("fmt_time", OBJ({"t": {"type": "string", "format": "time"}}), ['{"t":"23:59:59+01:00"}']),
    ("fmt_email", OBJ({"e": {"type": "string", "format": "email"}}), ['{"e":"a.b@example.org"}']),
    ("fmt_uuid", OBJ({"u": {"type": "string", "format": "uuid"}}), ['{"u":"123e4567-e89b-12d3-a456-426614174000"}']),
    ("fmt_uri", OBJ({"u": {"type": "string", "format": "uri"}}), ['{"u":"https://example.com/a?b=c"}']),
    ("int_range", {"type": "integer", "minimum": -5, "maximum": 120}, ["-5", "0", "120"]),
    ("num_exclusive", OBJ({"x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}), ['{"x":0.5}', '{"x":0.999}']),
    ("int_excl_min_only", {"type": "integer", "exclusiveMinimum": 10}, ["11", "123456"]),
    ("num_negative", OBJ({"x": {"type": "number", "minimum": -2.5, "maximum": -1}}), ['{"x":-2.5}', '{"x":-1}', '{"x":-1.75}']),
    ("draft4_exclusive", {"$schema": DRAFT4, "type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3}, ["1", "3"]),
    ("num_plain", OBJ({"x": {"type": "number"}, "y": {"type": "integer"}}), ['{"x":-1.5e+3,"y":7}']),
    ("bool_null", OBJ({"b": {"type": "boolean"}, "n": {"type": "null"}}), ['{"b":true,"n":null}']),
    ("enum_mixed", {"enum": ["a", 1, 2.5, True, None]}, ['"a"', "1", "2.5", "true", "null"]),
    ("const_str", OBJ({"name": {"const": "get_weather"}, "v": {"type": "integer"}}), ['{"name":"get_weather","v":1}']),
    ("const_obj", {"const": {"a": [1, "x"], "b": None}}, ['{"a":[1,"x"],"b":null}']),
    ("nullable_int", OBJ({"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}), ['{"n":null}', '{"n":3}']),
    ("type_list", {"type": "array", "items": {"type": ["string", "number", "boolean"]}, "maxItems": 3}, ['["a",1,false]', "[]"]),
    ("anyof_null", OBJ({"note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}}), ['{"note":"hi"}', '{"note":null}']),
    ("oneof_types", OBJ({"v": {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}, {"type": "null"}]}}), ['{"v":"ab"}', '{"v":4}']),
    ("oneof_discriminated", {"oneOf": [
    OBJ({"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 0, "maximum": 9}}),
    OBJ({"kind": {"const": "dog"}, "good": {"type": "boolean"}})]},
    ['{"kind":"cat","lives":9}', '{"kind":"dog","good":true}']),
    ("nested3", OBJ({"a": OBJ({"b": OBJ({"c": {"type": "string", "maxLength": 3}})})}), ['{"a":{"b":{"c":"x"}}}']),
    ("required_subset", OBJ({"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 3}, "ok": {"type": "boolean"}}, ["id"]),
    ['{"id":1}', '{"id":1,"ok":false}', '{"id":2,"tag":"a","ok":true}']),
    ("addl_false", OBJ({"a": {"type": "integer"}}, [], additionalProperties=False), ["{}", '{"a":5}']),
    ("addl_schema", OBJ({"a": {"type": "integer"}}, ["a"], additionalProperties={"type": "string"}), ['{"a":5}']),
    ("no_fields", {"type": "object", "additionalProperties": False}, ["{}"]),
    ("array_objects", {"type": "array", "items": OBJ({"x": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}, ["x"]),
    "minItems": 1, "maxItems": 3}, ['[{"x":1}]', '[{"x":1,"ok":true},{"x":2}]']),
    ("array_empty", {"type": "array", "items": {"type": "integer"}, "maxItems": 0}, ["[]"]),
    ("array_unique1", {"type": "array", "items": {"enum": ["r", "g"]}, "uniqueItems": True, "maxItems": 1}, ["[]", '["g"]']),
    ("prefix_items", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, ['[1,"ab"]']),
    ("prefix_items_closed", {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": 7}], "items": False}, ["[true,7]"]),
    ("defs_reuse", {"$defs": {"p": OBJ({"x": {"type": "integer", "minimum": 0, "maximum": 9}})}, **OBJ({"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}})},
    ['{"a":{"x":1},"b":{"x":2}}']),
    ("definitions_draft7", {"definitions": {"c": {"enum": ["red", "blue"]}}, "type": "array", "items": {"$ref": "#/definitions/c"}, "maxItems": 2}, ['["red","blue"]']),
    ("ref_escaped", {"$defs": {"a/b": {"type": "integer", "minimum": 1, "maximum": 3}, "t~n": {"type": "boolean"}, "sp ace": {"type": "null"}},
    **OBJ({"x": {"$ref": "#/$defs/a~1b"}, "y": {"$ref": "#/$defs/t~0n"}, "z": {"$ref": "#/$defs/sp%20ace"}})},
    ['{"x":2,"y":true,"z":null}']),
    ("allof_single", {"allOf": [OBJ({"q": {"type": "integer", "maximum": 5, "minimum": 1}})]}, ['{"q":5}']),
    ("enum_structured", OBJ({"p": {"enum": [[1, 2], {"k": "v"}, "s"]}}), ['{"p":[1,2]}', '{"p":{"k":"v"}}', '{"p":"s"}']),
    ("unicode_pattern", {"type": "string", "pattern": "^[α-ω]{1,3}$"}, ['"αβ"']),
    ("str_empty", OBJ({"s": {"type": "string", "maxLength": 0}}), ['{"s":""}']),
    ("annotated", {"title": "T", "description": "d", "type": "object", "properties": {"a": {"title": "A", "description": "x", "type": "integer", "examples": [1]}}, "required": ["a"]}, ['{"a":1}']),
    ("tool_call", OBJ({"name": {"enum": ["search", "lookup"]}, "arguments": OBJ({"query": {"type": "string", "maxLength": 8}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"])}),
    ['{"name":"search","arguments":{"query":"cats","limit":3}}']),
    ("date_or_null", OBJ({"d": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]}}), ['{"d":null}', '{"d":"2000-01-01"}']),
    ("array_anyof_items", {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "pattern": "^x+$"}]}, "minItems": 2, "maxItems": 2}, ['[1,"xx"]']),
    ("oneof_ranges", OBJ({"n": {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "minimum": 1}]}}),
     ['{"n":0}', '{"n":7}']),
    ("oneof_closed_objects", {"oneOf": [OBJ({"a": {"type": "integer"}}, ["a"], additionalProperties=False),
                                        OBJ({"b": {"type": "boolean"}}, ["b"], additionalProperties=False)]},
     ['{"a":1}', '{"b":false}']),
    ("oneof_required_differ", {"oneOf": [OBJ({"a": {"type": "integer"}}), OBJ({"b": {"type": "integer"}})]}, ['{"b":2}']),
    ("pydantic_tagged_union", {
        "$defs": {"Cat": {"properties": {"pet_type": {"const": "cat", "type": "string"}, "meows": {"type": "integer"}},
                          "required": ["pet_type", "meows"], "title": "Cat", "type": "object"},
                  "Dog": {"properties": {"pet_type": {"const": "dog", "type": "string"}, "barks": {"type": "number"}},
                          "required": ["pet_type", "barks"], "title": "Dog", "type": "object"}},
        "properties": {"pet": {"discriminator": {"mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"},
                                                 "propertyName": "pet_type"},
                               "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
        "required": ["pet"], "type": "object"},
     ['{"pet":{"pet_type":"cat","meows":3}}', '{"pet":{"pet_type":"dog","barks":1.5}}']),
    ("ref_anchor_and_id", {"$id": "https://example.com/root.json", "type": "object",
                           "$defs": {"n": {"$anchor": "small", "type": "integer", "minimum": 0, "maximum": 5},
                                     "s": {"$id": "s.json", "$defs": {"x": {"type": "string", "maxLength": 2}},
                                           "$ref": "#/$defs/x"}},
                           "properties": {"a": {"$ref": "#small"}, "b": {"$ref": "s.json"},
                                          "c": {"$ref": "https://example.com/root.json#/$defs/n"}},
                           "required": ["a", "b", "c"]},
     ['{"a":5,"b":"xy","c":0}']),
    ("allof_merged", {"allOf": [OBJ({"a": {"type": "integer", "minimum": 0}}), OBJ({"b": {"type": "boolean"}}),
                                {"properties": {"a": {"maximum": 9}}}]}, ['{"a":9,"b":true}']),
    ("siblings_into_branches", OBJ({"n": {"type": "integer", "anyOf": [{"minimum": 3, "maximum": 5}, {"maximum": -3, "minimum": -5}]},
                                    "s": {"type": "string", "maxLength": 3, "oneOf": [{"const": "abc"}, {"const": "abcdef"}]}}),
     ['{"n":-4,"s":"abc"}']),
    ("unevaluated", OBJ({"a": {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
                         "o": {"type": "object", "unevaluatedProperties": {"type": "integer"}}}),
     ['{"a":[1],"o":{"k":2}}']),
    ("boolean_subschemas", OBJ({"any": True, "gone": False, "none": {"type": "array", "items": False}}, ["any", "none"]),
     ['{"any":[1],"none":[]}']),
    ("pattern_shorthands", OBJ({"d": {"type": "string", "pattern": "^\\d{2}-\\w\\s\\w$"}}), ['{"d":"12-a b"}']),
    ("enum_quotes", {"enum": ["a\"b", "c\\d", "e\nf", "ü/~"]}, [r'"a\"b"', r'"c\\d"', r'"e\nf"', '"ü/~"']),
    ("enum_other_keywords", OBJ({"m": {"enum": [3, 4, 6], "multipleOf": 3}, "p": {"enum": ["ab", "x1"], "pattern": "^[a-z]+$"}}),
     ['{"m":6,"p":"ab"}']),
    ("prefix_past_max", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "maxItems": 1}, ["[3]"]),
]

# Schemas using keywords the guide cannot enforce: refused by name (a 400 from the server).
REFUSED = [
    ("multipleOf", {"type": "integer", "multipleOf": 3}, "multipleOf"),
    ("not", {"type": "integer", "not": {"const": 3}}, "not (at #)"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "contains"),
    ("minContains", {"type": "array", "minContains": 2}, "contains (minContains, maxContains)"),
    ("maxContains", {"type": "array", "maxContains": 2}, "contains (minContains, maxContains)"),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 2}}, "propertyNames"),
    ("patternProperties", {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, "patternProperties"),
    ("if", {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}}, "if/then/else"),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["a"]}},
     "dependentRequired"),
    ("dependentSchemas", {"type": "object", "properties": {"a": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["a"]}}}, "dependentSchemas"),
    ("minProperties", {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "minProperties"),
    ("maxProperties", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "maxProperties": 1}, "maxProperties"),
    ("$dynamicRef", {"$defs": {"a": {"type": "integer"}}, "$dynamicRef": "#a"}, "$dynamicRef"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf (at #/oneOf) whose branches 0 and 1 may both match"),
    ("$ref", {"$ref": "https://example.com/other.json"}, "the $ref 'https://example.com/other.json' at # names no sub-schema"),
]
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
SEEDS = 3


def distances_to_end(index) -> tuple[dict, dict]:
    """The index's transitions ``{state: {token: next state}}`` and each state's fewest tokens to a final state."""
    transitions = index.get_transitions()
    before: dict[int, set[int]] = {}
    for state, edges in transitions.items():
        for target in set(edges.values()):
            before.setdefault(target, set()).add(state)
    distance = {state: 0 for state in index.get_final_states()}
    frontier = list(distance)
    while frontier:
        reached = []
        for state in frontier:
            for source in before.get(state, ()):
                if source not in distance:
                    distance[source] = distance[state] + 1
                    reached.append(source)
        frontier = reached
    return transitions, distance


def steered_walk(backend, grammar, seed: int, max_steps: int = 400) -> list[int]:
    """A completion drawn through the grammar's bitmask: 0-40 uniformly random allowed tokens, then
    tokens that get closest to an end (so that walks through emails or free strings end too)."""
    rng = np.random.default_rng(seed)
    transitions, distance = distances_to_end(grammar.compiled.index)
    state = grammar.compiled.index.get_initial_state()
    eos = backend.vocab.eos_token_id
    bitmask = allocate_token_bitmask(1, VOCAB)
    free_steps = int(rng.integers(0, 40))
    tokens: list[int] = []
    for step in range(max_steps):
        if grammar.is_terminated():
            return tokens
        grammar.fill_bitmask(bitmask, 0)
        allowed = np.flatnonzero(allowed_mask(bitmask, 0))
        assert len(allowed), f"no token allowed after {backend.vocab.decode(tokens)!r}"
        steering = step >= free_steps
        if eos in allowed and (steering or rng.random() < 0.2):
            token = eos
        else:
            choices = [int(t) for t in allowed if t != eos]
            if steering:
                nearest = min(distance.get(transitions[state][t], max_steps) for t in choices)
                choices = [t for t in choices if distance.get(transitions[state][t], max_steps) == nearest]
            token = choices[int(rng.integers(len(choices)))]
            state = transitions[state][token]
        assert grammar.accept_tokens([token])
        tokens.append(token)
    raise AssertionError(f"the walk did not end in {max_steps} steps: {backend.vocab.decode(tokens)!r}")


def validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=FORMAT_CHECKER)


@pytest.mark.parametrize("name, schema, instances", CORPUS, ids=[case[0] for case in CORPUS])
def test_walks_validate_and_valid_instances_are_accepted(smollm2_backend, name, schema, instances):
    check = validator(schema)
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))
    eos = smollm2_backend.vocab.eos_token_id
    for text in instances:
        check.validate(json.loads(text))  # the instance itself is valid
        tokens = smollm2_backend.tokenizer.encode(text, add_special_tokens=False) + [eos]
        assert grammar.fork().validate_tokens(tokens) == len(tokens), f"{text} refused"
    for seed in range(SEEDS):
        text = completed_text(smollm2_backend, steered_walk(smollm2_backend, grammar.fork(), seed))
        errors = [error.message for error in check.iter_errors(json.loads(text))]
        assert not errors, (text, errors)


@pytest.mark.parametrize("keyword, schema, message", REFUSED, ids=[case[0] for case in REFUSED])
def test_keywords_the_guide_cannot_enforce_are_refused_by_name(smollm2_backend, keyword, schema, message):
    assert keyword in keywords(schema)
    with pytest.raises(ValueError, match=re.escape(message)):
        smollm2_backend.compile(GuidedKind.JSON, json.dumps(schema))


def keywords(schema) -> set[str]:
    """Every keyword used anywhere in ``schema`` (property names included: a superset is enough)."""
    if isinstance(schema, dict):
        return set(schema).union(*(keywords(value) for value in schema.values()))
    if isinstance(schema, list):
        return set().union(*(keywords(value) for value in schema))
    return set()


def test_every_keyword_jsonschema_enforces_is_covered():
    """Each keyword the draft 2020-12 validator checks is in a corpus schema (enforced, walks validate) or
    in a refused one, so that a keyword the guide would drop cannot go unnoticed."""
    used = keywords([schema for _, schema, _ in CORPUS] + [schema for _, schema, _ in REFUSED])
    missing = set(jsonschema.Draft202012Validator.VALIDATORS) - used
    assert not missing, f"keywords neither enforced by a corpus schema nor refused: {sorted(missing)}"
