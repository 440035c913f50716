"""A tolerant scanner for tool-call JSON that may still be growing (streamed text).

A tool call is a JSON object with a ``"name"`` string and its arguments under ``"arguments"``
or ``"parameters"``. :func:`scan_call` reads such an object from a prefix of the final text
and reports what is known so far: the name once its string is complete, and the raw text of
the arguments seen so far. The raw arguments of a prefix are always a prefix of the final
raw arguments, so a stream that sends the new part each time assembles to exactly the text
that scanning the whole output gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\n\r"
_STRUCTURAL = re.compile(r'["{}\[\]]')
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")


class Incomplete(Exception):
    """The text ends inside the value."""


class Invalid(Exception):
    """The text cannot be the start of the expected JSON."""


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> int:
    """Index after the JSON string starting at ``text[i] == '"'``."""
    j = i + 1
    n = len(text)
    while True:
        quote = text.find('"', j)
        slash = text.find("\\", j, quote if quote != -1 else n)
        if slash != -1:
            if slash + 1 >= n:
                raise Incomplete
            j = slash + 2
            continue
        if quote == -1:
            raise Incomplete
        return quote + 1


def scan_value(text: str, i: int) -> int:
    """Index after the JSON value starting at ``text[i]`` (containers only checked for balance)."""
    n = len(text)
    if i >= n:
        raise Incomplete
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        depth = 0
        j = i
        while True:
            match = _STRUCTURAL.search(text, j)
            if match is None:
                raise Incomplete
            k = match.start()
            ch = text[k]
            if ch == '"':
                j = scan_string(text, k)
                continue
            if ch in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return k + 1
            j = k + 1
    for literal in _LITERALS:
        if text.startswith(literal, i):
            return i + len(literal)
        if literal.startswith(text[i:]):
            raise Incomplete
    match = _NUMBER.match(text, i)
    if match is None:
        if text[i:] in ("-",):
            raise Incomplete
        raise Invalid(f"unexpected {c!r}")
    if match.end() == n:
        raise Incomplete  # more digits may follow
    return match.end()


@dataclass
class CallScan:
    """What a (possibly partial) tool-call object tells so far."""

    name: str | None = None  # once the name's string is complete
    arguments: str = ""  # raw JSON text of the arguments so far (decoded, if they were given as a string)
    arguments_done: bool = False
    end: int | None = None  # index after the object's closing brace; None while open
    has_name_key: bool = False

    @property
    def complete(self) -> bool:
        return self.end is not None


def scan_call(text: str, i: int) -> CallScan:
    """Scan the call object starting at ``text[i] == '{'``; Invalid if it cannot be one."""
    if i >= len(text) or text[i] != "{":
        raise Invalid("a tool call must be a JSON object")
    scan = CallScan()
    n = len(text)
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return scan
        c = text[j]
        if c == "}":
            scan.end = j + 1
            if not scan.arguments_done and not scan.arguments:
                scan.arguments, scan.arguments_done = "{}", True  # no arguments given: none needed
            return scan
        if c == ",":
            j += 1
            continue
        if c != '"':
            raise Invalid(f"unexpected {c!r} in a tool call object")
        try:
            key_end = scan_string(text, j)
        except Incomplete:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return scan
        if text[j] != ":":
            raise Invalid(f"expected ':' after key {key!r}")
        j = skip_ws(text, j + 1)
        if j >= n:
            return scan
        try:
            value_end = scan_value(text, j)
        except Incomplete:
            if key in ARGUMENT_KEYS and text[j] in "{[":
                scan.arguments = text[j:]  # a growing container: its text so far is a prefix of the final one
            if key == "name":
                scan.has_name_key = True
            return scan
        raw = text[j:value_end]
        if key == "name":
            scan.has_name_key = True
            try:
                name = json.loads(raw)
            except ValueError:
                raise Invalid("the tool call's name is not a JSON string") from None
            if not isinstance(name, str):
                raise Invalid("the tool call's name is not a string")
            scan.name = name
        elif key in ARGUMENT_KEYS and not scan.arguments_done:
            if raw.startswith('"'):
                try:
                    raw = json.loads(raw)  # arguments given as a JSON string: OpenAI's form already
                except ValueError:
                    raise Invalid("the tool call's arguments are not valid JSON") from None
            scan.arguments, scan.arguments_done = raw, True
        j = value_end


def is_valid_call(raw: str) -> bool:
    """Whether ``raw`` is one complete tool call: an object with a string name and object (or string) arguments."""
    try:
        call = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return False
    args = next((call[k] for k in ARGUMENT_KEYS if k in call), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return False
    return isinstance(args, dict)
