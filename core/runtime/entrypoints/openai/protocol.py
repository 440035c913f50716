"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Unknown fields are ignored, as OpenAI and vLLM do. Range checks live in
SamplingParams, whose ValueErrors name the field; ``to_sampling_params``
turns a request into one. The models themselves only bound what must hold
before anything runs (and what /openapi.json tells clients and fuzzers):
integers fit in 64 bits, floats are finite, per-request lists are bounded.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from runtime.entrypoints.openai.protocol_base import (
    Int64,
    InvalidField,
    LogitBias,
    OpenAIBaseModel,
    StopStrings,
    StopTokenIds,
    Texts,
    TokenIdLists,
    TokenIds,
)
from runtime.entrypoints.openai.protocol_structured import (
    STRUCTURED_OUTPUT_FIELDS, ResponseFormat, StructuredOutputsRequest, schema_dict, structured_params,
)
from runtime.entrypoints.openai.protocol_tools import (
    MAX_TOOLS, ChatTool, NamedToolChoice, ToolCallIn, named_tool_schema, required_tools_schema,
)
from runtime.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    logit_bias: LogitBias | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation per tenant
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=4096)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's per-request backend choice: the server's backend is used
    guided_whitespace_pattern: str | None = None  # vLLM's; no effect here
    # vLLM's prefill/decode disaggregation: {"do_remote_decode": true} on a prefill instance; the
    # prefill response's kv_transfer_params on a decode instance (a KV connector reads them).
    kv_transfer_params: dict[str, Any] | None = None

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def _prompt_logprobs(self) -> int | None:
        return None

    def to_sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams of this request; ValueError naming the field if a value is out of range."""
        max_tokens = self._max_tokens()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self._num_logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=parse_logit_bias(self.logit_bias),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            cache_salt=self.cache_salt,
            structured_outputs=self.structured_output_params(),
            extra_args=self._extra_args(),
        )

    def _extra_args(self) -> dict | None:
        if self.kv_transfer_params is None:
            return None
        if self.n != 1:
            raise InvalidField("kv_transfer_params", f"kv_transfer_params needs n = 1, got n = {self.n}")
        return {"kv_transfer_params": dict(self.kv_transfer_params)}

    def structured_output_sources(self) -> list[str]:
        """The request fields that ask for structured output (``response_format`` of type text does not)."""
        sources = []
        for name in STRUCTURED_OUTPUT_FIELDS:
            value = getattr(self, name)
            if value is None or (name == "response_format" and value.type == "text"):
                continue
            sources.append(name)
        return sources

    def structured_output_field(self) -> str | None:
        """The one request field that asks for structured output, if any (errors about the
        constraint name it); InvalidField if several do."""
        sources = self.structured_output_sources()
        if len(sources) > 1:
            raise InvalidField(
                sources[1], f"{' and '.join(sources)} each ask for structured output; set only one of them",
            )
        return sources[0] if sources else None

    def structured_output_param(self) -> str | None:
        """The request field (a dotted path) holding the constraint, named by errors about it
        (a schema the guided backend cannot compile, no backend installed)."""
        source = self.structured_output_field()
        if source == "response_format" and self.response_format.type == "json_schema":
            if self.response_format.json_schema is not None and self.response_format.json_schema.schema_ is not None:
                return "response_format.json_schema.schema"
        if source == "structured_outputs":
            so = self.structured_outputs
            given = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object)) if v not in (None, False)]
            return f"structured_outputs.{given[0]}" if len(given) == 1 else source
        return source

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The constraint the request asks for, or None; InvalidField naming the field if it is
        malformed or several fields ask for one."""
        source = self.structured_output_field()
        if source is None:
            return None
        if source == "response_format":
            fmt = self.response_format
            if fmt.type == "json_object":
                return structured_params(source, json_object=True)
            if fmt.json_schema is None:
                raise InvalidField("response_format.json_schema",
                                   "response_format.json_schema is required when response_format.type is 'json_schema'")
            if fmt.json_schema.schema_ is None:  # OpenAI's schema is optional: any JSON object then
                return structured_params(source, json_object=True)
            return structured_params("response_format.json_schema.schema", json=fmt.json_schema.schema_)
        if source == "structured_outputs":
            so = self.structured_outputs
            fields = dict(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object)
            if isinstance(fields["json"], str):
                fields["json"] = schema_dict(fields["json"], "structured_outputs.json")
            given = [k for k, v in fields.items() if v not in (None, False)]
            param = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
            return structured_params(param, **fields)
        if source == "guided_json":
            return structured_params(source, json=schema_dict(self.guided_json, source))
        kind = source.removeprefix("guided_")
        return structured_params(source, **{kind: getattr(self, source)})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    if not logit_bias:
        return None
    parsed: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key!r}") from None
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token_id}")
        parsed[token_id] = value
    return parsed


def _check_logprobs(name: str, value: int | None) -> None:
    # The upper bound is the server's --max-logprobs (default 20, OpenAI's limit),
    # checked with the engine's limits; here only the sign.
    if value is not None and value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value}")


class CompletionRequest(SamplingFields):
    prompt: str | Texts | TokenIds | TokenIdLists
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None
    prompt_logprobs: Int64 | None = None
    return_token_ids: bool = False  # vLLM's: choices carry token_ids (and prompt_token_ids when not streamed)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        _check_logprobs("logprobs", self.logprobs)
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        _check_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None

    def check_supported(self) -> None:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) or be unset, got {self.best_of}")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings, or token id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if self.kv_transfer_params is not None and len(prompt) > 1:
            raise InvalidField("kv_transfer_params", f"kv_transfer_params needs one prompt, got {len(prompt)}")
        return list(prompt)


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
                    raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
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
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the text


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; "required" may give several calls, a named choice one

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        _check_logprobs("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

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
            return structured_params("tools", json=required_tools_schema(self.tools))
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
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None  # rendered by the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds
