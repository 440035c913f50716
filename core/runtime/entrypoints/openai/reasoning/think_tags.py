"""Reasoning in a ``<think>`` ... ``</think>`` block at the start of the output (DeepSeek-R1, Qwen3 and others).

The tags are read in the decoded text, so they may be single tokens or spelled over several. A start tag
counts only at the start of the output (after whitespace); the first end tag after it closes the reasoning,
and everything after it is content, as written. An output cut short inside the block is all reasoning.
"""

from __future__ import annotations

from runtime.entrypoints.openai.reasoning.base import Reasoning, ReasoningParser, join

START = "<think>"
END = "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may be arriving)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkScanner:
    """The streaming state of one output: where it is (before a possible start tag, in the reasoning, in
    the content) and the text held back because it may be part of a tag."""

    def __init__(self, starts_in_reasoning: bool, phase: str = "start") -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.phase = phase  # "start" | "reasoning" | "content"
        self.held = ""

    def push(self, piece: str) -> Reasoning:
        text, self.held = self.held + piece, ""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.phase == "start":
                body = text.lstrip()
                if body.startswith(START):
                    self.phase, text = "reasoning", body[len(START):]
                    continue
                if START.startswith(body):  # whitespace so far, or the start tag arriving
                    self.held = text
                    break
                self.phase = "reasoning" if self.starts_in_reasoning else "content"
                continue
            if self.phase == "reasoning":
                end = text.find(END)
                if end != -1:
                    reasoning.append(text[:end])
                    self.phase, text = "content", text[end + len(END):]
                    continue
                keep = partial_tag_len(text, END)
                reasoning.append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            content.append(text)
            break
        return Reasoning(join(reasoning), join(content))

    def finish(self) -> Reasoning:
        held, self.held = self.held, ""
        if self.phase == "start" and not self.starts_in_reasoning:
            return Reasoning(None, held or None)
        return Reasoning(held or None, None)  # a start that never came, or an end tag cut short


class ThinkTagReasoningParser(ReasoningParser):
    """``starts_in_reasoning``: an output without the start tag is reasoning up to the end tag (the chat
    template opened the block in the prompt), and all reasoning without one; else it is content.

    ``prompt``: how the prompt left the block, where the server knows (:func:`..grammar_start.prompt_block`):
    "opened" (it ends with the start tag: the output starts in the reasoning, whatever the parser assumes),
    "closed" (it ends with the end tag, as Qwen3's template writes with ``enable_thinking: false``: the output is
    all content), or None (the output says)."""

    starts_in_reasoning = False

    def __init__(self, tokenizer=None, explicit_only: bool = False, prompt: str | None = None) -> None:
        super().__init__(tokenizer, explicit_only)
        if prompt not in (None, "opened", "closed"):
            raise ValueError(f"prompt {prompt!r} is not valid; valid: None, 'opened', 'closed'")
        self.prompt = prompt
        self._scanner = self._new_scanner()

    def _new_scanner(self) -> ThinkScanner:
        phase = {"opened": "reasoning", "closed": "content"}.get(self.prompt, "start")
        return ThinkScanner(self.starts_in_reasoning and not self.explicit_only, phase)

    def extract_reasoning(self, text: str) -> Reasoning:
        scanner = self._new_scanner()
        first, last = scanner.push(text), scanner.finish()
        return Reasoning(join([first.reasoning or "", last.reasoning or ""]),
                         join([first.content or "", last.content or ""]))

    def extract_reasoning_streaming(self, delta_text: str) -> Reasoning:
        return self._scanner.push(delta_text)

    def finish(self) -> Reasoning:
        return self._scanner.finish()

    def reasoning_span(self, text: str) -> tuple[int, int] | None:
        """As the scanner reads ``text``: after a start tag that opens it (after whitespace), or from the start where
        the output starts in the reasoning; up to the first end tag after that, or the end."""
        body = len(text) - len(text.lstrip())
        if self.prompt == "closed":
            return None
        if self.prompt == "opened":
            start = 0
        elif text.startswith(START, body):
            start = body + len(START)
        elif self.starts_in_reasoning and not self.explicit_only:
            start = 0
        else:
            return None
        end = text.find(END, start)
        return start, len(text) if end == -1 else end
