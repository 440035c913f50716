"""``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2/3,
Qwen 2.5/3 and others); several may follow each other, text outside them is content."""

from __future__ import annotations

from runtime.entrypoints.openai.tool_parsers.base import (
    CallDeltaTracker,
    ContentStream,
    DeltaToolCalls,
    ExtractedToolCalls,
    ToolParser,
    calls_of,
    content_around_calls,
    join_deltas,
    partial_prefix_len,
    register_tool_parser,
)
from runtime.entrypoints.openai.tool_parsers.json_scan import CallScan, Invalid, is_valid_call, scan_call, skip_ws

START = "<tool_call>"
END = "</tool_call>"


def split_blocks(text: str) -> tuple[list[str], list[tuple[str, bool]]]:
    """The text outside the tags (one piece more than blocks) and each block's inner text with
    whether it was closed (the last may run to the end of the text)."""
    pieces: list[str] = []
    blocks: list[tuple[str, bool]] = []
    pos = 0
    while True:
        start = text.find(START, pos)
        if start == -1:
            pieces.append(text[pos:])
            return pieces, blocks
        pieces.append(text[pos:start])
        inner = start + len(START)
        end = text.find(END, inner)
        if end == -1:  # cut short (finish_reason "length"), maybe inside the end tag: that part is left out
            blocks.append((text[inner:len(text) - partial_prefix_len(text, inner, END)], False))
            pieces.append("")
            return pieces, blocks
        blocks.append((text[inner:end], True))
        pos = end + len(END)


def scan_block(inner: str) -> CallScan | None:
    """The call a block's text holds so far; None if it cannot be one."""
    i = skip_ws(inner, 0)
    if i == len(inner):
        return CallScan()
    try:
        return scan_call(inner, i)
    except Invalid:
        return None


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self._text = ""
        self._pos = 0  # outside a block: where unread content starts
        self._block_start: int | None = None  # inside a block: where its text starts
        self._block_scan = CallScan()  # the open block's last good scan
        self._scans: list[CallScan] = []  # closed blocks that are calls
        self._content = ContentStream()
        self._tracker = CallDeltaTracker()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        pieces, blocks = split_blocks(text)
        if not blocks:
            return ExtractedToolCalls(text, [])
        scans = []
        for inner, _closed in blocks:
            if not is_valid_call(inner.strip()):
                return ExtractedToolCalls(text, [])  # a malformed call: all of it is content
            scans.append(scan_block(inner))
        return ExtractedToolCalls(content_around_calls(pieces), calls_of(scans))

    @property
    def num_streamed_calls(self) -> int:
        return self._tracker.num_calls

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaToolCalls:
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> DeltaToolCalls:
        result = self._advance(final=True)
        unread = None
        if self._block_start is not None and self._block_scan.name is None:  # an open block that never made a call
            unread = self._content.not_a_call(self._text[self._block_start - len(START):])
        tail = self._content.flush()
        return DeltaToolCalls(join_deltas([result.content, unread, tail]), result.calls)

    def _advance(self, final: bool) -> DeltaToolCalls:
        text = self._text
        content: list[str] = []
        calls = []
        while True:
            if self._block_start is None:
                start = text.find(START, self._pos)
                if start == -1:
                    safe = len(text) if final else len(text) - partial_prefix_len(text, self._pos, START)
                    content.append(self._content.push(text[self._pos:safe]))
                    self._pos = safe
                    break
                content.append(self._content.push(text[self._pos:start]))
                self._content.call_starts()
                self._block_start = start + len(START)
                self._block_scan = CallScan()
            end = text.find(END, self._block_start)
            inner = text[self._block_start:] if end == -1 else text[self._block_start:end]
            scan = scan_block(inner)
            if scan is not None:
                self._block_scan = scan
            calls += self._tracker.update(self._scans + [self._block_scan])
            if end == -1:
                break
            if self._block_scan.name is not None:
                self._scans.append(self._block_scan)
                self._content.call_ends()
            else:  # not a call: its text is content, as written
                content.append(self._content.not_a_call(START + inner + END))
            self._block_start = None
            self._pos = end + len(END)
        return DeltaToolCalls(join_deltas(content), calls)
