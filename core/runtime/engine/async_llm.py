"""AsyncLLM: the asyncio front end of the server over an EngineCore process.

The API process tokenizes (InputProcessor), fans ``n > 1`` out into child
requests, sends them to the engine process (EngineCoreClient), and one
output-handler task turns every EngineCoreOutputs into RequestOutputs
(OutputProcessor: incremental detokenizing, stop strings) that it routes to
the per-request asyncio queue read by ``generate``. Leaving ``generate``
early (a client disconnect cancels it) aborts the request in the engine. If
the engine dies, every queue gets an EngineDeadError and new requests are
refused with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable

from runtime.config import EngineArgs, EngineConfig
from runtime.engine.core_client import EngineCoreClient, EngineDeadError, RequestFailure
from runtime.engine.input_processor import InputProcessor, PromptType
from runtime.engine.llm_engine import load_tokenizer
from runtime.engine.messages import EngineCoreOutputs
from runtime.metrics import EngineMetrics
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0


class AsyncLLM:
    """Serve many concurrent requests from one event loop; start with ``await AsyncLLM.start(args)``."""

    def __init__(self, config: EngineConfig, engine_args: EngineArgs):
        from runtime.engine.output_processor import OutputProcessor

        # Spawn first: the engine loads the model while this process loads the tokenizer.
        self.engine_core = EngineCoreClient(engine_args)
        self.config = config
        self.model_config = config.model_config
        try:
            self.tokenizer = load_tokenizer(config)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.input_processor = InputProcessor(config.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(config.model_config.served_model_name)
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> RequestOutput | BaseException
        self._parent_of: dict[str, str] = {}  # engine (child) request id -> request id
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._dead_error: EngineDeadError | None = None
        self._output_task: asyncio.Task | None = None

    @classmethod
    async def start(
        cls, engine_args: EngineArgs, config: EngineConfig | None = None, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    ) -> "AsyncLLM":
        """Build the config (validating every argument here), spawn the engine, wait until it is ready."""
        config = config or engine_args.create_engine_config()
        llm = cls(config, engine_args)
        try:
            await llm.engine_core.wait_ready(ready_timeout_s)
        except BaseException:
            llm.engine_core.shutdown()
            raise
        llm._output_task = asyncio.create_task(llm._output_handler(), name="AsyncLLM.output_handler")
        return llm

    # ------------------------------------------------------------------ state
    @property
    def engine_pid(self) -> int | None:
        return self.engine_core.process.pid

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    def on_engine_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(error)`` once, when the engine dies."""
        self._dead_callbacks.append(callback)

    def check_health(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error

    # --------------------------------------------------------------- requests
    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request (kinds per ``sampling_params.output_kind``).

        Raises ValueError for bad input (before anything is yielded), EngineDeadError
        if the engine dies. Closing the generator early aborts the request.
        """
        self.check_health()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue = self._add_request(request_id, prompt, sampling_params, priority)
        finished = False
        try:
            while not finished:
                item = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int) -> asyncio.Queue:
        from runtime.engine.parent_request import ParentRequest, fan_out

        request, prompt_text = self.input_processor.process(request_id, prompt, params, priority)
        children = fan_out(request)
        parent = ParentRequest(request) if len(children) > 1 else None
        try:
            for index, child in enumerate(children):
                self.output_processor.add_request(child, prompt_text, parent, index)
        except BaseException:  # e.g. stop strings without a tokenizer: forget the children added so far
            self.output_processor.abort_requests([request_id])
            raise
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        for index, child in enumerate(children):
            self._parent_of[child.request_id] = request_id
            num_prompt = len(child.prompt_token_ids) if index == 0 else 0
            self.metrics.add_request(child.request_id, num_prompt, child.arrival_time)
        try:
            for child in children:
                self.engine_core.add_request(child)
        except BaseException:
            self._queues.pop(request_id, None)
            self.abort(request_id)
            raise
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; unknown or finished ids are ignored."""
        child_ids = self.output_processor.abort_requests([request_id])
        child_ids += [c for c, p in self._parent_of.items() if p == request_id and c not in child_ids]
        for child_id in child_ids:
            self._parent_of.pop(child_id, None)
        self.metrics.end_requests(child_ids, "abort")
        if not self.is_dead:
            self.engine_core.abort_requests(child_ids)

    # --------------------------------------------------------- output handler
    async def _output_handler(self) -> None:
        try:
            while True:
                message = await self.engine_core.get_output()
                if isinstance(message, RequestFailure):
                    self._fail_request(message)
                else:
                    self._route(message)
        except EngineDeadError as exc:
            self._engine_died(exc)
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("the output handler failed")
            self._engine_died(EngineDeadError(f"the output handler failed: {type(exc).__name__}: {exc}"))

    def _route(self, outputs: EngineCoreOutputs) -> None:
        self.metrics.record(outputs)
        for output in outputs.outputs:
            if output.finished:
                self._parent_of.pop(output.request_id, None)
        processed = self.output_processor.process_outputs(outputs.outputs)
        for request_output in processed.request_outputs:
            queue = self._queues.get(request_output.request_id)
            if queue is not None:
                queue.put_nowait(request_output)
        if processed.reqs_to_abort:  # finished by a stop string here, still running there
            for child_id in processed.reqs_to_abort:
                self._parent_of.pop(child_id, None)
            self.metrics.end_requests(processed.reqs_to_abort, "stop")
            self.engine_core.abort_requests(list(processed.reqs_to_abort))

    def _fail_request(self, failure: RequestFailure) -> None:
        request_id = self._parent_of.get(failure.request_id, failure.request_id)
        self.metrics.end_requests([failure.request_id], "error")
        queue = self._queues.get(request_id)
        self.abort(request_id)  # drop it and its siblings everywhere
        if queue is not None:
            queue.put_nowait(ValueError(failure.message))

    def _engine_died(self, error: EngineDeadError) -> None:
        self._dead_error = error
        self.metrics.mark_engine_dead()
        for queue in self._queues.values():
            queue.put_nowait(error)
        for callback in self._dead_callbacks:
            try:
                callback(error)
            except Exception:
                logger.exception("an engine-dead callback failed")

    # ---------------------------------------------------------------- shutdown
    async def shutdown(self) -> None:
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.to_thread(self.engine_core.shutdown)
