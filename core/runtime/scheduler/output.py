"""What the scheduler hands the executor each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.engine.messages import LogprobsLists
from runtime.sampling_params import SamplingParams


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
    """A request the workers already hold: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # finished or preempted since last step

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]  # requests that sampled a token this step, in batch order
    sampled_token_ids: list[list[int]]  # per request (one token, or more with spec decode)
    logprobs: LogprobsLists | None = None  # one row per entry of req_ids
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # this step's chunk
