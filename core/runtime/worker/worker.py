"""A worker owns one device: platform setup, the model runner and its KV cache."""

from __future__ import annotations

import logging

import torch

from runtime.config import EngineConfig
from runtime.scheduler.output import ModelRunnerOutput, SchedulerOutput
from runtime.worker.model_runner import ModelRunner
from runtime.worker.pending import PendingOutput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0):
        from runtime.platforms import select_platform

        self.config = config
        self.platform = select_platform(config.device_config.platform)
        self.platform.set_threads(config.device_config.num_threads)
        self.device = self.platform.device(local_rank)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.platform, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, self.config.cache_config.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return self.model_runner.launch(scheduler_output)
