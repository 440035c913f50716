"""The records that cross layers, below every part that uses them.

* Front end (LLMEngine / AsyncLLM) <-> EngineCore: msgspec structs, so they cross the
  ZMQ socket of a separate engine process unchanged; in-process they pass as they are.
* Scheduler -> executor -> worker and back, once per step: :class:`SchedulerOutput`
  and :class:`ModelRunnerOutput`.

Scheduler, worker, sampler, metrics and the engine all import these from here; this
module imports nothing of the runtime but :mod:`runtime.sampling_params`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

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
    # Finished because its grammar completed: the last token is text, not an EOS / stop token.
    ended_by_grammar: bool = False
    # Set on the last output by a KV connector (prefill/decode): what the client passes on, e.g.
    # the blocks a remote decode instance pulls.
    kv_transfer_params: dict | None = None
    # On the output with the request's first token (0 elsewhere), for /metrics: when the engine core
    # queued the request and when it first scheduled it (a preemption does not move it), time.time().
    queued_time: float = 0.0
    scheduled_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class NewTokens(msgspec.Struct, array_like=True):
    """The step's outputs that are one new token and nothing else, column by column: request
    ``request_ids[i]`` got ``token_ids[i]``, not its first token nor one that ends it, and no logprobs.

    The bulk of a decode step, sent without an :class:`EngineCoreOutput` per request.
    """

    request_ids: list[str]
    token_ids: list[int]


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0  # time.time() when the engine core sent them (0: in-process, the receiver's clock)
    # Stats for /metrics: running, waiting, kv usage, prefix hits/queries; after a step, its num_step_tokens.
    scheduler_stats: dict | None = None
    error: str | None = None
    # Requests the core ended after they were added: request id -> why. Front ends raise ValueError
    # (their input turned out bad: a grammar that does not compile) ...
    failed: dict[str, str] | None = None
    # The step's plain one-token outputs (a request is in ``outputs`` or here, never both).
    new_tokens: NewTokens | None = None
    # ... or, for those of ``failed`` listed here, RequestFailedError: the server failed them (a KV
    # transfer that failed), not their input.
    server_failed: list[str] | None = None


# ---------------------------------------------------------------- one engine step


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen (or are seeing again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """The requests the workers already hold, column by column: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # of each, before this step
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # only the requests given blocks


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # finished or preempted since last step
    # Structured output: request id -> row of ``grammar_bitmask``, a CPU int32 tensor
    # [rows, ceil(vocab_size / 32)] of allowed next tokens (runtime.structured_output), for
    # the constrained requests that sample this step; empty / None when there are none. The
    # scheduler sets a runtime.structured_output.DeferredBitmask, which the model runner fills
    # after queueing the forward pass (resolve_bitmask); pickled, it arrives filled.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: object = None
    # Speculative decoding: request id -> the draft tokens scheduled this step (only requests
    # with drafts). Such a request's num_scheduled_tokens is 1 + len(drafts): its last known
    # token, then the drafts, whose ids the worker feeds as inputs after its known tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV connector (offload tiers): the connector's runtime.kv_transfer.KVConnectorMetadata for
    # this step (blocks to store before they are reused, blocks to load before the forward), or None.
    kv_connector_metadata: object = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]  # requests that sampled a token this step, in batch order
    sampled_token_ids: list[list[int]]  # per request (one token, or more with spec decode)
    # One row per sampled token, request after request in req_ids order (with speculative
    # decoding a request emits len(sampled_token_ids[i]) consecutive rows).
    logprobs: LogprobsLists | None = None
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # this step's chunk
    # A KV connector's per-rank reports on this step (its worker half's get_connector_output),
    # in rank order, for its scheduler half; None without a connector that reports.
    kv_connector_outputs: list | None = None
