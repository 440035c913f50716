"""Response bodies of the OpenAI API, as pydantic models (field names as OpenAI's)."""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, Field, model_serializer


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (or a KV connector)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # generated tokens of the reasoning (see reasoning_tokens.py)


class UsageInfo(BaseModel):
    """OpenAI's usage; the two details objects only where the server has them (``--enable-prompt-tokens-details``,
    ``--reasoning-parser``), else left out of the JSON."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_details(self, handler):
        body = handler(self)
        for name in ("prompt_tokens_details", "completion_tokens_details"):
            if body.get(name) is None:
                body.pop(name, None)
        return body

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
           reasoning_tokens: int | None = None) -> "UsageInfo":
        """Usage of these counts; ``cached_tokens`` / ``reasoning_tokens`` None leave their details out."""
        return cls(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=(
                None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            ),
        )


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------- completions
class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------- chat
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None  # OpenAI's (always null here)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class _WithReasoningAlias(BaseModel):
    """Dumped with ``reasoning`` beside ``reasoning_content``, the same text: vLLM's newer name and its older one,
    so that clients of either read it."""

    @model_serializer(mode="wrap")
    def _add_reasoning(self, handler):
        body = handler(self)
        if "reasoning_content" in body:
            body["reasoning"] = body["reasoning_content"]
        return body


class ChatMessageOut(_WithReasoningAlias):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None  # OpenAI's (always null here: no model here refuses through a channel of its own)
    reasoning_content: str | None = None  # vLLM's, with --reasoning-parser (left out of responses without it)
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _WithoutNones(BaseModel):
    """Dumped without its unset (None) fields, as OpenAI's tool-call deltas are."""

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNones):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNones):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_WithReasoningAlias):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's, with --reasoning-parser (left out of chunks without it)
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- misc
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "runtime"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_json = msgspec.json.Encoder()  # UTF-8 as it is (ensure_ascii=False), about 10x json.dumps of a model_dump


def sse_event(payload: BaseModel | dict[str, Any], include_usage: bool = True) -> bytes:
    """One server-sent event; ``usage`` is dropped unless the client asked for it."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(exclude={"usage"} if not include_usage else None)
    return b"data: " + _json.encode(payload) + b"\n\n"


class StreamChunks:
    """The SSE events of one stream, as plain dicts: the per-token path builds no pydantic model.

    The fields are those of ``CompletionResponse`` / ``ChatCompletionChunk`` dumped, in their order;
    ``id``, ``created`` and ``model`` are the same in every chunk of a stream, as in OpenAI's.
    """

    __slots__ = ("_head",)

    def __init__(self, request_id: str, model: str, object_name: str):
        self._head = {"id": request_id, "object": object_name, "created": _now(), "model": model}

    def event(self, choices: list[dict[str, Any]], usage: UsageInfo | None = None, **fields: Any) -> bytes:
        """The event of one chunk; ``fields`` are top-level fields of this chunk only (vLLM's prompt_token_ids)."""
        chunk = {**self._head, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage.model_dump()
        chunk.update(fields)
        return b"data: " + _json.encode(chunk) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
