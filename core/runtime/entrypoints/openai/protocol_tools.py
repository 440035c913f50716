"""OpenAI tool calling in requests: function tools, tool choices, tool calls in messages, and the
JSON schemas that constrain ``tool_choice: "required"`` and named-function outputs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from runtime.entrypoints.openai.protocol_base import JsonObject, OpenAIBaseModel


class FunctionCallIn(OpenAIBaseModel):
    name: str
    arguments: str | JsonObject = "{}"


class ToolCallIn(OpenAIBaseModel):
    """A call in an assistant message of the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


# ------------------------------------------------------------------------ tools
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None  # constrained calls always follow the schema


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


MAX_TOOLS = 512


def tool_parameters(tool: ChatTool) -> dict[str, Any]:
    """A function's parameters schema (an object with any fields when it has none)."""
    params = tool.function.parameters
    return params if params else {"type": "object"}


def _hoist_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without its ``$defs``/``definitions``, which move into ``defs`` (nested under a
    new root, ``#/$defs/X`` references still resolve there)."""
    schema = dict(schema)
    for key in ("$defs", "definitions"):
        inner = schema.pop(key, None)
        if isinstance(inner, dict):
            defs.setdefault(key, {}).update(inner)
    return schema


def named_tool_schema(tool: ChatTool) -> dict[str, Any]:
    """The output of a named tool choice: that function's arguments object."""
    return tool_parameters(tool)


def required_tools_schema(tools: list[ChatTool]) -> dict[str, Any]:
    """The output of ``tool_choice: "required"``: a JSON array of at least one
    ``{"name": ..., "parameters": {...}}``, each the name and arguments of one of ``tools``."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        options.append({
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _hoist_defs(tool_parameters(tool), defs),
            },
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    schema.update(defs)
    return schema
