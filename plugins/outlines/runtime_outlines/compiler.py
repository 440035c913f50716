"""Specs -> regular expressions -> outlines-core indexes: the part of a compile that runs in the
engine's grammar sandbox (a child process under a memory limit, killed at the time limit).

It imports neither torch nor the engine's model code: the sandbox starts a fresh process for it
again after a compile is killed. :class:`SpecCompiler` holds the outlines-core vocabulary (which
pickles) and returns a :class:`CompiledIndex`; ``runtime_outlines.backend`` wraps it into grammars.

Every kind becomes one regular expression that the whole output must match (JSON schemas
through outlines-core's ``build_regex_from_schema``, choices as an escaped alternation, any
JSON object through a bounded-depth generic regex). Compiling builds the outlines-core
``Index`` (the token-level automaton over the tokenizer's vocabulary), the expensive part.

Before outlines-core sees a JSON schema, its ``$ref`` are written out in place
(:mod:`runtime_outlines.schema_refs`) and its combinators and boolean sub-schemas rewritten into
schemas outlines-core follows exactly, each ``oneOf`` checked to be one
(:mod:`runtime_outlines.schema_merge`, :mod:`runtime_outlines.schema_oneof`). Then sub-schemas it
gets wrong or makes huge are swapped for placeholder consts whose literal is then replaced in its regex by our own: bounded
``integer``/``number`` schemas (outlines-core 0.2.14 ignores minimum/maximum; see
:mod:`runtime_outlines.numbers`), ``format`` strings and patterns that could match unescaped quotes
(:mod:`runtime_outlines.schema_features`, which also refuses the keywords outlines-core ignores, such as
``multipleOf``) and nested any-field objects
(``{"type": "object"}``, e.g. a tool without parameters), which get the bounded-depth generic
object regex, as any-value sub-schemas (``{}``, annotations only) get the generic value regex.
``enum``/``const`` values are kept to those the rest of their schema allows
(:func:`runtime_outlines.schema_features.enum_schema`), and those listing objects or arrays get our
own regex of their compact JSON (outlines-core leaves the strings inside them unescaped).

Compile time is the automaton's state count times the vocabulary (outlines-core walks every
token from every state: ~1 ms per state for SmolLM2's 49k tokens on a loaded CPU). Bounded
strings cost ~10 states per allowed character (UTF-8), and array items appear twice in the
regex (``item(,item)*``, the DFA is not minimized). A top-level string with a maxLength over
~15 is pathological in outlines-core 0.2.14 (its DFA also determinizes the unanchored start,
which is exponential in the bound for ``"`` followed by escaped quotes). Counted repetitions
(``a{20000}``) cost memory and time in proportion: the sandbox's limits bound them.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from runtime.structured_output import GuidedKind
from runtime_outlines.numbers import bounded_number_regex, replace_subschemas, subschema_depth
from runtime_outlines.schema_features import check_supported, enum_schema, format_regex, pattern_schema
from runtime_outlines.schema_merge import normalize
from runtime_outlines.schema_refs import inline_refs

# Whitespace allowed between JSON tokens: at most one space or newline. An unbounded pattern
# (``[ \n\t]*``) lets small models emit whitespace forever, and pretty-printing indentation
# multiplies the automaton's states; compact or one-line JSON always fits.
DEFAULT_WHITESPACE = r"[ \n]?"
# Nesting depth of the generic regex for ``json_object`` (object -> values -> nested objects
# or arrays -> their values are scalars). Each level multiplies the automaton's states.
JSON_OBJECT_DEPTH = 2
# Depth of the generic regex for an object of any fields inside a schema (a tool without
# parameters in a tool-calling schema): its values are scalars or flat objects/arrays.
NESTED_JSON_OBJECT_DEPTH = 2
# Deeper schemas are refused before outlines-core sees them: its regex doubles with each level of
# nested arrays (an item appears twice), so a schema 60 arrays deep asked for memory until the engine
# process was killed (a fuzzed request, session 31), and 12 levels already take ~20 s to compile.
MAX_SCHEMA_DEPTH = 16

SUPPORTED_KINDS = "json, regex, choice and json_object"

# Characters with a meaning in Rust regex syntax (regex-syntax's meta characters).
_RUST_META = set("\\.+*?()|[]{}^$#&-~")


def escape_regex(text: str) -> str:
    """``text`` as a literal in Rust regex syntax (outlines-core's regex engine)."""
    out = []
    for ch in text:
        if ch in _RUST_META:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")  # valid in Rust and Python regex syntax
        else:
            out.append(ch)
    return "".join(out)


def json_object_regex(whitespace: str = DEFAULT_WHITESPACE, depth: int = JSON_OBJECT_DEPTH, *,
                      any_value: bool = False) -> str:
    """Any JSON object whose values nest at most ``depth`` objects/arrays deep (outlines-core's
    own regex for ``{"type": "object"}`` takes seconds to compile and gigabytes of memory); with
    ``any_value``, any JSON value nested at most ``depth`` deep (for ``{}``: outlines-core's own
    regex for an array of any items took six minutes to compile on SmolLM2)."""
    ws = f"(?:{whitespace})"
    string = r'"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
    number = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
    value = f"(?:{string}|{number}|true|false|null)"

    def obj(inner: str) -> str:
        member = f"{string}{ws}:{ws}{inner}"
        return rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*)?{ws}\}}"

    def arr(inner: str) -> str:
        return rf"\[{ws}(?:{inner}(?:{ws},{ws}{inner})*)?{ws}\]"

    for _ in range(depth - 1):
        value = f"(?:{value}|{obj(value)}|{arr(value)})"
    return f"(?:{value}|{obj(value)}|{arr(value)})" if any_value else obj(value)


