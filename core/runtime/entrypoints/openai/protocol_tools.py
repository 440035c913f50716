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


_VALUE_KEYWORDS = frozenset({"const", "default", "enum", "examples"})  # their values are data, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # name -> schema


def _relocated(schema: Any, base: str, is_map: bool = False) -> Any:
    """``schema`` moved to the JSON pointer ``base`` of a larger schema: each local reference (``#`` or ``#/...``,
    which meant the schema's own root) made to start at ``base``. ``is_map``: ``schema`` maps names to schemas."""
    if isinstance(schema, list):
        return [_relocated(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {}
    for key, value in schema.items():
        if is_map:  # a property (or definition) name, whatever it is called
            moved[key] = _relocated(value, base)
        elif key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = base + value[1:]
        else:
            moved[key] = value if key in _VALUE_KEYWORDS else _relocated(value, base, key in _SCHEMA_MAPS)
    return moved


def named_tool_schema(tool: ChatTool) -> dict[str, Any]:
    """The output of a named tool choice: that function's arguments object."""
    return tool_parameters(tool)


def required_tools_schema(tools: list[ChatTool], parallel: bool = True) -> dict[str, Any]:
    """The output of ``tool_choice: "required"``: a JSON array of at least one (exactly one when not
    ``parallel``) ``{"name": ..., "parameters": {...}}``, each the name and arguments of one of ``tools``."""
    # Each tool's parameters sit in $defs under a name of their own, where their references (to their own $defs
    # or properties) are rewritten to resolve: two tools may both define "#/$defs/P", each its own.
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        key = f"parameters_{i}"
        defs[key] = _relocated(tool_parameters(tool), f"#/$defs/{key}")
        options.append({
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": {"$ref": f"#/$defs/{key}"},
            },
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema
