"""The sampling fields shared by completion and chat completion requests, and their turn into
:class:`SamplingParams` (range checks live there; its ValueErrors name the field)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from runtime.entrypoints.openai.protocol_base import (
    AllowedTokenIds,
    BadWords,
    Int64,
    InvalidField,
    JsonObject,
    LogitBias,
    OpenAIBaseModel,
    StopStrings,
    StopTokenIds,
)
from runtime.entrypoints.openai.protocol_structured import (
    STRUCTURED_OUTPUT_FIELDS, ResponseFormat, StructuredOutputsRequest, schema_dict, structured_params,
)
from runtime.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


MAX_REQUEST_ID_LEN = 256  # as an X-Request-Id header is taken (serving_engine)


def check_request_id(value: str) -> str:
    if not 1 <= len(value) <= MAX_REQUEST_ID_LEN:
        why = f"got {len(value)} characters"
    elif not (value.isascii() and value.isprintable()):
        why = "got one with a character that is not printable ASCII"
    else:
        return value
    raise ValueError(f"must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters (as an X-Request-Id header), {why}")


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
    allowed_token_ids: AllowedTokenIds | None = None  # vLLM's: sample only these ids
    bad_words: BadWords | None = None  # vLLM's: words the output must not contain
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    use_beam_search: bool = False  # vLLM's; not supported here: true is a 400 rather than sampling quietly instead
    # vLLM's: logprobs name tokens as "token_id:N"; None: the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation per tenant
    # vLLM's: the id the response (cmpl-<id>, chatcmpl-<id>) and the request's log line are named by, where no
    # X-Request-Id header gives one
    request_id: Annotated[str, AfterValidator(check_request_id)] | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonObject | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=4096)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's per-request backend choice: the server's backend is used
    guided_whitespace_pattern: str | None = None  # vLLM's; no effect here
    # vLLM's prefill/decode disaggregation: {"do_remote_decode": true} on a prefill instance; the
    # prefill response's kv_transfer_params on a decode instance (a KV connector reads them).
    kv_transfer_params: JsonObject | None = None

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def _prompt_logprobs(self) -> int | None:
        return None

    def to_sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams of this request; ValueError naming the field if a value is out of range."""
        if self.use_beam_search:
            raise InvalidField("use_beam_search", "use_beam_search: beam search is not supported by this server; "
                                                  "use sampling (temperature, top_p, n) or greedy decoding")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "stream_options is only allowed with stream: true (as OpenAI's API "
                                                 "has it); drop it or set stream")
        max_tokens = self._max_tokens()
        try:
            return self._sampling_params(max_tokens if max_tokens is not None else default_max_tokens)
        except ValueError as exc:
            raise self._renamed(exc) from None

    def asks_max_tokens(self) -> bool:
        """Whether the request itself sets the most tokens to generate (else the model's default, or the context)."""
        return self._max_tokens() is not None

    def max_tokens_param(self) -> str:
        """The request field that gave SamplingParams.max_tokens, as errors name it."""
        return "max_tokens"

    def _renamed(self, exc: ValueError) -> ValueError:
        """``exc`` from SamplingParams, speaking of the request's own field where max_tokens came from another."""
        field = self.max_tokens_param()
        message = str(exc)
        if field == "max_tokens" or "max_tokens" not in message or getattr(exc, "param", None):
            return exc
        param = field if message.startswith("max_tokens") else None
        message = message.replace("max_tokens", field)
        return InvalidField(param, message) if param else ValueError(message)

    def _sampling_params(self, max_tokens: int | None) -> SamplingParams:
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
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self._num_logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=parse_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
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

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk: vLLM's ``continuous_usage_stats``, which counts only with ``include_usage``."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


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


def check_prompt_logprobs(value: int | None, stream: bool) -> None:
    """vLLM's: a streamed response has no place for prompt logprobs, so asking for them there is a 400 (it was
    answered without them)."""
    check_logprobs("prompt_logprobs", value)
    if stream and value:
        raise InvalidField("prompt_logprobs", f"prompt_logprobs ({value}) is not available with stream: true; "
                                              "drop it or send the request unstreamed")


def check_logprobs(name: str, value: int | None) -> None:
    # The upper bound is the server's --max-logprobs (default 20, OpenAI's limit),
    # checked with the engine's limits; here only the sign.
    if value is not None and value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value}")