def validator_for(schema: dict):
    """The jsonschema validator class of ``schema``'s ``$schema`` (draft 2020-12 by default)."""
    from jsonschema.validators import Draft202012Validator, validator_for as find

    try:
        return find(schema, default=Draft202012Validator)
    except Exception:  # a $schema that is not a URI string
        return Draft202012Validator


def _strip_anchors(regex: str) -> str:
    """Drop a leading ``^`` / trailing ``$``: the whole output must match anyway, and
    outlines-core's DFA has no start state for anchored patterns."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex[:-1]) - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:  # not an escaped \$
            regex = regex[:-1]
    return regex


_UNSUPPORTED_FEATURES = (
    (re.compile(r"(?<!\\)\(\?<?[=!]"), "lookaround assertions ((?=...), (?!...), (?<=...), (?<!...))"),
    (re.compile(r"(?<!\\)\\[1-9]"), "backreferences (\\1 ...)"),
    (re.compile(r"(?<!\\)\\[bB]"), "word boundaries (\\b, \\B)"),
    (re.compile(r"(?<!\\)\\[AzZ]|(?<![\\\[])[\^$]"), "anchors (^, $, \\A, \\z) other than at the very start and end"),
)


def _explain_regex_error(regex: str) -> str:
    found = [name for pattern, name in _UNSUPPORTED_FEATURES if pattern.search(regex)]
    if found:
        return "; outlines-core (Rust regex syntax, compiled to a DFA) does not support " + ", ".join(found)
    return "; check the syntax (outlines-core uses Rust regex syntax, compiled to a DFA)"



_ANNOTATION_KEYS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}


def literal_values_regex(node: dict) -> str | None:
    """Our regex for an ``enum``/``const`` listing an object or array (outlines-core writes the
    strings inside them unescaped: the key ``k"`` became ``"k""``): each value as compact JSON,
    longest first (outlines-core's DFA cuts off an alternative that extends an earlier one)."""
    values = node["enum"] if "enum" in node else [node["const"]] if "const" in node else None
    if not isinstance(values, list) or not any(isinstance(v, (dict, list)) for v in values):
        return None
    texts = {json.dumps(v, separators=(",", ":"), ensure_ascii=False) for v in values}
    return "|".join(escape_regex(text) for text in sorted(texts, key=len, reverse=True))


_GENERIC_OBJECT_KEYS = {"type", "title", "description", "$schema", "additionalProperties", "properties"}


def _is_generic_object(schema) -> bool:
    """``{"type": "object"}`` with nothing that constrains its fields (annotations,
    ``additionalProperties: true`` or ``properties: {}`` at most): any JSON object."""
    return (
        isinstance(schema, dict)
        and schema.get("type") == "object"
        and set(schema) <= _GENERIC_OBJECT_KEYS
        and schema.get("additionalProperties", True) is True
        and schema.get("properties", {}) == {}
    )


@dataclass
class CompiledIndex:
    """What a compile returns to the engine (pickled, from the sandbox): the regex and its index."""

    regex: str
    index: object  # outlines_core.Index
    seconds: float


class SpecCompiler:
    """``compiler(kind, spec) -> CompiledIndex`` for one vocabulary (picklable: the sandbox's compiler)."""

    def __init__(self, vocabulary, whitespace_pattern: str = DEFAULT_WHITESPACE):
        self.vocabulary = vocabulary  # outlines_core.Vocabulary
        self.whitespace_pattern = whitespace_pattern

    def __call__(self, kind: GuidedKind | str, spec: str) -> CompiledIndex:
        from outlines_core import Index

        regex = self.to_regex(kind, spec)  # checks the kind
        kind_value = GuidedKind(kind)
        start = time.perf_counter()
        try:
            index = Index(regex, self.vocabulary)
        except ValueError as exc:
            raise ValueError(self._index_error(kind_value, spec, regex, exc)) from None
        return CompiledIndex(regex, index, time.perf_counter() - start)

    # -------------------------------------------------------------- spec -> regex
    def to_regex(self, kind: GuidedKind | str, spec: str) -> str:
        """The regular expression the whole output must match for ``(kind, spec)``."""
        try:
            kind = GuidedKind(kind)
        except ValueError:
            raise ValueError(f"unknown structured output kind {kind!r}; outlines supports {SUPPORTED_KINDS}") from None
        if kind is GuidedKind.JSON:
            return self._json_regex(spec)
        if kind is GuidedKind.JSON_OBJECT:
            return json_object_regex(self.whitespace_pattern)
        if kind is GuidedKind.REGEX:
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"the regex must be a non-empty string, got {spec!r}")
            return _strip_anchors(spec)
        if kind is GuidedKind.CHOICE:
            return self._choice_regex(spec)
        raise ValueError(
            f"the outlines guided decoding backend supports {SUPPORTED_KINDS}, not {kind.value} "
            "(EBNF/Lark grammars need a grammar backend such as xgrammar or llguidance)"
        )

    def _json_regex(self, spec: str) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        try:
            schema = json.loads(spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if isinstance(schema, bool) or schema == {}:
            # true / {}: any JSON value; an object is the useful, compilable subset.
            if schema is False:
                raise ValueError("the JSON schema is false: no output can match it")
            return json_object_regex(self.whitespace_pattern)
        if not isinstance(schema, dict):
            raise ValueError(f"the JSON schema must be an object, got {type(schema).__name__}")
        depth = subschema_depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"the JSON schema nests sub-schemas {depth} levels deep; the outlines backend compiles at most "
                f"{MAX_SCHEMA_DEPTH} (its automaton grows exponentially with nesting)"
            )
        check_supported(schema, keywords_only=True)
        validator_class = validator_for(schema)
        schema = inline_refs(schema)
        depth = subschema_depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"the JSON schema nests sub-schemas {depth} levels deep once its $refs are written out; the outlines "
                f"backend compiles at most {MAX_SCHEMA_DEPTH} (its automaton grows exponentially with nesting)"
            )
        schema = normalize(schema, validator_class)
        if schema == {}:
            return json_object_regex(self.whitespace_pattern)
        check_supported(schema)  # again: merged sub-schemas may combine keywords outlines-core ignores
        if _is_generic_object(schema):
            return json_object_regex(self.whitespace_pattern)  # outlines-core's generic object is huge
        generic_object = json_object_regex(self.whitespace_pattern, NESTED_JSON_OBJECT_DEPTH)

        def replacement(node: dict):
            # What outlines-core 0.2.14 gets wrong or makes huge, as our own regexes.
            if _is_generic_object(node):
                return generic_object
            if node and set(node) <= _ANNOTATION_KEYS or node is not schema and not node:  # any value
                return json_object_regex(self.whitespace_pattern, NESTED_JSON_OBJECT_DEPTH, any_value=True)
            if (node.get("type") == "object" and node.get("additionalProperties") is False
                    and not isinstance(node.get("properties"), dict)):
                return {**node, "properties": {}}  # no fields at all: outlines-core needs the empty map
            listed = enum_schema(node, validator_class)  # the values of an enum/const that the rest of its schema allows
            literal = literal_values_regex(listed or node)
            if literal is not None:
                return literal
            return listed or bounded_number_regex(node) or format_regex(node) or pattern_schema(node)

        try:
            rewritten, placeholders = replace_subschemas(schema, replacement, spec)
        except ValueError as exc:
            raise ValueError(f"unsupported or invalid JSON schema: {exc}") from None
        try:
            regex = build_regex_from_schema(json.dumps(rewritten), self.whitespace_pattern)
        except (TypeError, ValueError) as exc:
            message = " ".join(str(exc).split())
            raise ValueError(f"unsupported or invalid JSON schema: {message}") from None
        for token, sub_regex in placeholders.items():
            # outlines-core writes a string const as its JSON text, quotes included.
            regex = regex.replace(f'"{token}"', f"(?:{sub_regex})")
        return regex

    @staticmethod
    def _choice_regex(spec: str) -> str:
        try:
            choices = json.loads(spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"choice must be a JSON list of strings: {exc}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"choice must be a non-empty list of strings, got {spec!r}")
        # outlines-core's DFA has leftmost-first semantics: once an alternative matched, later
        # (lower-priority) alternatives that extend it are cut off, so "a|ab" never yields "ab".
        # Longest first keeps every choice reachable.
        ordered = sorted(dict.fromkeys(choices), key=len, reverse=True)
        return "(?:" + "|".join(escape_regex(c) for c in ordered) + ")"

    @staticmethod
    def _index_error(kind: GuidedKind, spec: str, regex: str, exc: Exception) -> str:
        detail = " ".join(str(exc).split())
        if "incompatible with the regex" in detail:
            what = "regex" if kind is GuidedKind.REGEX else kind.value
            return (
                f"no sequence of this model's tokens can produce the {what}: {detail}"
            )
        if kind is GuidedKind.REGEX:
            return f"the regex {_short(spec)} cannot be compiled: {detail}{_explain_regex_error(regex)}"
        return f"the {kind.value} spec compiled to a regex outlines-core cannot use: {detail}"


def _short(text: str, limit: int = 200) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."
