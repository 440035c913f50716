"""One worker, in the engine core's own process."""

from __future__ import annotations

from runtime.config import EngineConfig
from runtime.messages import ModelRunnerOutput, SchedulerOutput
from runtime.worker.pending import PendingOutput
from runtime.worker.worker import Worker

ONE_WORKER_TARGET = "runtime.executor.uniproc:UniProcExecutor"


def multi_worker_executors() -> list[str]:
    """The registered executors that run more than one worker (every one but this one's names)."""
    from runtime.plugins import get_registry

    registry = get_registry("executor")
    return [name for name in registry.names() if getattr(registry.get(name), "target", None) != ONE_WORKER_TARGET]


class UniProcExecutor:
    def __init__(self, config: EngineConfig):
        parallel = config.parallel_config
        if parallel.world_size > 1:
            raise ValueError(
                f"executor {parallel.executor!r} runs one worker, but tensor_parallel_size {parallel.tensor_parallel_size} "
                f"x pipeline_parallel_size {parallel.pipeline_parallel_size} needs {parallel.world_size}; "
                f"choose one of: {', '.join(multi_worker_executors())}"
            )
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
