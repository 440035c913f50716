"""One worker, in the engine core's own process."""

from __future__ import annotations

from runtime.config import EngineConfig
from runtime.messages import ModelRunnerOutput, SchedulerOutput
from runtime.worker.pending import PendingOutput
from runtime.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.worker = Worker(config)

    def initialize(self) -> int:
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return self.worker.launch(scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout_s: float | None = None) -> list:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.worker.shutdown()
