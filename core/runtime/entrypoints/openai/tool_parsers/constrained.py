"""Tool calls of ``tool_choice: "required"`` and of a named function: the output is constrained
by a JSON schema (see ``protocol.required_tools_schema``), so these "parsers" only read it.

Named: the whole output is the arguments object of that function. Required: the output is a
JSON array of ``{"name": ..., "parameters": {...}}``.
"""

from __future__ import annotations

from runtime.entrypoints.openai.tool_parsers.base import (
    CallDeltaTracker,
    DeltaToolCalls,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    calls_of,
    new_tool_call_id,
)
from runtime.entrypoints.openai.tool_parsers.json_scan import CallScan, Invalid, scan_call, skip_ws


class NamedToolCalls(ToolParser):
    """The output is the arguments of ``function_name``: one call."""

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name
        self._id: str | None = None

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if not text:
            return ExtractedToolCalls(None, [])
        return ExtractedToolCalls(None, [ToolCall(name=self.function_name, arguments=text)])

    @property
    def num_streamed_calls(self) -> int:
        return int(self._id is not None)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaToolCalls:
        if not delta_text:
            return DeltaToolCalls(None, [])
        if self._id is None:
            self._id = new_tool_call_id()
            return DeltaToolCalls(None, [ToolCallDelta(0, id=self._id, name=self.function_name, arguments=delta_text)])
        return DeltaToolCalls(None, [ToolCallDelta(0, arguments=delta_text)])


def scan_call_array(text: str) -> list[CallScan]:
    """The calls of a (possibly partial) JSON array of call objects; stops at anything else."""
    scans: list[CallScan] = []
    i = skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return scans
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text) or text[i] == "]":
            return scans
        if text[i] == ",":
            i += 1
            continue
        try:
            scan = scan_call(text, i)
        except Invalid:
            return scans
        scans.append(scan)
        if not scan.complete:
            return scans
        i = scan.end


class RequiredToolCalls(ToolParser):
    """The output is a JSON array of calls."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._tracker = CallDeltaTracker()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls = calls_of(scan_call_array(text))
        return ExtractedToolCalls(None if calls else (text or None), calls)

    @property
    def num_streamed_calls(self) -> int:
        return self._tracker.num_calls

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaToolCalls:
        self._text += delta_text
        return DeltaToolCalls(None, self._tracker.update(scan_call_array(self._text)))

    def finish(self) -> DeltaToolCalls:
        if self._tracker.num_calls == 0:
            return DeltaToolCalls(self._text or None, [])
        return DeltaToolCalls(None, [])
