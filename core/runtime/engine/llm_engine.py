"""LLMEngine: the synchronous front end over an in-process EngineCore."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from runtime.config import EngineConfig
from runtime.engine_args import EngineArgs
from runtime.engine.core import EngineCore
from runtime.engine.core_client import RequestFailure
from runtime.engine.input_processor import InputProcessor, PromptType
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.parent_request import ParentRequest, fan_out
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.stat_logger import StatLogger

if TYPE_CHECKING:
    from runtime.metrics import EngineMetrics


def load_tokenizer(config: EngineConfig):
    if config.model_config.skip_tokenizer_init:
        return None
    from runtime.model_loader import get_tokenizer

    return get_tokenizer(config.model_config.resolved)


class LLMEngine:
    # set by enable_stats: Prometheus metrics (LLM.get_metrics) and the periodic stats log line
    metrics: EngineMetrics | None = None

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer, config.plugin_options.get("guided_decoding_backend"),
            config.scheduler_config.policy,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)
        self._ids = itertools.count()
        self._held_outputs: list[RequestOutput] = []  # outputs of a step that raised a request's failure
        self._failures: list[tuple[str, Exception]] = []  # (engine request id, failure) of one step not raised yet

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    def enable_stats(self, log_interval_s: float) -> None:
        """Keep the server's metrics (runtime.metrics) of this engine's requests, and log a stats line every
        ``log_interval_s`` seconds (``disable_log_stats=False``)."""
        from runtime.metrics import EngineMetrics

        self.metrics = EngineMetrics(self.config.model_config.served_model_name)
        self.metrics.stat_logger.interval_s = log_interval_s

    @property
    def stat_logger(self) -> StatLogger | None:
        return None if self.metrics is None else self.metrics.stat_logger

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        request, prompt_text = self.input_processor.process(request_id, prompt, params, priority)
        children = fan_out(request)
        parent = ParentRequest(request) if len(children) > 1 else None
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)
        if self.metrics is not None:
            room = self.config.model_config.max_model_len - len(request.prompt_token_ids)
            for index, child in enumerate(children):  # as AsyncLLM records them
                self.metrics.add_request(
                    child.request_id, len(child.prompt_token_ids) if index == 0 else 0, child.arrival_time,
                    max_tokens=min(child.sampling_params.max_tokens or room, room),
                    parent=request_id if parent is not None else None, n=len(children),
                )

    def abort_request(self, request_ids) -> None:
        ids = self.output_processor.abort_requests(list(request_ids))
        if self._failures or self._held_outputs:  # what a failure's step kept of them is dropped too
            gone = set(ids) | set(request_ids)
            self._failures = [failure for failure in self._failures if failure[0] not in gone]
            self._held_outputs = [output for output in self._held_outputs if output.request_id not in gone]
        self.engine_core.abort_requests(ids if ids is not None else request_ids)
        if self.metrics is not None:
            self.metrics.end_requests(ids if ids is not None else request_ids, "abort")

    def step(self) -> list[RequestOutput]:
        """One engine step; raises ValueError when the core failed a request for its input (a grammar that does
        not compile), RequestFailedError when for the server's sake (a KV transfer that failed). The other
        requests' outputs of that step come with the next call, and several failures of one step are raised
        one per call."""
        if self._failures:
            raise self._failures.pop(0)[1]
        outputs = self.engine_core.step()
        if outputs.failed:
            self.output_processor.abort_requests(list(outputs.failed))
            if self.metrics is not None:
                self.metrics.end_requests(list(outputs.failed), "error")
            server_failed = outputs.server_failed or ()
            self._failures = [
                (request_id, RequestFailure(request_id, f"request {request_id}: {message}", request_id in server_failed).error())
                for request_id, message in outputs.failed.items()
            ]
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.new_tokens)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
            if self.metrics is not None:
                self.metrics.end_requests(processed.reqs_to_abort, "stop")
        self.last_stats = outputs.scheduler_stats
        # The last requests' blocks are held until a step carries their saves to the KV offload tiers:
        # run it now, or a caller that stops stepping here (LLM.generate) leaves them held.
        if not self.output_processor.has_unfinished_requests() and self.engine_core.drain_kv_saves():
            self.last_stats = self.engine_core.scheduler.stats()
        if self.metrics is not None:
            self.metrics.record(outputs)
            self.metrics.stat_logger.maybe_log()
        held, self._held_outputs = self._held_outputs + processed.request_outputs, []
        if self._failures:  # the others' outputs of this step wait for the next call (a finished one must not be lost)
            self._held_outputs = held
            raise self._failures.pop(0)[1]
        return held

    def has_unfinished_requests(self) -> bool:
        return (self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()
                or bool(self._held_outputs or self._failures))

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()
