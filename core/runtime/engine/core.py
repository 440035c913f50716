"""EngineCore: the step loop of schedule, execute and update (in-process or in its own process)."""

from __future__ import annotations

import logging
from typing import Any

from runtime.config import EngineConfig
from runtime.engine.messages import EngineCoreOutputs, EngineCoreRequest
from runtime.executor.base import create_executor
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.output import SchedulerOutput
from runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = config.model_config
        self.executor = create_executor(config)
        self.num_blocks = self.executor.initialize()
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.num_blocks)
        self.async_scheduling = config.scheduler_config.async_scheduling
        if self.async_scheduling and not hasattr(self.executor, "execute_model_async"):
            logger.warning("executor %s cannot queue steps; async scheduling is off", config.parallel_config.executor)
            self.async_scheduling = False
        self.in_flight: tuple[SchedulerOutput, Any] | None = None  # a launched step not yet collected
        self.num_steps_ahead = 0  # steps queued while the previous one was still running

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
        self.validate_request(request)
        params = request.sampling_params
        room = self.model_config.max_model_len - len(request.prompt_token_ids)
        max_tokens = min(params.max_tokens or room, room)
        eos = frozenset(self.model_config.eos_token_ids)
        if request.eos_token_id is not None:
            eos = eos | {request.eos_token_id}
        # The sampler's min_tokens mask keeps all of these out until min_tokens is reached.
        params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        self.scheduler.add_request(Request.from_engine_core_request(request, max_tokens, eos))

    def abort_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or self.in_flight is not None

    def step(self) -> EngineCoreOutputs:
        if self.async_scheduling:
            return self.step_with_overlap()
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.stats())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def step_with_overlap(self) -> EngineCoreOutputs:
        """Queue the next step, then collect the one the device has been running.

        Scheduling the next step and handling the previous step's tokens (stop checks,
        outputs) both happen while the device computes. The next step treats each
        request's token in flight as a placeholder, and the worker reads it from the
        device. Requests whose sampling reads their own output ids on the host
        (penalties, min_tokens, seeds, prompt logprobs) make the engine drain first.
        """
        previous, self.in_flight = self.in_flight, None
        if self.scheduler.has_requests() and (previous is None or self.scheduler.can_schedule_ahead()):
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids:
                self.in_flight = (scheduler_output, self.executor.execute_model_async(scheduler_output))
                self.num_steps_ahead += previous is not None
        if previous is None:
            return EngineCoreOutputs(scheduler_stats=self.scheduler.stats())
        scheduler_output, pending = previous
        return self.scheduler.update_from_output(scheduler_output, pending.result())

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
