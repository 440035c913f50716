"""What a request returns to the user, with vLLM's names and fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token at one position.

    ``rank`` is the token's 1-based rank in the vocabulary at that position;
    ``decoded_token`` is its text, when a tokenizer is loaded.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first prompt token has none.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (a request with ``n > 1`` has n of them).

    ``finish_reason`` is ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once
    finished, else None. ``stop_reason`` is the stop token id or the stop string
    that ended it; None when it ended by EOS or by length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The output of one request, as the engine returns it after a step.

    ``outputs`` holds the completions ordered by index. With
    ``RequestOutputKind.DELTA`` their ``text``, ``token_ids`` and ``logprobs``
    hold only what is new since the previous output of this request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Any = None
    kv_transfer_params: dict | None = None  # from a KV connector, on the last output (prefill/decode)
