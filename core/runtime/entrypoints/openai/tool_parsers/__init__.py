"""Tool-call parsers for ``tool_choice: "auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``)."""

from runtime.entrypoints.openai.tool_parsers.base import (
    DeltaToolCalls,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    new_tool_call_id,
    register_tool_parser,
    tool_parser_names,
)
from runtime.entrypoints.openai.tool_parsers import hermes, llama3_json  # noqa: F401 - they register themselves

__all__ = [
    "DeltaToolCalls",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "new_tool_call_id",
    "register_tool_parser",
    "tool_parser_names",
]
