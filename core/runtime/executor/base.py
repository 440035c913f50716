"""The executor interface: drives the workers of one engine."""

from __future__ import annotations

from typing import Protocol

from runtime.config import EngineConfig
from runtime.scheduler.output import ModelRunnerOutput, SchedulerOutput
from runtime.worker.pending import PendingOutput


class Executor(Protocol):
    def __init__(self, config: EngineConfig): ...

    def initialize(self) -> int:
        """Load the model on every worker, size and allocate the KV cache; return the number of blocks."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers; the first worker's output is returned."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Queue one step on the workers and return at once; ``result()`` gives the output.

        The engine may queue the next step before reading this one's result (async
        scheduling); the workers take the newest tokens from the device then.
        """

    def shutdown(self) -> None: ...


def create_executor(config: EngineConfig) -> Executor:
    from runtime.plugins import get_registry

    executor_cls = get_registry("executor").get(config.parallel_config.executor)()
    return executor_cls(config)
