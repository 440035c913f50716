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
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass

from runtime.config import EngineConfig
from runtime.engine_args import EngineArgs
from runtime.engine.control_client import ControlCalls
from runtime.engine.core_client import EngineCoreClient, EngineDeadError, RequestFailure, UtilityResult, holding_stop_signals
from runtime.engine.dp_client import DPEngineCoreClient, make_engine_client
from runtime.engine.input_processor import InputProcessor, PromptType
from runtime.engine.llm_engine import load_tokenizer
from runtime.engine.coalesce import take_queued
from runtime.engine.parent_request import ParentRequest, fan_out
from runtime.engine.request_state import RequestState
from runtime.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, NewTokens
from runtime.metrics import EngineMetrics
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0
ROUTE_CHUNK_ENTRIES = 4096  # logprob entries (or outputs) turned into RequestOutputs per turn of the loop


def split_outputs(outputs: list[EngineCoreOutput], max_entries: int) -> Iterator[list[EngineCoreOutput]]:
    """``outputs`` in order, in runs of about ``max_entries`` (an output counts 1 plus its logprob entries)."""
    chunk: list[EngineCoreOutput] = []
    num_entries = 0
    for output in outputs:
        chunk.append(output)
        num_entries += 1
        for lists in (output.new_logprobs, output.new_prompt_logprobs):
            if lists is not None and lists.token_ids:
                num_entries += len(lists.token_ids) * len(lists.token_ids[0])
        if num_entries >= max_entries:
            yield chunk
            chunk, num_entries = [], 0
    if chunk:
        yield chunk


@dataclass(slots=True)
class PreparedRequest:
    """A request tokenized, validated and fanned out, ready to register and send."""

    request_id: str
    children: list[EngineCoreRequest]  # the request itself when n == 1
    states: list[RequestState]  # the OutputProcessor's state of each child


