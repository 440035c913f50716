"""Reasoning parsers: split a model's text into its reasoning and its answer (``--reasoning-parser NAME``).

The chat API returns the reasoning in ``message.reasoning_content`` (streamed: ``delta.reasoning_content``)
and the rest in ``content``. :meth:`ReasoningParser.extract_reasoning` reads a whole output; the
streaming side is stateful, one parser per choice: :meth:`ReasoningParser.extract_reasoning_streaming`
gets each new piece of text and returns what can be told apart so far, and :meth:`ReasoningParser.finish`
flushes what was held back (a piece that might have been the start of a tag).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from runtime.entrypoints.openai.parser_registry import ParserRegistry


class Reasoning(NamedTuple):
    """A split of some text: None where a part is empty."""

    reasoning: str | None
    content: str | None


def join(pieces: list[str]) -> str | None:
    return "".join(pieces) or None


class ReasoningParser:
    """Base class of reasoning parsers; subclasses set ``name`` and implement the three methods.

    ``explicit_only``: reasoning only where the output marks it itself (a parser that otherwise assumes the
    output starts inside the reasoning, as deepseek_r1 does, then reads an unmarked output as content). The
    server sets it for outputs that a grammar constrains from their first token.
    """

    name: ClassVar[str] = ""

    def __init__(self, tokenizer=None, explicit_only: bool = False) -> None:
        self.tokenizer = tokenizer
        self.explicit_only = explicit_only

    def extract_reasoning(self, text: str) -> Reasoning:
        """The reasoning and the content of a whole output."""
        raise NotImplementedError

    def extract_reasoning_streaming(self, delta_text: str) -> Reasoning:
        """The reasoning and content that ``delta_text`` (the output's next piece) allows."""
        raise NotImplementedError

    def finish(self) -> Reasoning:
        """At the end of the output: what was held back."""
        return Reasoning(None, None)

    def reasoning_span(self, text: str) -> tuple[int, int] | None:
        """Where the reasoning of a whole output ``text`` lies, as ``(start, end)`` character offsets without its
        tags, or None for none; it counts ``usage.completion_tokens_details.reasoning_tokens``. Once ``end`` falls
        before the end of ``text``, more text must not move the span. A parser that does not say has no reasoning
        tokens counted."""
        return None


_REGISTRY: ParserRegistry[type[ReasoningParser]] = ParserRegistry(ReasoningParser, "reasoning parser")
register_reasoning_parser = _REGISTRY.register  # class decorator: ``--reasoning-parser NAME``
reasoning_parser_names = _REGISTRY.names
get_reasoning_parser = _REGISTRY.get
