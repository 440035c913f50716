"""Tool-call parsers: turn a model's text into OpenAI tool calls (``tool_choice: "auto"``).

A parser is chosen with ``--tool-call-parser NAME`` (with ``--enable-auto-tool-choice``).
:meth:`ToolParser.extract_tool_calls` reads a whole output; the streaming side is stateful,
one parser per choice: :meth:`ToolParser.extract_tool_calls_streaming` gets each new piece of
text and returns the content and tool-call deltas it allows, and :meth:`ToolParser.finish`
flushes what was held back at the end. The deltas of a well-formed output assemble to exactly
the calls that :meth:`extract_tool_calls` returns for it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from runtime.entrypoints.openai.parser_registry import ParserRegistry
from runtime.entrypoints.openai.tool_parsers.json_scan import CallScan


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One complete call: ``arguments`` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ToolCallDelta:
    """A piece of the call at ``index``: its first delta carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ExtractedToolCalls(NamedTuple):
    content: str | None
    calls: list[ToolCall]


class DeltaToolCalls(NamedTuple):
    content: str | None
    calls: list[ToolCallDelta]


class CallDeltaTracker:
    """Sends the calls that scans reveal: a call's id and name once its name is complete, then the
    growth of its raw arguments. Calls go out in order; later ones wait for earlier names."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.names: list[str] = []
        self.sent_args: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def update(self, scans: list[CallScan]) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        for index, scan in enumerate(scans):
            if index >= len(self.ids):
                if scan.name is None:
                    break
                self.ids.append(new_tool_call_id())
                self.names.append(scan.name)
                self.sent_args.append(0)
                delta = ToolCallDelta(index=index, id=self.ids[index], name=scan.name, arguments="")
                deltas.append(delta)
            else:
                delta = None
            new = scan.arguments[self.sent_args[index]:]
            if new:
                self.sent_args[index] = len(scan.arguments)
                if delta is None:
                    deltas.append(ToolCallDelta(index=index, arguments=new))
                else:
                    delta.arguments = new
        return deltas


def calls_of(scans: list[CallScan]) -> list[ToolCall]:
    """The calls of a whole output's scans, in order, up to the first without a name."""
    calls = []
    for scan in scans:
        if scan.name is None:
            break
        calls.append(ToolCall(name=scan.name, arguments=scan.arguments))
    return calls


class ContentStream:
    """Content around tool calls, streamed as :func:`content_around_calls` joins it: whitespace
    next to a call is dropped (so trailing whitespace waits until more text follows), and text
    on both sides of calls is joined by a newline."""

    def __init__(self) -> None:
        self.pending = ""
        self.held = ""  # the whitespace before the block that may be a call, for when it is not one
        self.after_call = False
        self.emitted = False

    def push(self, piece: str) -> str:
        if self.after_call:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.after_call = False
            if self.emitted:
                piece = "\n" + piece
        text = self.pending + piece
        body = text.rstrip()
        self.pending = text[len(body):]
        self.emitted = self.emitted or bool(body)
        return body

    def call_starts(self) -> None:
        self.held, self.pending = self.pending, ""

    def not_a_call(self, text: str) -> str:
        """The text of a block that turned out not to be a call: content as written, with the whitespace before it."""
        held, self.held = self.held, ""
        return self.push(held + text)

    def call_ends(self) -> None:
        self.after_call = True

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def content_around_calls(pieces: list[str]) -> str | None:
    """The content of the text ``pieces`` around calls (one more piece than calls): whitespace
    next to a call dropped, what is left joined by newlines; None if nothing is left."""
    last = len(pieces) - 1
    parts = []
    for i, piece in enumerate(pieces):
        if i > 0:
            piece = piece.lstrip()
        if i < last:
            piece = piece.rstrip()
        if piece:
            parts.append(piece)
    return "\n".join(parts) or None


def partial_prefix_len(text: str, start: int, token: str) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``token``
    (text to hold back: the token may be arriving)."""
    for size in range(min(len(token) - 1, len(text) - start), 0, -1):
        if token.startswith(text[len(text) - size:]):
            return size
    return 0


def join_deltas(pieces: list[str | None]) -> str | None:
    text = "".join(p for p in pieces if p)
    return text or None


class ToolParser:
    """Base class of tool-call parsers; subclasses set ``name`` and implement the three methods."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The content (None if there is none) and the calls of a whole output; a malformed
        call leaves the whole text as content and no calls."""
        raise NotImplementedError

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaToolCalls:
        """The content and call deltas that ``delta_text`` (the output's next piece) allows."""
        raise NotImplementedError

    def finish(self) -> DeltaToolCalls:
        """At the end of the output: what was held back."""
        return DeltaToolCalls(None, [])

    @property
    def num_streamed_calls(self) -> int:
        """How many calls the streaming side has started."""
        return 0


_REGISTRY: ParserRegistry[type[ToolParser]] = ParserRegistry(ToolParser, "tool call parser")
register_tool_parser = _REGISTRY.register  # class decorator: ``--tool-call-parser NAME``
tool_parser_names = _REGISTRY.names
get_tool_parser = _REGISTRY.get
