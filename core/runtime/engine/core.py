"""EngineCore: the step loop of schedule, execute and update (in-process or in its own process)."""

from __future__ import annotations

import logging
from typing import Any

from runtime.config import EngineConfig
from runtime.engine.control import EngineControl
from runtime.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerOutput
from runtime.executor.base import create_executor
from runtime.kv_transfer import KVConnectorRole, make_kv_connector
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.scheduler import Scheduler
from runtime.scheduler.structured_output import StructuredOutputManager
from runtime.spec_decode import DRAFT_PLACEHOLDER_ID, ProposalBatch, is_worker_proposer

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.005  # while only compiles are pending, the idle step waits this long for one


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = config.model_config
        # The proposer first: its factory checks the draft (vocabulary, sizes) before any model loads.
        self.proposer, self.num_speculative_tokens = make_proposer(config)
        self.executor = create_executor(config)
        self.num_blocks = self.executor.initialize()
        self.structured_output = make_structured_output_manager(config)
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, self.num_blocks, self.structured_output,
            num_speculative_tokens=self.num_speculative_tokens,
            kv_connector=make_kv_connector(config, KVConnectorRole.SCHEDULER),
        )
        handshake = getattr(self.scheduler.kv_connector and self.scheduler.kv_connector.connector,
                            "set_handshake_metadata", None)
        if handshake is not None:  # the connector's scheduler half hears what every rank's worker half holds
            handshake(self.executor.collective_rpc("kv_connector_handshake"))
        self.async_scheduling = config.scheduler_config.async_scheduling
        if self.async_scheduling and not hasattr(self.executor, "execute_model_async"):
            logger.warning("executor %s cannot queue steps; async scheduling is off", config.parallel_config.executor)
            self.async_scheduling = False
        if self.async_scheduling and self.proposer is not None:
            # Drafts are proposed from the tokens a step returns, so the next step cannot be
            # scheduled before they are back.
            logger.warning("async scheduling is not supported with speculative decoding yet; running synchronous steps")
            self.async_scheduling = False
        self.in_flight: InFlightStep | None = None  # a launched step not yet collected
        self.num_steps_ahead = 0  # steps queued while the previous one was still running
        # sleep / wake_up, start_profile / stop_profile (runtime.engine.control)
        self.control = EngineControl(self, bool(config.plugin_options.get("enable_sleep_mode")))

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Reject what the model cannot run; the front end checks the same first."""
        num_prompt = len(request.prompt_token_ids)
        max_len = self.model_config.max_model_len
        if num_prompt == 0:
            raise ValueError("prompt must not be empty")
        if num_prompt >= max_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens, but max_model_len is {max_len}; "
                f"the prompt must be shorter than {max_len} tokens to leave room for output"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range; valid ids are 0..{vocab - 1}")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.control.check_awake()
        self.validate_request(request)
        params = request.sampling_params
        room = self.model_config.max_model_len - len(request.prompt_token_ids)
        max_tokens = min(params.max_tokens or room, room)
        eos = frozenset(self.model_config.eos_token_ids)
        if request.eos_token_id is not None:
            eos = eos | {request.eos_token_id}
        # The sampler's min_tokens mask keeps all of these out until min_tokens is reached.
        params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        in_flight = self.in_flight
        if (in_flight is not None and request.request_id in in_flight.scheduler_output.num_scheduled_tokens
                and request.request_id not in self.scheduler.requests):
            # The id's previous request (aborted or finished) has a token in the step in flight:
            # take it now, or it would be appended to this new request when the step is collected.
            in_flight.collect()
        self.scheduler.add_request(Request.from_engine_core_request(request, max_tokens, eos))

    def abort_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or self.in_flight is not None

    def step(self) -> EngineCoreOutputs:
        if self.in_flight is None and self.scheduler.only_waiting_for_grammar():
            self.scheduler.wait_for_grammars(GRAMMAR_POLL_S)  # block on the compiles instead of spinning
        if self.async_scheduling:
            return self.step_with_overlap()
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.stats())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.proposer is not None:
            self.propose_drafts()
        return outputs

    def propose_drafts(self) -> None:
        """Draft tokens for the running requests that decode next step (``request.spec_token_ids``).

        A request gets at most k drafts, fewer where emitting all of them plus the target's
        own token would pass max_tokens or max_model_len, or where min_tokens would be
        reached inside the run (the sampler's stop mask is exact only before it; see
        ``max_drafts_for_min_tokens``). Requests with a grammar (structured output) get none
        where it may hold (their drafts would have to be checked against it first); in the
        reasoning before it (a reasoning gate) a host proposer's drafts are cut before any that
        would end the reasoning, so that the token after the end is sampled under the grammar.
        Nor do requests with bad words get drafts: their bans depend on the tokens before each position.
        """
        from runtime.sample.rejection_sampler import max_drafts_for_min_tokens

        k = self.num_speculative_tokens
        max_model_len = self.scheduler.max_model_len
        requests, limits = [], []
        worker = is_worker_proposer(self.proposer)  # drafts on the device: they cannot be cut here
        for request in self.scheduler.running:
            request.spec_token_ids = []
            if (
                request.status != RequestStatus.RUNNING
                or (request.grammar is not None and (worker or request.grammar.constrains))
                or request.sampling_params.bad_words_token_ids  # its bans follow each sampled token
                or request.num_output_placeholders
                or request.num_computed_tokens != request.num_tokens - 1  # not decoding (a prefill chunk is left)
            ):
                continue
            limit = min(
                k,
                request.max_tokens - request.num_output_tokens - 1,
                max_model_len - request.num_tokens - 1,
                max_drafts_for_min_tokens(request.sampling_params.min_tokens, request.num_output_tokens, k),
            )
            if limit > 0:
                requests.append(request)
                limits.append(limit)
        if not requests:
            return
        if worker:
            # The worker drafts inside the verification step; the scheduler spends placeholders.
            for request, limit in zip(requests, limits):
                request.spec_token_ids = [DRAFT_PLACEHOLDER_ID] * limit
            return
        batch = ProposalBatch(
            req_ids=[r.request_id for r in requests], token_ids=[r.all_token_ids for r in requests], num_speculative_tokens=k
        )
        proposals = self.proposer.propose(batch)
        if proposals.probs is not None:
            raise ValueError(
                "a host proposer (one without uses_kv_cache / needs_hidden_states) returned draft probabilities; only "
                "worker proposers may sample their drafts (their q stays on the device for the rejection sampler)"
            )
        for request, limit, drafts in zip(requests, limits, proposals.token_ids):
            request.spec_token_ids = list(drafts[:limit])
            if request.grammar is not None:  # in the reasoning: none may end it
                del request.spec_token_ids[request.grammar.gate.num_free_drafts(request.output_token_ids, request.spec_token_ids):]

    def step_with_overlap(self) -> EngineCoreOutputs:
        """Queue the next step, then collect the one the device has been running.

        Scheduling the next step and handling the previous step's tokens (stop checks,
        outputs) both happen while the device computes. The next step treats each
        request's token in flight as a placeholder, and the worker reads it from the
        device. Requests whose sampling reads their own output ids on the host
        (penalties, min_tokens, seeds, prompt logprobs) make the engine drain first.

        Constrained requests do not: their grammars must see the previous step's tokens
        before the next step's bitmask is filled, so the previous step is collected at the
        fill, which the model runner does once it has queued the next forward pass (a
        worker in another process gets the bitmask filled, so there the step is collected
        before the next one is sent).
        """
        previous, self.in_flight = self.in_flight, None
        if self.scheduler.has_requests() and (previous is None or self.scheduler.can_schedule_ahead()):
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids or scheduler_output.kv_connector_metadata:
                if previous is not None and scheduler_output.grammar_bitmask is not None:
                    scheduler_output.grammar_bitmask.before_fill = previous.collect
                pending = self.executor.execute_model_async(scheduler_output)
                self.in_flight = InFlightStep(self.scheduler, scheduler_output, pending)
                self.num_steps_ahead += previous is not None
        if previous is None:
            return EngineCoreOutputs(scheduler_stats=self.scheduler.stats())
        return previous.collect()

    def drain_kv_saves(self, max_steps: int = 4) -> bool:
        """Run the steps that only save blocks to the KV offload tiers (finished requests' KV,
        held until a step carries its saves) while no request is left, so that an idle engine
        holds no block; returns whether any step ran."""
        connector = self.scheduler.kv_connector
        for num_steps in range(max_steps):
            if connector is None or self.scheduler.get_num_unfinished_requests() or not (
                connector.has_pending_work() or self.in_flight is not None
            ):
                return num_steps > 0
            self.step()
        return True

    def finish_kv_saves(self, max_steps: int = 4) -> None:
        """:meth:`drain_kv_saves` at shutdown, so that a stopped engine leaves the last blocks behind."""
        try:
            self.drain_kv_saves(max_steps)
        except Exception:  # noqa: BLE001 - shutting down: report, do not mask the caller's error
            logger.exception("saving KV blocks to the offload tiers failed while shutting down")

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.control.shutdown()
        self.finish_kv_saves()
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self.executor.shutdown()


class InFlightStep:
    """A launched step: ``collect()`` waits for its tokens and runs the scheduler's
    ``update_from_output`` on them, once (later calls return the same outputs)."""

    __slots__ = ("scheduler", "scheduler_output", "pending", "outputs")

    def __init__(self, scheduler: Scheduler, scheduler_output: SchedulerOutput, pending: Any):
        self.scheduler = scheduler
        self.scheduler_output = scheduler_output
        self.pending = pending  # the executor's PendingOutput / PendingStep
        self.outputs: EngineCoreOutputs | None = None

    def collect(self) -> EngineCoreOutputs:
        if self.outputs is None:
            self.outputs = self.scheduler.update_from_output(self.scheduler_output, self.pending.result())
        return self.outputs


def make_proposer(config: EngineConfig):
    """The speculative-decoding proposer and k, or (None, 0) when speculation is off."""
    spec = config.plugin_options.get("speculative_config")
    if not spec:
        return None, 0
    from runtime.plugins import get_registry

    method = spec["method"]
    proposer = get_registry("proposer").create(method, config)  # a worker proposer loads its weights in the worker
    logger.info("speculative decoding: %s, up to %d draft tokens per step", method, spec["num_speculative_tokens"])
    return proposer, int(spec["num_speculative_tokens"])


def make_structured_output_manager(config: EngineConfig) -> StructuredOutputManager | None:
    """The manager of grammars when a guided decoding backend is configured (it loads lazily)."""
    name = config.plugin_options.get("guided_decoding_backend")
    if name is None:
        return None
    model_config = config.model_config
    if model_config.skip_tokenizer_init:
        logger.info("structured output is off: it needs the tokenizer (skip_tokenizer_init is set)")
        return None

    def build_backend():
        from runtime.model_loader import get_tokenizer
        from runtime.plugins import get_registry

        tokenizer = get_tokenizer(model_config.resolved)
        return get_registry("guided_backend").create(name, tokenizer, model_config.vocab_size)

    options = config.plugin_options
    return StructuredOutputManager(build_backend, model_config.vocab_size, options["structured_output_compile_timeout"],
                                   options["structured_output_compile_memory_bytes"])
