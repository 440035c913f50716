"""The chat completion request: its messages (with tool calls and results) and its tools and tool
choice, which may constrain the output as structured output does."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from runtime.entrypoints.openai.protocol_base import Int64, InvalidField, JsonObject, OpenAIBaseModel, check_free_json
from runtime.entrypoints.openai.protocol_sampling import SamplingFields, check_logprobs, check_prompt_logprobs
from runtime.entrypoints.openai.protocol_structured import structured_params
from runtime.entrypoints.openai.protocol_tools import (
    MAX_TOOLS, ChatTool, NamedToolChoice, ToolCallIn, named_tool_schema, required_tools_schema,
)
from runtime.sampling_params import StructuredOutputsParams


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=1024)] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call answered

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a chat template expects it: content as one string; tool call arguments
        as objects (templates serialize them themselves)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidField("messages", f"only text content parts are supported, got type {part.get('type')!r}")
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise ValueError(f"messages: the 'text' of a text content part must be a string, got {type(text).__name__}")
                texts.append(text)
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls
            ]
        return message


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return check_free_json(json.loads(arguments))
    except (ValueError, RecursionError):
        return arguments  # not JSON, or JSON nested too deep for the template: the template gets the text


# apply_chat_template's own arguments: not template variables, so chat_template_kwargs may not set them
# (add_generation_prompt and continue_final_message set the request's fields of those names)
TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
TEMPLATE_SWITCHES = ("add_generation_prompt", "continue_final_message")


def template_switches(request: OpenAIBaseModel, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``kwargs`` without its boolean add_generation_prompt/continue_final_message, which are set on ``request``."""
    if not kwargs or not any(isinstance(kwargs.get(name), bool) for name in TEMPLATE_SWITCHES):
        return kwargs
    kwargs = dict(kwargs)
    for name in TEMPLATE_SWITCHES:
        if isinstance(kwargs.get(name), bool):
            setattr(request, name, kwargs.pop(name))
    return kwargs


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """InvalidField naming chat_template_kwargs if it sets an argument of the template call rather than a variable."""
    reserved = sorted(set(kwargs or ()) & (TEMPLATE_CALL_ARGS | set(TEMPLATE_SWITCHES)))
    if reserved:
        raise InvalidField("chat_template_kwargs", (
            f"chat_template_kwargs may not set {reserved[0]!r}: it is an argument of the template call, not a "
            "template variable (add_generation_prompt and continue_final_message must be true or false there); "
            "use the request's own fields"
        ))


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JsonObject | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call in a message (a named choice makes one)
    echo: bool = False  # vLLM's: the reply starts with the last message's content when that message has the reply's role
    prompt_logprobs: Int64 | None = None  # vLLM's: the templated prompt's logprobs, in the response's prompt_logprobs
    # vLLM's: the response's prompt_token_ids (the templated prompt) and each choice's token_ids; streamed, the first
    # chunk has prompt_token_ids and each chunk of a choice its new token_ids
    return_token_ids: bool = False
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning (with --reasoning-parser) out of the reply

    @model_validator(mode="after")
    def _switches_from_template_kwargs(self) -> "ChatCompletionRequest":
        """vLLM's: ``chat_template_kwargs`` may set add_generation_prompt and continue_final_message, over the fields."""
        self.chat_template_kwargs = template_switches(self, self.chat_template_kwargs)
        return self

    def reply_role(self, response_role: str = "assistant") -> str:
        """vLLM's role of the reply: the server's ``--response-role``, or with ``add_generation_prompt`` off the last
        message's own (the reply continues it)."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self, response_role: str = "assistant") -> str:
        """What ``echo`` puts before the reply: the last message's text when its role is the reply's, else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != self.reply_role(response_role):
            return ""
        return last.to_template_dict().get("content") or ""

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _num_logprobs(self) -> int | None:
        check_logprobs("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def _prompt_logprobs(self) -> int | None:
        check_prompt_logprobs(self.prompt_logprobs, self.stream)
        return self.prompt_logprobs

    @property
    def tool_mode(self) -> str:
        """How tools are used: "none", "auto", "required" or "named" (OpenAI's default: "auto"
        with tools, "none" without)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    def named_tool(self) -> ChatTool | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next(t for t in self.tools or () if t.function.name == self.tool_choice.function.name)

    def check_tools(self) -> None:
        """The tools and tool choice make sense together; InvalidField naming the field if not."""
        names = [t.function.name for t in self.tools or ()]
        duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if duplicate is not None:
            raise InvalidField("tools", f"tools: the function name {duplicate!r} is given more than once")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise InvalidField("tool_choice", "tool_choice needs tools: the request has no tools to choose from")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in names:
                raise InvalidField(
                    "tool_choice",
                    f"tool_choice names the function {name!r}, which is not among the tools; valid: {', '.join(names)}",
                )
        if self.tool_mode in ("required", "named"):
            source = self.structured_output_sources()
            if source:
                raise InvalidField(
                    source[0], f"tool_choice {self._tool_choice_text()} and {source[0]} both constrain the output; set only one",
                )

    def _tool_choice_text(self) -> str:
        if isinstance(self.tool_choice, NamedToolChoice):
            return f"(function {self.tool_choice.function.name!r})"
        return repr(self.tool_choice)

    def structured_output_params(self) -> StructuredOutputsParams | None:
        mode = self.tool_mode
        if mode == "named":
            self.check_tools()
            return structured_params("tools", json=named_tool_schema(self.named_tool()))
        if mode == "required":
            self.check_tools()
            return structured_params("tools", json=required_tools_schema(self.tools, self.parallel_tool_calls is not False))
        return super().structured_output_params()

    def structured_output_field(self) -> str | None:
        if self.tool_mode in ("named", "required"):
            return "tools"
        return super().structured_output_field()

    def check_supported(self) -> None:
        self.check_tools()
        if self.chat_template_kwargs and "chat_template" in self.chat_template_kwargs:
            raise ValueError(
                "chat_template_kwargs may not set 'chat_template': a request cannot bring its own template "
                "(it would run on the server); the server renders with the model's template"
            )
        check_template_kwargs(self.chat_template_kwargs)
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
