"""The token-budget scheduler (vLLM V1 design).

Every request has ``num_computed_tokens``; each step gives each scheduled request
some tokens to compute so that ``num_computed_tokens`` catches up with its known
tokens. Prefill chunks and decodes share one budget, ``max_num_batched_tokens``.
When the KV cache runs out, the lowest-priority running request is preempted by
recompute: its blocks are freed and it waits again (with ``--preemption-mode swap`` a KV
connector saves them to the cpu offload tier first, and loads them back on resume).
A KV connector (offload tiers, prefill/decode transfer) joins through
:mod:`runtime.scheduler.kv_connector`; requests whose KV comes from a remote engine wait there.
"""

from __future__ import annotations

from runtime.config import CacheConfig, SchedulerConfig
from runtime.kv_transfer import RequestInputError
from runtime.messages import CachedRequestData, EngineCoreOutputs, ModelRunnerOutput, NewRequestData, SchedulerOutput
from runtime.scheduler.kv_cache_manager import KVCacheManager
from runtime.scheduler.kv_connector import SchedulerConnector
from runtime.scheduler.output import append_any_tokens, append_plain_tokens
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.stopping import SpecDecodeStats
from runtime.scheduler.structured_output import StructuredOutputManager

_PARKED = object()  # _admit: the request left the waiting queue to wait for its KV


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output: StructuredOutputManager | None = None,
        num_speculative_tokens: int = 0,
        kv_connector=None,
    ):
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
        self.structured_output = structured_output
        self.waiting_for_grammar: list[Request] = []  # constrained requests whose grammar compiles
        self.failed: dict[str, str] = {}  # request id -> why, ended since the last update_from_output
        self.server_failed: list[str] = []  # those of them the server failed (not their input)
        # Every stop token id of every request added: a sampled token outside it ends no request
        # (one small set to test a decode step's tokens against, not one set per request).
        self.any_stop_ids: set[int] = set()
        # Speculative decoding (drafts set on requests by the engine's proposer between steps).
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_stats = SpecDecodeStats(num_speculative_tokens) if num_speculative_tokens else None
        # KV connector's scheduler half (offload tiers), or None.
        self.kv_connector = None if kv_connector is None else SchedulerConnector(
            kv_connector, self.kv_cache_manager, scheduler_config.preemption_mode)

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output is None:
                raise ValueError(
                    "structured output needs a guided decoding backend and none is loaded; install "
                    "runtime-plugin-outlines (pip install -e plugins/outlines) or pick one with --guided-decoding-backend"
                )
            request.grammar = self.structured_output.submit(constraint.kind, constraint.spec(), constraint.reasoning)
        self.requests[request.request_id] = request
        self.any_stop_ids.update(request.stop_ids)
        (self.waiting if request.grammar is None else self.waiting_for_grammar).append(request)
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
            elif request in self.waiting_for_grammar:
                self.waiting_for_grammar.remove(request)
                self.structured_output.release(request.grammar)  # a compile nobody waits for is dropped
            elif self.kv_connector is not None and (
                    request.request_id in self.kv_connector.waiting_remote or request.request_id in self.kv_connector.loading):
                pass  # its remote load is dropped (or its blocks held until its background load ends) when it is freed
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    def _free(self, request: Request) -> dict | None:
        """Free a finished request; returns a KV connector's transfer parameters for the client."""
        params = None
        if self.kv_connector is None:
            self.kv_cache_manager.free(request)
        else:
            params = self.kv_connector.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.num_not_ahead -= not request.schedules_ahead
        return params

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled while the current one's tokens are in flight."""
        return self.num_not_ahead == 0

    def has_requests(self) -> bool:
        """Requests to run, or (with a KV connector) blocks still to save."""
        return bool(self.waiting or self.running or self.waiting_for_grammar) or (
            self.kv_connector is not None and self.kv_connector.has_pending_work())

    def get_num_unfinished_requests(self) -> int:
        remote = 0 if self.kv_connector is None else len(self.kv_connector.waiting_remote) + len(self.kv_connector.loading)
        return len(self.waiting) + len(self.running) + len(self.waiting_for_grammar) + remote

    def only_waiting_for_grammar(self) -> bool:
        """Nothing to run until a grammar compiles (the engine may block on the compiles)."""
        return bool(self.waiting_for_grammar) and not (self.waiting or self.running)

    def wait_for_grammars(self, timeout: float) -> None:
        self.structured_output.wait([r.grammar for r in self.waiting_for_grammar], timeout)

    def _admit_compiled(self) -> None:
        """Move requests whose grammar is ready to the waiting queue; fail those whose compile failed."""
        still = []
        for request in self.waiting_for_grammar:
            try:
                ready = self.structured_output.poll(request.grammar)
            except ValueError as exc:
                self._fail(request, str(exc), server_side=False)
                continue
            (self.waiting if ready else still).append(request)
        self.waiting_for_grammar = still

    def _poll_kv_connector(self) -> None:
        """Admit (or fail) requests whose remote or background KV loads ended."""
        first, last, failed = self.kv_connector.poll(idle=not (self.waiting or self.running))
        self.waiting[:0] = first
        self.waiting.extend(last)
        for request, why in failed:
            self._fail(request, why, server_side=not isinstance(why, RequestInputError))

    def _fail(self, request: Request, why: str, server_side: bool) -> None:
        request.status = RequestStatus.FINISHED_ABORTED
        self._free(request)
        self.failed[request.request_id] = str(why)
        self.server_failed += [request.request_id] if server_side else []

    # ---------------------------------------------------------------- schedule
    def _preempt_one(self, first_candidate: int) -> Request:
        """Preempt the lowest-priority running request not yet scheduled this step."""
        victim = max(self.running[first_candidate:], key=lambda r: r.sort_key(self.policy))
        self.running.remove(victim)
        if self.kv_connector is None:
            self.kv_cache_manager.free(victim)
        else:
            self.kv_connector.preempt(victim)  # swap: its computed blocks are saved first
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # a token in flight is dropped and sampled again
        victim.spec_token_ids = []
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
        cached_reqs = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        if self.waiting_for_grammar:
            self._admit_compiled()
        if self.kv_connector is not None:
            self._poll_kv_connector()
        budget = self._schedule_running(self.config.max_num_batched_tokens, num_scheduled, cached_reqs, spec_tokens)
        if budget is not None:  # None: a request was preempted, so none is admitted this step
            self._schedule_waiting(budget, num_scheduled, new_reqs)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = set()
        if self.kv_connector is not None:
            self.kv_connector.attach_metadata(output)
        if self.structured_output is not None:
            self.structured_output.attach_bitmask(output, self.requests)
        return output

    def _schedule_running(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        cached_reqs: CachedRequestData,
        spec_tokens: dict[str, list[int]],
    ) -> int | None:
        """Running requests, oldest first, preempting from the back when blocks run out.

        A decoding request with drafts (``spec_token_ids``) is scheduled for its one real
        token plus as many drafts as the budget allows after one token for each running
        request behind it (drafts never cost a request its real token); they go into
        ``spec_tokens``. Returns the budget left, or None when a request was preempted.
        """
        kv = self.kv_cache_manager
        block_size, no_op_offsets = kv.block_size, kv.no_op_decode_offsets
        cached_ids, cached_computed = cached_reqs.req_ids, cached_reqs.num_computed_tokens
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            num_new = request.num_tokens + placeholders - num_computed
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []  # verified by this step, or dropped
                num_drafts = min(len(drafts), budget - (len(self.running) - index)) if num_new == 1 else 0
                if num_drafts > 0:
                    drafts = drafts[:num_drafts]
                    num_new += num_drafts
                else:
                    drafts = None
            if num_new == 1 and num_computed % block_size in no_op_offsets and not (placeholders and self._ends_by_length(request)):
                # Fast path: one token (usually a decode) that lands inside the last block.
                cached_ids.append(request.request_id)
                cached_computed.append(num_computed)
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
                if drafts:  # the drafts go first: nothing is preempted to make room for them
                    num_new -= len(drafts)
                    drafts = None
                    continue
                victim = self._preempt_one(index)
                preempted = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; self.running shrank at or after index
            cached_ids.append(request.request_id)
            cached_computed.append(num_computed)
            if block_ids:
                cached_reqs.new_block_ids[request.request_id] = block_ids
            num_scheduled[request.request_id] = num_new
            if drafts:
                spec_tokens[request.request_id] = drafts
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
            if self.kv_connector is not None and request.request_id in self.kv_connector.loaded:
                admitted = self.kv_connector.admit_loaded(request, budget, self.config.enable_chunked_prefill)
            else:
                admitted = self._admit(request, budget)
            if admitted is None:
                break
            if admitted is _PARKED:
                continue
            block_ids, num_cached, num_new = admitted
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.mark_scheduled(num_cached)
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

    def _admit(self, request: Request, budget: int) -> tuple[list[int], int, int] | object | None:
        """A waiting request's prefix-cache hit, connector tokens and blocks: (its block ids, tokens
        computed, tokens to schedule); ``_PARKED`` when it left the queue to wait for its KV (a
        remote pull, or a background load into its new blocks); None when it does not fit this step."""
        kv = self.kv_cache_manager
        computed_blocks, num_cached = kv.get_computed_blocks(request)
        num_external = 0 if self.kv_connector is None else self.kv_connector.num_external_tokens(request, num_cached)
        if num_external is None:  # its KV comes from a remote engine: it waits without blocks
            self.waiting.remove(request)
            self.kv_connector.wait_remote(request, num_cached)  # looked up again when it is back
            return _PARKED
        if self.kv_connector is not None and self.kv_connector.loads_in_background(request, num_external):
            if not self.kv_connector.start_loading(request, computed_blocks, num_cached, num_external):
                kv.uncount_lookup(request, num_cached)  # looked up again next step
                return None
            self.waiting.remove(request)
            return _PARKED
        num_new = request.num_tokens - num_cached - num_external
        block_ids = None
        if self.config.enable_chunked_prefill or num_new <= budget:
            num_new = min(num_new, budget)
            block_ids = kv.allocate_slots(request, num_new + num_external, computed_blocks)
        if block_ids is None:
            kv.uncount_lookup(request, num_cached)  # looked up again next step
            if num_external:
                self.kv_connector.alloc_failed(request)
            return None
        if self.kv_connector is not None:
            self.kv_connector.after_alloc(request, num_external)  # loaded before this step's forward pass
        return block_ids, num_cached + num_external, num_new

    # ---------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        if scheduler_output.scheduled_spec_decode_tokens or runner_output.prompt_logprobs or runner_output.logprobs is not None:
            outputs = append_any_tokens(self.requests, scheduler_output, runner_output, self.max_model_len, self._observe_drafts)
            new_tokens = None
        else:
            new_tokens, outputs = append_plain_tokens(self.requests, runner_output, self.max_model_len, self.any_stop_ids)
        finished = set()
        for output in outputs:
            if output.finish_reason is not None:
                finished.add(output.request_id)
                output.kv_transfer_params = self._free(self.requests[output.request_id])
        if finished:
            self.running[:] = [r for r in self.running if r.request_id not in finished]
        (failed, self.failed), (server_failed, self.server_failed) = (self.failed, {}), (self.server_failed, [])
        if self.kv_connector is not None:
            self.kv_connector.step_done(scheduler_output, runner_output)
        stats = self.stats() | {"num_step_tokens": scheduler_output.total_num_scheduled_tokens}  # vllm:iteration_tokens_total
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, failed=failed or None, new_tokens=new_tokens,
                                 server_failed=server_failed or None)

    def _observe_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """Count one request's verified drafts (stats start at the first, even with no proposer set)."""
        if self.spec_stats is None:
            self.spec_stats = SpecDecodeStats(0)
        self.spec_stats.observe(num_drafts, num_accepted)

    def stats(self) -> dict:
        prefix = self.kv_cache_manager.stats
        stats = {
            "num_running": len(self.running),
            "num_waiting": self.get_num_unfinished_requests() - len(self.running),  # with grammar / remote KV waits, as vLLM
            "kv_cache_usage": self.kv_cache_manager.usage(),
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "num_preemptions": self.num_preemptions,
        }
        if self.spec_stats is not None:
            stats.update(self.spec_stats.as_dict())
        if self.kv_connector is not None:
            stats.update(self.kv_connector.stats())
        return stats
