"""One worker, in the engine core's own process.

``collective_rpc`` with a ``timeout_s`` runs the call on a helper thread and raises
:class:`~runtime.executor.broadcast.WorkerDied` when it is not done in time, as the
many-worker executors do. A Python call cannot be interrupted, so the late call runs on to
its end; as in a worker process, every later call (a step, another rpc, ``shutdown``)
waits for it first.
"""

from __future__ import annotations

import logging
import threading
import time

from runtime.config import EngineConfig
from runtime.executor.broadcast import WorkerDied
from runtime.messages import ModelRunnerOutput, SchedulerOutput
from runtime.worker.pending import PendingOutput
from runtime.worker.worker import Worker

logger = logging.getLogger(__name__)

ONE_WORKER_TARGET = "runtime.executor.uniproc:UniProcExecutor"
SHUTDOWN_WAIT_S = 5.0  # how long shutdown waits for a call that ran past its timeout


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
        self._late: threading.Thread | None = None  # a call that ran past its timeout_s and still runs

    def initialize(self) -> int:
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._wait_for_late_call()
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        self._wait_for_late_call()
        return self.worker.launch(scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout_s: float | None = None) -> list:
        """``[worker.method(*args, **kwargs)]``; past ``timeout_s`` (counting the wait for an
        earlier late call) raises ``WorkerDied`` while the call runs on."""
        call = getattr(self.worker, method)
        kwargs = kwargs or {}
        if timeout_s is None:
            self._wait_for_late_call()
            return [call(*args, **kwargs)]
        deadline = time.monotonic() + timeout_s
        if not self._wait_for_late_call(timeout_s):
            raise WorkerDied(f"the worker did not answer {method} within {timeout_s:g} s (an earlier call still runs)")
        outcome: list = []

        def run() -> None:
            try:
                outcome.append((True, call(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                outcome.append((False, exc))

        thread = threading.Thread(target=run, name=f"uniproc-{method}", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            self._late = thread
            raise WorkerDied(f"the worker did not answer {method} within {timeout_s:g} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return [value]

    def shutdown(self) -> None:
        if not self._wait_for_late_call(SHUTDOWN_WAIT_S):
            logger.warning("shutting the worker down while a call that timed out still runs")
        self.worker.shutdown()

    def _wait_for_late_call(self, timeout_s: float | None = None) -> bool:
        """Wait (at most ``timeout_s``) for a call that ran past its timeout; False if it still runs."""
        if self._late is not None:
            self._late.join(timeout_s)
            if self._late.is_alive():
                return False
            self._late = None
        return True