class AsyncLLM:
    """Serve many concurrent requests from one event loop; start with ``await AsyncLLM.start(args)``."""

    def __init__(
        self, config: EngineConfig, engine_args: EngineArgs, engine_core: EngineCoreClient | DPEngineCoreClient | None = None,
        metrics: EngineMetrics | None = None, stream_interval: int = 1,
    ):
        from runtime.engine.output_processor import OutputProcessor

        # Spawn first: the engine loads the model while this process loads the tokenizer.
        self.engine_core = engine_core or make_engine_client(engine_args, config)
        self.config = config
        self.model_config = config.model_config
        try:  # a failure (or a SIGTERM's KeyboardInterrupt) anywhere below must not leave the engine running
            # A stop signal takes effect after the block, not inside the libraries' imports that loading a
            # tokenizer runs: there a KeyboardInterrupt was swallowed once (the server then served on), or
            # passed through C code that made the interpreter's exit code that of SIGINT.
            with holding_stop_signals():
                self.tokenizer = load_tokenizer(config)
                self.input_processor = InputProcessor(
                    config.model_config, self.tokenizer, config.plugin_options.get("guided_decoding_backend"),
                    config.scheduler_config.policy,
                )
                self.output_processor = OutputProcessor(self.tokenizer, stream_interval)
                self.metrics = metrics or EngineMetrics(config.model_config.served_model_name)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> RequestOutput | BaseException
        self._parent_of: dict[str, str] = {}  # engine (child) request id -> request id
        self._child_ids: dict[str, list[str]] = {}  # request id -> its engine request ids
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._dead_error: EngineDeadError | None = None
        self._stopping: EngineDeadError | None = None  # set by abort_all: no new requests
        self._output_task: asyncio.Task | None = None
        self.control = ControlCalls(self.engine_core)  # sleep / wake_up / profiling calls in flight

    @classmethod
    async def start(
        cls, engine_args: EngineArgs, config: EngineConfig | None = None, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        **kwargs,
    ) -> "AsyncLLM":
        """Build the config (validating every argument here), spawn the engine (or use ``engine_core``),
        wait until it is ready; ``kwargs`` go to the constructor."""
        config = config or engine_args.create_engine_config()
        llm = cls(config, engine_args, **kwargs)
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
    def engine_pids(self) -> list[int]:
        """One per data-parallel replica."""
        return self.engine_core.engine_pids

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
        error = self._dead_error or self._stopping
        if error is not None:
            raise error

    def probe_health(self) -> EngineDeadError | None:
        """Why the engine cannot serve, checking its processes now: a replica may have died an instant ago,
        before the output handler (which polls) has noticed."""
        if self._dead_error is None and self.engine_core.probe_death() is not None:
            return EngineDeadError(self.engine_core.dead_message)
        return self._dead_error

    # --------------------------------------------------------------- requests
    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request (kinds per ``sampling_params.output_kind``).

        Raises ValueError for bad input (before anything is yielded), EngineDeadError
        if the engine dies. Closing the generator early aborts the request.
        Tokenizing, validating and fanning out run in a worker thread, so a large
        prompt or ``n`` never stalls the event loop (and the other requests).
        """
        self.check_health()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue  # reserved while the thread works
        finished = added = False
        try:
            prepared = await asyncio.to_thread(self._prepare, request_id, prompt, sampling_params, priority)
            self.check_health()
            self._add_request(prepared)
            added = True
            pending = None  # an error queued behind outputs, raised once they are out
            while not finished:
                if pending is not None:
                    item, pending = pending, None
                else:
                    item = queue.get_nowait() if not queue.empty() else await queue.get()
                    item, pending = take_queued(item, queue, sampling_params.output_kind)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if added and not finished:
                self.abort(request_id)
            self._child_ids.pop(request_id, None)

    def _prepare(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int) -> PreparedRequest:
        """Tokenize, validate, fan out and build the output states (off the event loop: touches no shared state)."""
        request, prompt_text = self.input_processor.process(request_id, prompt, params, priority)
        children = fan_out(request)
        parent = ParentRequest(request) if len(children) > 1 else None
        states = self.output_processor.new_states(children, prompt_text, parent)  # ValueError: stop strings, no tokenizer
        return PreparedRequest(request_id, children, states)

    def _add_request(self, prepared: PreparedRequest) -> None:
        """Track and send a prepared request: O(1) per child on the event loop."""
        request_id, children = prepared.request_id, prepared.children
        self.output_processor.add_states(prepared.states)
        child_ids = [child.request_id for child in children]
        self._child_ids[request_id] = child_ids
        parent = request_id if len(children) > 1 else None
        max_model_len = self.model_config.max_model_len
        for index, child in enumerate(children):
            self._parent_of[child.request_id] = request_id
            room = max_model_len - len(child.prompt_token_ids)
            self.metrics.add_request(  # the max_tokens the engine applies
                child.request_id, len(child.prompt_token_ids) if index == 0 else 0, child.arrival_time,
                max_tokens=min(child.sampling_params.max_tokens or room, room), parent=parent, n=len(children),
            )
        try:
            for child in children:
                engine_index = self.engine_core.add_request(child)  # data parallel: the replica's rank
                if engine_index is not None:
                    self.metrics.set_engine(child.request_id, engine_index)
        except BaseException:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; unknown or finished ids are ignored. O(number of its children)."""
        child_ids = self.output_processor.abort_requests([request_id])
        child_ids = list(dict.fromkeys(child_ids + self._child_ids.pop(request_id, [])))
        for child_id in child_ids:
            self._parent_of.pop(child_id, None)
        self.metrics.end_requests(child_ids, "abort")
        if not self.is_dead:
            self.engine_core.abort_requests(child_ids)

    def abort_all(self, reason: str) -> None:
        """Abort every request in flight, failing each with EngineDeadError(reason), and refuse new ones."""
        self._stopping = EngineDeadError(reason)
        for request_id, queue in list(self._queues.items()):
            self.abort(request_id)
            queue.put_nowait(self._stopping)

    # --------------------------------------------------------- output handler
    async def _output_handler(self) -> None:
        try:
            while True:
                engine_index, message = await self.engine_core.get_indexed_output()
                if isinstance(message, RequestFailure):
                    self._fail_request(message)
                elif isinstance(message, UtilityResult):
                    self.control.resolve(engine_index, message)
                else:
                    await self._route(message, engine_index)
        except EngineDeadError as exc:
            self._engine_died(exc)
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("the output handler failed")
            self._engine_died(EngineDeadError(f"the output handler failed: {type(exc).__name__}: {exc}"))

    async def _route(self, outputs: EngineCoreOutputs, engine_index: int = 0) -> None:
        """Hand one step's outputs (of data-parallel replica ``engine_index``) to their requests, in chunks of
        bounded work (a step of many prompt logprobs would otherwise hold the event loop, and every other
        client, for seconds)."""
        self.metrics.record(outputs, engine_index=engine_index)
        # The plain one-token outputs (one per running request at most, each cheap) go with the first chunk.
        new_tokens = outputs.new_tokens
        for index, chunk in enumerate(split_outputs(outputs.outputs, ROUTE_CHUNK_ENTRIES)):
            if index:
                await asyncio.sleep(0)
            self._route_chunk(chunk, new_tokens)
            new_tokens = None
        if new_tokens is not None:
            self._route_chunk([], new_tokens)

    def _route_chunk(self, outputs: list[EngineCoreOutput], new_tokens: NewTokens | None = None) -> None:
        for output in outputs:
            if output.finished:
                self._parent_of.pop(output.request_id, None)
        processed = self.output_processor.process_outputs(outputs, new_tokens)
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
            queue.put_nowait(failure.error())  # ValueError (the request's input) or RequestFailedError

    def _engine_died(self, error: EngineDeadError) -> None:
        self._dead_error = error
        self.control.fail_all(error)
        self.metrics.mark_engine_dead()
        for queue in self._queues.values():
            queue.put_nowait(error)
        for callback in self._dead_callbacks:
            try:
                callback(error)
            except Exception:
                logger.exception("an engine-dead callback failed")

    # ---------------------------------------------------------- control calls
    # vLLM's AsyncLLM methods, run by every engine core between steps (runtime.engine.control).
    async def sleep(self, level: int = 1) -> None:
        self.check_health()
        await self.control.call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.check_health()
        await self.control.call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        self.check_health()
        return any(await self.control.call("is_sleeping"))

    async def start_profile(self) -> None:
        self.check_health()
        await self.control.call("start_profile")

    async def stop_profile(self) -> list[str]:
        """The paths of the traces written, every engine's workers in order."""
        self.check_health()
        return [path for paths in await self.control.call("stop_profile") for path in paths]

    async def reset_prefix_cache(self) -> bool:
        self.check_health()
        return all(await self.control.call("reset_prefix_cache"))

    # ---------------------------------------------------------------- shutdown
    async def shutdown(self) -> None:
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        await self.engine_core.stop_reading()
        await asyncio.to_thread(self.engine_core.shutdown)
