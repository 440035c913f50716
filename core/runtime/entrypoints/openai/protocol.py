"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Unknown fields are ignored, as OpenAI and vLLM do. Range checks live in
SamplingParams, whose ValueErrors name the field; ``to_sampling_params``
turns a request into one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.sampling_params import RequestOutputKind, SamplingParams

MAX_LOGPROBS = 20  # OpenAI allows top_logprobs up to 20


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

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
        )

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
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value}")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

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
        return list(prompt)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a chat template expects it: content as one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
                texts.append(part.get("text", ""))
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        _check_logprobs("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format type {self.response_format.type!r} is not supported; only 'text'")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
