"""Control calls (sleep, wake_up, profiling: runtime.engine.control) from an asyncio front end to its engine
process or processes, each answered by a UtilityResult that the front end's output handler hands to
:meth:`ControlCalls.resolve`."""

from __future__ import annotations

import asyncio
import itertools

from runtime.engine.control import control_error
from runtime.engine.core_client import UtilityResult


class ControlCalls:
    """The calls in flight to ``engine_core`` (an EngineCoreClient or a DPEngineCoreClient). One event loop."""

    def __init__(self, engine_core):
        self.engine_core = engine_core
        self._ids = itertools.count()
        self._pending: dict[int, list[asyncio.Future]] = {}  # call id -> one future per engine, by engine index

    async def call(self, method: str, *args) -> list:
        """``method(*args)`` on every engine core; their results by engine index. A refusal is raised as
        ValueError or EngineControlError, the engine's death as EngineDeadError."""
        call_id = next(self._ids)
        num_engines = self.engine_core.send_utility(call_id, method, list(args))
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(num_engines)]
        self._pending[call_id] = futures
        try:
            return list(await asyncio.gather(*futures))
        finally:
            self._pending.pop(call_id, None)

    def resolve(self, engine_index: int, result: UtilityResult) -> None:
        futures = self._pending.get(result.call_id)
        if futures is None or engine_index >= len(futures) or futures[engine_index].done():
            return  # the caller is gone (cancelled, or failed on another engine's answer)
        if result.ok:
            futures[engine_index].set_result(result.value)
        else:
            futures[engine_index].set_exception(control_error(*result.value))

    def fail_all(self, error: BaseException) -> None:
        """The engine died: every call in flight raises ``error``."""
        for futures in self._pending.values():
            for future in futures:
                if not future.done():
                    future.set_exception(error)
