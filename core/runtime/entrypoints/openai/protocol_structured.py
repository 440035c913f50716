"""Structured output in requests: OpenAI's ``response_format``, vLLM's ``structured_outputs``
and the helpers that turn them into :class:`runtime.sampling_params.StructuredOutputsParams`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from runtime.entrypoints.openai.protocol_base import InvalidField, JsonObject, OpenAIBaseModel, check_free_json
from runtime.sampling_params import StructuredOutputsParams


class JsonSchemaFormat(OpenAIBaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str  # required, as in OpenAI's API and vLLM's protocol
    description: str | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request field; exactly one of json, regex, choice, grammar,
    json_object. vLLM's tuning options are accepted and ignored; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: JsonObject | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=4096)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options for its own backends: no effect here
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


# The request fields that ask for structured output, in the order errors name them.
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar")


def schema_dict(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text, as a dict."""
    if isinstance(value, str):  # an object was checked as a JsonObject field already; its text is checked here
        try:
            value = check_free_json(json.loads(value))
        except (ValueError, RecursionError) as exc:
            raise InvalidField(param, f"{param} is not valid JSON or is out of bounds: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidField(param, f"{param} must be a JSON schema object, got {type(value).__name__}")
    return value


def structured_params(param: str, **field: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**field)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("structured_outputs") and param != "structured_outputs":
            message = f"{param}: {message}"
        raise InvalidField(param, message) from None
