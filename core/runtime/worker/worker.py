"""A worker owns one device: platform setup, the model runner and its KV cache."""

from __future__ import annotations

import logging
import os

import torch

from runtime.config import EngineConfig
from runtime.messages import ModelRunnerOutput, SchedulerOutput
from runtime.worker.model_runner import ModelRunner
from runtime.worker.pending import PendingOutput
from runtime.worker.profiling import DIR_ENV, OnDemandProfiler, profiler_dir, step_profiler
from runtime.worker.sleep import SLEEP_TAGS, WorkerSleep

logger = logging.getLogger(__name__)


class Worker:
    """``rank`` is the worker's place among the engine's ``tensor x pipeline`` workers; with
    more than one, ``distributed_init_method`` (a ``torch.distributed`` init URL that all of
    them share) joins the process group before the model is built."""

    def __init__(
        self, config: EngineConfig, local_rank: int = 0, rank: int = 0, distributed_init_method: str | None = None
    ):
        from runtime.platforms import select_platform

        self.config = config
        self.rank = rank
        self.platform = select_platform(config.device_config.platform)
        parallel = config.parallel_config
        num_threads = config.device_config.num_threads
        if num_threads is None and parallel.world_size > 1 and self.platform.device_type == "cpu":
            num_threads = max(1, (os.cpu_count() or 1) // parallel.world_size)  # the workers share the cores
        self.platform.set_threads(num_threads)
        self.device = self.platform.device(local_rank)
        if parallel.world_size > 1:
            from runtime.distributed import init_distributed

            if distributed_init_method is None:
                raise ValueError(f"a worker of a {parallel.world_size}-worker engine needs a distributed_init_method")
            init_distributed(
                self.platform, rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, distributed_init_method
            )
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.platform, self.device)
        self.profiler = step_profiler(rank)  # RUNTIME_TORCH_PROFILER_DIR
        self.on_demand_profiler: OnDemandProfiler | None = None  # start_profile() / stop_profile()
        self.sleep_state: WorkerSleep | None = None  # sleep() / wake_up()

    def load_model(self) -> None:
        self.model_runner.load_model()

    def attention_specs(self) -> list:
        """This rank's attention layers (heads of its shard), for the executor's checks and tests."""
        return self.model_runner.attention_specs

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, self.config.cache_config.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).result()

    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        if self.profiler is not None:
            self.profiler.before_step()
        pending = self.model_runner.launch(scheduler_output)
        if self.profiler is not None:
            self.profiler.after_step()
        report = getattr(self.model_runner.kv_connector, "get_connector_output", None)
        return pending if report is None else ReportedOutput(pending, report())

    def kv_connector_handshake(self):
        """What this rank's KV connector half tells the scheduler half once the cache exists, or None."""
        handshake = getattr(self.model_runner.kv_connector, "get_handshake_metadata", None)
        return None if handshake is None else handshake()

    def describe(self) -> dict:
        """What this worker runs, for tests and diagnostics: its tensor-parallel all-reduce and how
        many decode steps replayed a captured graph."""
        from runtime.distributed import get_parallel_state

        graphs = self.model_runner.graphs
        return {
            "collectives": get_parallel_state().collectives or "none (one worker per stage)",
            "decode_graph_replays": 0 if graphs is None else sum(graphs.replay_counts.values()),
        }

    def sleep(self, level: int = 1) -> dict:
        """Free the weights (level 1: kept in host memory; level 2: reloaded at wake-up) and the KV cache;
        returns the bytes freed of each ("weights", "kv_cache"). See runtime.worker.sleep."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r} is not valid; valid: 1, 2")
        if self.sleep_state is None:
            self.sleep_state = WorkerSleep(self.model_runner)
        return self.sleep_state.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``tags`` names of what sleep freed ("weights", "kv_cache"; default both)."""
        if self.sleep_state is not None:
            self.sleep_state.wake_up(SLEEP_TAGS if tags is None else tags)

    def start_profile(self) -> None:
        """Start recording torch.profiler traces into RUNTIME_TORCH_PROFILER_DIR (until stop_profile)."""
        folder = profiler_dir()
        if folder is None:
            raise RuntimeError(f"{DIR_ENV} is not set in worker rank {self.rank}")
        if self.on_demand_profiler is None or self.on_demand_profiler.folder != folder:
            if self.on_demand_profiler is not None and self.on_demand_profiler.profile is not None:
                raise RuntimeError(f"rank {self.rank} is already profiling; stop_profile() first")
            self.on_demand_profiler = OnDemandProfiler(folder, self.rank, self.profiler)
        self.on_demand_profiler.start()

    def stop_profile(self) -> str:
        """Stop the recording start_profile began and write it; returns the trace's path."""
        if self.on_demand_profiler is None:
            raise RuntimeError(f"rank {self.rank} is not profiling; start_profile() first")
        return str(self.on_demand_profiler.stop())

    def shutdown(self) -> None:
        """Finish the KV connector's saves in flight (offload tiers write their last blocks)."""
        shutdown = getattr(self.model_runner.kv_connector, "shutdown", None)
        if shutdown is not None:
            shutdown()


class ReportedOutput:
    """A launched step and its KV connector's report (taken once the step's copies are
    queued and its saves awaited): ``result()`` carries the report as this rank's entry."""

    def __init__(self, pending: PendingOutput, report):
        self.pending = pending
        self.report = report

    def ready(self) -> bool:
        return self.pending.ready()

    def result(self) -> ModelRunnerOutput:
        output = self.pending.result()
        output.kv_connector_outputs = [self.report]
        return output
