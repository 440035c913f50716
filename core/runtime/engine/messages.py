"""Messages between the front end (LLMEngine / AsyncLLM) and the EngineCore.

They are msgspec structs so they cross the ZMQ socket of a separate engine
process unchanged; in-process they are passed as they are.
"""

from __future__ import annotations

import enum
import time

import msgspec

from runtime.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the user or a disconnect
    ERROR = "error"  # the engine failed


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = msgspec.field(default_factory=time.time)
    priority: int = 0  # lower runs first under the "priority" policy
    eos_token_id: int | None = None


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs for a run of positions, one row per position.

    Row ``i`` holds ``num_logprobs + 1`` entries: the chosen (sampled or prompt)
    token first, then the top ``num_logprobs`` tokens in descending order.
    ``ranks[i]`` is the chosen token's 1-based rank in the vocabulary.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    # Prompt logprobs arrive once, when the prompt is done; row i is for prompt
    # token i + 1 (the first prompt token has none).
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    # Stats for /metrics: running, waiting, kv usage, prefix hits/queries.
    scheduler_stats: dict | None = None
    error: str | None = None
