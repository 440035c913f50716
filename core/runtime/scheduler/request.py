"""The scheduler's view of one request."""

from __future__ import annotations

import enum
import time

from runtime.messages import EngineCoreRequest, FinishReason, LogprobsLists
from runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Token state of one sequence: prompt, outputs so far and how much is computed."""

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority",
        "eos_token_ids", "output_token_ids", "all_token_ids", "num_computed_tokens", "status",
        "num_cached_tokens", "stop_reason", "num_preemptions", "block_hashes", "prompt_logprobs",
        "max_tokens", "num_tokens", "stop_ids", "num_output_placeholders", "schedules_ahead", "grammar",
        "spec_token_ids", "queued_time", "scheduled_time",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.queued_time = time.time()  # built when the engine core adds it (for /metrics)
        self.scheduled_time = 0.0  # first admitted to run (0 until then)
        self.priority = priority
        self.eos_token_ids = eos_token_ids  # any of them ends the request (unless ignore_eos)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_cached_tokens = -1  # prefix-cache hits at the first schedule, -1 until then
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # sha256 digests of full blocks, chained from the first
        self.prompt_logprobs: list[LogprobsLists] = []  # chunks, joined when the prompt is done
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.num_tokens = len(self.all_token_ids)  # prompt + outputs; kept by append_output_token
        # Tokens scheduled to be sampled whose ids have not come back yet (at most one per
        # step in flight): the scheduler counts them as known when it schedules ahead.
        self.num_output_placeholders = 0
        # Whether the next step may be scheduled before this one's tokens are back: not when
        # sampling reads the request's own output ids on the host (penalties, min_tokens,
        # the per-position seed, bad words) or the prompt logprobs still accumulate. A grammar may: the
        # engine collects the step in flight before the next step's bitmask is filled.
        p = sampling_params
        self.schedules_ahead = (
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            and not p.min_tokens and p.seed is None and p.prompt_logprobs is None and not p.bad_words_token_ids
        )
        # Structured output: a runtime.scheduler.structured_output.RequestGrammar, set when added.
        self.grammar = None
        # Speculative decoding: draft tokens proposed after the last step, verified by the
        # next one (never part of all_token_ids / num_tokens; dropped when preempted).
        self.spec_token_ids: list[int] = []
        # Token ids that end the request (once min_tokens is reached): stop_token_ids, and EOS unless ignore_eos.
        self.stop_ids = frozenset(sampling_params.stop_token_ids or ()).union(
            () if sampling_params.ignore_eos else eos_token_ids
        )

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, max_tokens: int, eos_token_ids: frozenset[int]
    ) -> "Request":
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_ids=eos_token_ids,
            arrival_time=request.arrival_time,
            priority=request.priority,
            max_tokens=max_tokens,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def mark_scheduled(self, num_cached: int) -> None:
        """Admitted to run. The first time, its prefix-cache hits and the time are kept (a resume keeps both)."""
        if self.num_cached_tokens < 0:
            self.num_cached_tokens = num_cached
            self.scheduled_time = time.time()

    def is_finished(self) -> bool:
        return self.status.is_finished

    def sort_key(self, policy: str) -> tuple:
        """Smaller runs first: arrival order, or (priority, arrival) under 'priority'.

        The request id breaks ties (the n children of a request arrive together): the order must
        be total, or two tied requests can take turns preempting themselves and neither finishes.
        """
        if policy == "priority":
            return (self.priority, self.arrival_time, self.request_id)
        return (self.arrival_time, self.request_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
