"""Profiling a window of engine steps in every worker (vLLM's ``VLLM_TORCH_PROFILER_DIR``, by env).

``RUNTIME_TORCH_PROFILER_DIR=DIR`` records ``torch.profiler`` over the steps given by
``RUNTIME_TORCH_PROFILER_STEPS=FIRST:COUNT`` (default ``100:50``: past the warm-up) in each worker
and writes, per rank, a Chrome trace (``rank{R}.trace.json``, for chrome://tracing or Perfetto) and
a table of the ops by their total time (``rank{R}.txt``). Steps are counted as each worker
launches them; with async scheduling a step's GPU work may finish in the next one's window.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DIR_ENV = "RUNTIME_TORCH_PROFILER_DIR"
STEPS_ENV = "RUNTIME_TORCH_PROFILER_STEPS"


def step_profiler(rank: int) -> StepProfiler | None:
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return None
    spec = os.environ.get(STEPS_ENV, "100:50")
    try:
        first, count = (int(part) for part in spec.split(":"))
        if first < 0 or count < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"{STEPS_ENV} must be FIRST:COUNT (a step number >= 0 and a count >= 1), got {spec!r}") from None
    return StepProfiler(Path(folder), rank, first, count)


class StepProfiler:
    def __init__(self, folder: Path, rank: int, first: int, count: int):
        self.folder, self.rank, self.first, self.count = folder, rank, first, count
        self.step = 0
        self.profile: torch.profiler.profile | None = None

    def before_step(self) -> None:
        if self.step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities)
            self.profile.__enter__()

    def after_step(self) -> None:
        self.step += 1
        if self.profile is None or self.step != self.first + self.count:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profile.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profile.export_chrome_trace(str(self.folder / f"rank{self.rank}.trace.json"))
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = self.profile.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=80)
        (self.folder / f"rank{self.rank}.txt").write_text(f"steps {self.first}..{self.step - 1}\n{table}\n")
        logger.info("profiled steps %d..%d of rank %d into %s", self.first, self.step - 1, self.rank, self.folder)
        self.profile = None
