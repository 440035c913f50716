"""``llama3_json``: Llama 3.x JSON calls, ``{"name": ..., "parameters": {...}}``, possibly after
``<|python_tag|>``, several separated by ``;``. An output that does not start with a call is
content."""

from __future__ import annotations

from runtime.entrypoints.openai.tool_parsers.base import (
    CallDeltaTracker,
    DeltaToolCalls,
    ExtractedToolCalls,
    ToolParser,
    calls_of,
    register_tool_parser,
)
from runtime.entrypoints.openai.tool_parsers.json_scan import CallScan, Invalid, is_valid_call, scan_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


def calls_start(text: str) -> int | None:
    """Where the first call object starts: after optional whitespace and ``<|python_tag|>``;
    -1 if the text cannot start with calls, None if it is too short to tell."""
    i = skip_ws(text, 0)
    rest = text[i:]
    if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
        return None
    if rest.startswith(PYTHON_TAG):
        i = skip_ws(text, i + len(PYTHON_TAG))
        if i == len(text):
            return None
    return i if text[i] == "{" else -1


def scan_calls(text: str, i: int, scans: list[CallScan]) -> tuple[int, bool]:
    """Scan the ``;``-separated calls from ``text[i]`` into ``scans`` (the last may be open);
    returns where the next unread call starts and whether the text so far is well-formed."""
    while True:
        try:
            scan = scan_call(text, i)
        except Invalid:
            return i, False
        scans.append(scan)
        if not scan.complete:
            return i, True
        j = skip_ws(text, scan.end)
        if j < len(text) and text[j] == ";":
            j = skip_ws(text, j + 1)
        if j == len(text):
            return i, True  # the last call is complete; more may follow
        if text[j] != "{":
            return i, False
        i = j


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self._text = ""
        self._mode: str | None = None  # None: undecided, "content" or "calls"
        self._next = 0  # calls mode: where the first call not yet final starts
        self._done: list[CallScan] = []  # calls followed by more text (final)
        self._broken = False
        self._tracker = CallDeltaTracker()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = calls_start(text)
        if start is None or start < 0:
            return ExtractedToolCalls(text, [])
        scans: list[CallScan] = []
        i, ok = scan_calls(text, start, scans)
        if not ok or not scans or not all(s.complete and is_valid_call(text[s_start:s.end])
                                          for s, s_start in zip(scans, _starts(text, start, scans))):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls_of(scans))

    @property
    def num_streamed_calls(self) -> int:
        return self._tracker.num_calls

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaToolCalls:
        self._text += delta_text
        if self._mode is None:
            start = calls_start(self._text)
            if start is None:
                return DeltaToolCalls(None, [])
            if start < 0:
                self._mode = "content"
                return DeltaToolCalls(self._text, [])
            self._mode, self._next = "calls", start
        elif self._mode == "content":
            return DeltaToolCalls(delta_text or None, [])
        if self._broken:
            return DeltaToolCalls(None, [])
        scans: list[CallScan] = []
        last_start, ok = scan_calls(self._text, self._next, scans)
        self._broken = not ok
        calls = self._tracker.update(self._done + scans)
        if ok and scans:  # the calls before the last one are final: scan from the last one next time
            self._done += scans[:-1]
            self._next = last_start
        return DeltaToolCalls(None, calls)

    def finish(self) -> DeltaToolCalls:
        if self._mode is None:
            return DeltaToolCalls(self._text or None, [])
        if self._mode == "calls" and self._tracker.num_calls == 0:
            return DeltaToolCalls(self._text or None, [])  # no call came of it: it was content
        return DeltaToolCalls(None, [])


def _starts(text: str, start: int, scans: list[CallScan]) -> list[int]:
    """Where each scanned call starts."""
    starts = [start]
    for scan in scans[:-1]:
        j = skip_ws(text, scan.end)
        if j < len(text) and text[j] == ";":
            j = skip_ws(text, j + 1)
        starts.append(j)
    return starts
