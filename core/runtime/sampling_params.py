"""Sampling parameters of one request, with vLLM's names and defaults."""

from __future__ import annotations

import copy
import json as _json
import math
import numbers
from dataclasses import dataclass, field
from enum import IntEnum

_SAMPLING_EPS = 1e-5
_FLOAT32_MAX = 3.4028234663852886e38  # the sampler's logits and parameters are float32: beyond this is inf there


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _token_ids(value, name: str, allow_empty: bool) -> list[int]:
    if not isinstance(value, (list, tuple)) or (not value and not allow_empty) or any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in value):
        raise ValueError(f"{name} must be a {'' if allow_empty else 'non-empty '}list of token ids, got {value!r}")
    return list(value)


@dataclass(slots=True)
class ReasoningTags:
    """The token ids that open and close a reasoning block (``<think>`` ... ``</think>``), for
    :attr:`StructuredOutputsParams.reasoning`: the grammar constrains only the output after the block.

    ``starts_in_reasoning``: the output is reasoning from its first token (the prompt opened the block)
    until ``end_token_ids``. Otherwise the output may open the block itself: its first token may be
    ``start_token_ids`` (when that is one token) or any first token of the grammar, which then holds at once.
    A tag spelled over several tokens is matched as that exact id sequence.
    """

    end_token_ids: list[int]
    start_token_ids: list[int] = field(default_factory=list)
    starts_in_reasoning: bool = True

    def __post_init__(self) -> None:
        self.end_token_ids = _token_ids(self.end_token_ids, "reasoning.end_token_ids", False)
        self.start_token_ids = _token_ids(self.start_token_ids, "reasoning.start_token_ids", True)
        if not isinstance(self.starts_in_reasoning, bool):
            raise ValueError(f"reasoning.starts_in_reasoning must be a boolean, got {self.starts_in_reasoning!r}")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output (vLLM's ``StructuredOutputsParams``); set exactly one field.

    ``json``: a JSON schema (dict or its JSON text); ``regex``: a regular expression the whole
    output matches; ``choice``: the output is one of these strings; ``grammar``: an EBNF/Lark
    grammar (where the guided backend supports it); ``json_object``: any JSON object.

    ``reasoning`` (not a kind; the server sets it with ``--reasoning-parser``): the output starts with
    a reasoning block that these tags delimit, left unconstrained; the grammar starts after it.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    reasoning: ReasoningTags | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reasoning, dict):
            self.reasoning = ReasoningTags(**self.reasoning)
        elif self.reasoning is not None and not isinstance(self.reasoning, ReasoningTags):
            raise ValueError(f"structured_outputs.reasoning must be ReasoningTags or a dict, got {self.reasoning!r}")
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which field is set: one of :data:`STRUCTURED_OUTPUT_KINDS`."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> str:
        """The set field as the string a guided backend compiles (schemas and choices as canonical JSON,
        so equal specs share one compiled grammar)."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return _json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return _json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completion of one prompt.

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 disables top-k.
    ``logprobs=N`` returns the sampled token's logprob and the top N;
    ``prompt_logprobs=N`` the same for each prompt token after the first.
    ``cache_salt`` isolates a tenant's prefix cache: a request reuses only blocks cached
    by requests with the same salt (or, without one, by requests without one).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (every other logit is -inf); None: all.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output must not contain. A word is banned as its tokens with and without a leading space:
    # once the output ends with all of a variant's tokens but the last, that last one gets -inf.
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Prefix-cache isolation: only requests with the same salt share cached blocks.
    cache_salt: str | None = None
    # Constrained output (JSON schema, regex, choice, grammar); needs a guided decoding backend.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's free-form per-request arguments for plugins, e.g. {"kv_transfer_params": {...}} for a KV connector.
    extra_args: dict | None = None
    # Filled by the engine, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # bad_words' token sequences

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
            # -inf bans a token; NaN or +inf would make the row's logits NaN, and NaN logits sample any token.
            bad_bias = next((k for k, v in self.logit_bias.items() if math.isnan(v) or v > _FLOAT32_MAX), None)
            if bad_bias is not None:
                raise ValueError(
                    "logit_bias must be finite (at most 3.4e38, the largest float32) or -inf (to ban a token), "
                    f"got {self.logit_bias[bad_bias]} for token {bad_bias}"
                )
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            valid = (*STRUCTURED_OUTPUT_KINDS, "reasoning")
            unknown = sorted(set(self.structured_outputs) - set(valid))
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, got {self.structured_outputs!r}")

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise bad(name, "a number")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0")
        # An infinite temperature or penalty turns -inf and 0 logits into NaN, and NaN logits sample any token.
        for name in ("repetition_penalty", "temperature"):
            if getattr(self, name) > _FLOAT32_MAX:
                raise bad(name, "finite (at most 3.4e38, the largest float32)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "None or an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "None or a non-empty string")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "None or a non-empty list of token ids")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or not (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)):
            raise bad("truncate_prompt_tokens", "None, -1 (the last max_model_len tokens) or an integer >= 1")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, (list, tuple)) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "None or a list of non-blank strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def __getattr__(name: str):
    """``BeamSearchParams`` where vLLM's users import it from (defined with the beam search, which imports this)."""
    if name == "BeamSearchParams":
        from runtime.entrypoints.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
