"""Structured-output request fields -> StructuredOutputsParams (no model): OpenAI's response_format,
vLLM's structured_outputs and guided_* fields, tool choices; conflicts and bad values name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runtime.entrypoints.openai.errors import from_exception
from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, InvalidField
from runtime.sampling_params import StructuredOutputsParams

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}, {"type": "function", "function": {"name": "g"}}]


def chat_params(**fields):
    request = ChatCompletionRequest(messages=MESSAGES, **fields)
    request.check_supported()
    return request.to_sampling_params().structured_outputs


@pytest.mark.parametrize("fields, expected", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
     StructuredOutputsParams(json=SCHEMA)),
    (dict(response_format={"type": "json_object"}), StructuredOutputsParams(json_object=True)),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), StructuredOutputsParams(json_object=True)),
    (dict(response_format={"type": "text"}), None),
    (dict(structured_outputs={"json": SCHEMA}), StructuredOutputsParams(json=SCHEMA)),
    (dict(structured_outputs={"json": '{"type": "integer"}'}), StructuredOutputsParams(json={"type": "integer"})),
    (dict(structured_outputs={"regex": "a+", "disable_any_whitespace": True}), StructuredOutputsParams(regex="a+")),
    (dict(structured_outputs={"choice": ["x", "y"]}), StructuredOutputsParams(choice=["x", "y"])),
    (dict(structured_outputs={"grammar": "root ::= 'a'"}), StructuredOutputsParams(grammar="root ::= 'a'")),
    (dict(structured_outputs={"json_object": True}), StructuredOutputsParams(json_object=True)),
    (dict(guided_json=SCHEMA), StructuredOutputsParams(json=SCHEMA)),
    (dict(guided_json='{"type": "string"}', guided_decoding_backend="outlines"), StructuredOutputsParams(json={"type": "string"})),
    (dict(guided_regex="[0-9]+"), StructuredOutputsParams(regex="[0-9]+")),
    (dict(guided_choice=["a"]), StructuredOutputsParams(choice=["a"])),
    (dict(guided_grammar="root ::= 'a'"), StructuredOutputsParams(grammar="root ::= 'a'")),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}), StructuredOutputsParams(json=SCHEMA)),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
     StructuredOutputsParams(json={"type": "object"})),
    (dict(tools=TOOLS, tool_choice="none", guided_regex="a"), StructuredOutputsParams(regex="a")),
    (dict(), None),
])
def test_fields_become_structured_outputs(fields, expected):
    assert chat_params(**fields) == expected


def test_completions_take_the_same_fields():
    params = CompletionRequest(prompt="x", response_format={"type": "json_object"}).to_sampling_params()
    assert params.structured_outputs == StructuredOutputsParams(json_object=True)
    params = CompletionRequest(prompt="x", structured_outputs={"choice": ["a", "b"]}).to_sampling_params()
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])


@pytest.mark.parametrize("fields, param, message", [
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex",
     "response_format and guided_regex each ask for structured output; set only one"),
    (dict(structured_outputs={"regex": "a"}, guided_choice=["a"]), "guided_choice", "structured_outputs and guided_choice"),
    (dict(guided_json=SCHEMA, guided_regex="a"), "guided_regex", "guided_json and guided_regex"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "json_schema is required"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one of"),
    (dict(structured_outputs={}), "structured_outputs", "exactly one of"),
    (dict(structured_outputs={"json": "{bad"}), "structured_outputs.json", "structured_outputs.json is not valid JSON"),
    (dict(structured_outputs={"json": "[1]"}), "structured_outputs.json", "must be a JSON schema object"),
    (dict(guided_json="{bad"), "guided_json", "guided_json is not valid JSON"),
    (dict(guided_regex=""), "guided_regex", "regex must be a non-empty string"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "tool_choice 'required' and response_format both constrain the output"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}), "tool_choice",
     "tool_choice names the function 'h', which is not among the tools; valid: f, g"),
    (dict(tool_choice="auto"), "tool_choice", "tool_choice needs tools"),
])
def test_bad_fields_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(InvalidField, match=message) as info:
        chat_params(**fields)
    assert info.value.param == param
    error = from_exception(info.value)
    assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize("fields", [
    dict(response_format={"type": "xml"}),
    dict(structured_outputs={"unknown": 1}),
    dict(guided_choice=[]),
    dict(tools=[{"type": "function", "function": {"name": "bad name"}}]),
    dict(tool_choice="sometimes"),
])
def test_malformed_fields_fail_validation(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=MESSAGES, **fields)


def test_error_param_of_an_engine_failure_is_the_constraints_field():
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(structured_outputs={"regex": "a"}), "structured_outputs.regex"),
        (dict(guided_choice=["a"]), "guided_choice"),
        (dict(tools=TOOLS, tool_choice="required"), "tools"),
        (dict(), None),
    ]
    for fields, param in cases:
        assert ChatCompletionRequest(messages=MESSAGES, **fields).structured_output_param() == param


def test_tool_messages_reach_the_template_with_arguments_as_objects():
    request = ChatCompletionRequest(messages=[
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ])
    dicts = [m.to_template_dict() for m in request.messages]
    assert dicts[1] == {"role": "assistant", "content": "",
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert dicts[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


def test_tools_are_given_to_the_chat_template():
    from types import SimpleNamespace

    from runtime.entrypoints.openai.serving_chat import OpenAIServingChat
    from runtime.entrypoints.openai.serving_engine import ServingContext

    seen = {}

    def apply_chat_template(messages, add_generation_prompt, **kwargs):
        seen.update(messages=messages, **kwargs)
        return "rendered"

    processor = SimpleNamespace(check_text=lambda text, field: None, apply_chat_template=apply_chat_template,
                                encode=lambda text, add_special_tokens, field: [1, 2])
    chat = OpenAIServingChat(ServingContext(engine=SimpleNamespace(input_processor=processor), served_model_names=["m"]))
    request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert chat.render_prompt(request) == {"prompt_token_ids": [1, 2], "prompt": "rendered"}
    assert seen["tools"] == [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
                             {"type": "function", "function": {"name": "g"}}]
    seen.clear()
    chat.render_prompt(ChatCompletionRequest(messages=MESSAGES))
    assert "tools" not in seen
