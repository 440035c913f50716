"""The executor contract: drives the workers of one engine.

Executors are registered through ``register_executors`` as ``factory(config)``; a class
whose constructor takes the :class:`runtime.config.EngineConfig` is such a factory.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from runtime.config import EngineConfig
from runtime.messages import ModelRunnerOutput, SchedulerOutput
from runtime.worker.pending import PendingOutput


@runtime_checkable
class Executor(Protocol):
    """Runs the steps the scheduler plans on one or more workers.

    ``execute_model_async`` is optional (read with ``getattr``): without it the engine
    runs steps one after the other, and ``--async-scheduling`` is turned off with a warning.
    ``check_health()`` is optional too: when present, the engine process calls it on each pass
    of its idle loop (every half second) and it raises if a worker is gone, naming it; it must
    be cheap (look at the workers' liveness, send them nothing).
    """

    def initialize(self) -> int:
        """Load the model on every worker, size and allocate the KV cache; return the number of blocks."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers; the first worker's output is returned."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Queue one step on the workers and return at once; ``result()`` gives the output.

        The engine may queue the next step before reading this one's result (async
        scheduling); the workers take the newest tokens from the device then. A step's
        ``grammar_bitmask`` may be a :class:`runtime.structured_output.DeferredBitmask` whose
        fill first collects the previous step: an executor that sends the step to another
        process fills it (``resolve_bitmask``) before serializing any of the step.
        """

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, timeout_s: float | None = None
    ) -> list:
        """Call ``worker.method(*args, **kwargs)`` on every worker; their results in rank order.

        A worker that fails or dies raises an error naming its rank; ``timeout_s`` bounds the
        wait (default: none).
        """

    def shutdown(self) -> None:
        """Stop the workers and release their devices; called once, also after a failure."""


def create_executor(config: EngineConfig) -> Executor:
    """The executor ``config.parallel_config.executor`` names, built by its registered factory."""
    from runtime.plugins import get_registry

    return get_registry("executor").create(config.parallel_config.executor, config)
