"""The token-budget scheduler (vLLM V1 design).

Every request has ``num_computed_tokens``; each step gives each scheduled request
some tokens to compute so that ``num_computed_tokens`` catches up with its known
tokens. Prefill chunks and decodes share one budget, ``max_num_batched_tokens``.
When the KV cache runs out, the lowest-priority running request is preempted by
recompute: its blocks are freed and it waits again.
"""

from __future__ import annotations

import itertools

from runtime.config import CacheConfig, SchedulerConfig
from runtime.engine.messages import EngineCoreOutput, EngineCoreOutputs, LogprobsLists
from runtime.scheduler.kv_cache_manager import KVCacheManager
from runtime.scheduler.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from runtime.scheduler.request import Request, RequestStatus

# Enum members looked up once: a class attribute lookup costs ~150 ns on Python 3.11,
# and the per-request loops below do several per request and step.
_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED_STOPPED  # this and every status above it


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status if the last sampled token ends the request."""
    token = request.output_token_ids[-1]
    num_output = len(request.output_token_ids)
    if token in request.stop_ids and num_output >= request.sampling_params.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        if request.sampling_params.ignore_eos or token not in request.eos_token_ids:
            request.stop_reason = token  # a stop_token_ids entry; EOS leaves no stop reason
        return True
    if num_output >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def _join_logprobs(chunks: list[LogprobsLists]) -> LogprobsLists:
    return LogprobsLists(
        token_ids=list(itertools.chain.from_iterable(c.token_ids for c in chunks)),
        logprobs=list(itertools.chain.from_iterable(c.logprobs for c in chunks)),
        ranks=list(itertools.chain.from_iterable(c.ranks for c in chunks)),
    )


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int):
        self.config = scheduler_config
        self.policy = scheduler_config.policy
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the workers next step
        self.num_preemptions = 0
        self.num_not_ahead = 0  # requests that cannot be scheduled ahead of their tokens

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_not_ahead += not request.schedules_ahead

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """End requests from outside (abort). Unknown or finished ids are ignored."""
        ended = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.num_not_ahead -= not request.schedules_ahead

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled while the current one's tokens are in flight."""
        return self.num_not_ahead == 0

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- schedule
    def _preempt_one(self, first_candidate: int) -> Request:
        """Preempt the lowest-priority running request not yet scheduled this step."""
        victim = max(self.running[first_candidate:], key=lambda r: r.sort_key(self.policy))
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # a token in flight is dropped and sampled again
        victim.num_preemptions += 1
        victim.prompt_logprobs.clear()
        self.num_preemptions += 1
        self.waiting.append(victim)
        self.finished_req_ids.add(victim.request_id)
        return victim

    def _next_waiting(self) -> Request:
        if self.policy == "priority" or any(r.status == RequestStatus.PREEMPTED for r in self.waiting):
            return min(self.waiting, key=lambda r: r.sort_key(self.policy))
        return self.waiting[0]

    def schedule(self) -> SchedulerOutput:
        num_scheduled: dict[str, int] = {}
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[NewRequestData] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, num_scheduled, cached_reqs)
        if budget is not None:  # None: a request was preempted, so none is admitted this step
            self._schedule_waiting(budget, num_scheduled, new_reqs)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        return output

    def _schedule_running(
        self, budget: int, num_scheduled: dict[str, int], cached_reqs: list[CachedRequestData]
    ) -> int | None:
        """Running requests, oldest first, preempting from the back when blocks run out.

        Returns the budget left, or None when a request was preempted.
        """
        kv = self.kv_cache_manager
        block_size, no_op_offsets = kv.block_size, kv.no_op_decode_offsets
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            num_new = request.num_tokens + placeholders - num_computed
            if num_new == 1 and num_computed % block_size in no_op_offsets and not (placeholders and self._ends_by_length(request)):
                # Fast path: one token (usually a decode) that lands inside the last block.
                cached_reqs.append(CachedRequestData(request.request_id, [], num_computed))
                num_scheduled[request.request_id] = 1
                request.num_computed_tokens = num_computed + 1
                request.num_output_placeholders = placeholders + 1
                budget -= 1
                index += 1
                continue
            num_new = min(num_new, budget)
            if num_new <= 0 or (placeholders and self._ends_by_length(request)):
                index += 1  # nothing to compute, or its token in flight is its last
                continue
            while (block_ids := kv.allocate_slots(request, num_new)) is None:
                victim = self._preempt_one(index)
                preempted = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; self.running shrank at or after index
            cached_reqs.append(CachedRequestData(request.request_id, block_ids, num_computed))
            num_scheduled[request.request_id] = num_new
            self._advance(request, num_new)
            budget -= num_new
            index += 1
        return None if preempted else budget

    def _ends_by_length(self, request: Request) -> bool:
        """Its tokens in flight already reach max_tokens or max_model_len."""
        placeholders = request.num_output_placeholders
        return (
            request.num_output_tokens + placeholders >= request.max_tokens
            or request.num_tokens + placeholders >= self.max_model_len
        )

    @staticmethod
    def _advance(request: Request, num_new: int) -> None:
        """Count the step's tokens as computed; one that completes the known tokens samples."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]) -> None:
        """Waiting requests, while budget, sequence slots and blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                break
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    list(request.output_token_ids),
                    request.sampling_params,
                    block_ids,
                    num_cached,
                )
            )
            num_scheduled[request.request_id] = num_new
            self._advance(request, num_new)
            budget -= num_new

    # ---------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        row_of = {}  # logprobs row of each request that sampled
        if runner_output.logprobs is not None:
            row_of = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        prompt_chunks = runner_output.prompt_logprobs
        outputs: list[EngineCoreOutput] = []
        finished: set[str] = set()
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != _RUNNING:
                continue  # aborted or preempted while the step ran
            if prompt_chunks and req_id in prompt_chunks and not request.output_token_ids:
                request.prompt_logprobs.append(prompt_chunks[req_id])
            new_tokens: list[int] = []
            if req_id in sampled and request.num_output_placeholders:
                request.num_output_placeholders -= 1  # its token is back
            for token in sampled.get(req_id, ()):
                request.append_output_token(token)
                new_tokens.append(token)
                if check_stop(request, self.max_model_len):
                    break
            if not new_tokens and not (request.prompt_logprobs and request.num_computed_tokens >= request.num_prompt_tokens):
                continue  # a prompt chunk that produced nothing to report yet
            outputs.append(self._make_output(request, new_tokens, runner_output, row_of.get(req_id)))
            if request.status >= _FINISHED:
                finished.add(req_id)
                self._free(request)
        if finished:
            self.running[:] = [r for r in self.running if r.request_id not in finished]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.stats())

    def _make_output(self, request: Request, new_tokens: list[int], runner_output: ModelRunnerOutput, row) -> EngineCoreOutput:
        logprobs = prompt_logprobs = None
        if request.sampling_params.logprobs is not None and new_tokens and runner_output.logprobs is not None and row is not None:
            lp = runner_output.logprobs
            logprobs = LogprobsLists([lp.token_ids[row]], [lp.logprobs[row]], [lp.ranks[row]])
        if request.prompt_logprobs and request.num_computed_tokens >= request.num_prompt_tokens:
            prompt_logprobs = _join_logprobs(request.prompt_logprobs)
            request.prompt_logprobs = []
        status = request.status
        finish_reason = status.finish_reason if status >= _FINISHED else None
        num_cached_tokens = request.num_cached_tokens if request.num_cached_tokens > 0 else 0
        # Positional, in field order: msgspec parses keyword arguments noticeably slower.
        return EngineCoreOutput(
            request.request_id, new_tokens, logprobs, prompt_logprobs, finish_reason, request.stop_reason, num_cached_tokens
        )

    def stats(self) -> dict:
        prefix = self.kv_cache_manager.stats
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.kv_cache_manager.usage(),
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "num_preemptions": self.num_preemptions,
        }
