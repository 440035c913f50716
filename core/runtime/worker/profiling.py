"""Profiling engine steps in every worker with ``torch.profiler`` (vLLM's ``VLLM_TORCH_PROFILER_DIR``).

``RUNTIME_TORCH_PROFILER_DIR=DIR`` records the steps given by ``RUNTIME_TORCH_PROFILER_STEPS=FIRST:COUNT``
(default ``100:50``: past the warm-up) in each worker and writes, per rank, a Chrome trace
(``rank{R}.trace.json``, for chrome://tracing or Perfetto) and a table of the ops by their total time
(``rank{R}.txt``). Steps are counted as each worker launches them; with async scheduling a step's GPU
work may finish in the next one's window.

With the same setting, ``start_profile()`` / ``stop_profile()`` (``LLM``'s, the server's ``/start_profile``
and ``/stop_profile``) record whatever runs in between, written as ``rank{R}.{MS}.trace.json`` and
``.txt`` (MS: the stop time in milliseconds). Starting one ends a step window that is recording (it is
written early); a window whose first step comes while one runs is skipped.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DIR_ENV = "RUNTIME_TORCH_PROFILER_DIR"
STEPS_ENV = "RUNTIME_TORCH_PROFILER_STEPS"


def profiler_dir() -> Path | None:
    """The folder of the traces, or None when profiling is off."""
    folder = os.environ.get(DIR_ENV)
    return Path(folder) if folder else None


def start_torch_profile() -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profile = torch.profiler.profile(activities=activities)
    profile.__enter__()
    return profile


def write_profile(profile: torch.profiler.profile, folder: Path, name: str, header: str) -> Path:
    """Stop ``profile`` and write ``name.trace.json`` and the table of its ops ``name.txt`` into ``folder``."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profile.__exit__(None, None, None)
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"{name}.trace.json"
    profile.export_chrome_trace(str(trace))
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    table = profile.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=80)
    (folder / f"{name}.txt").write_text(f"{header}\n{table}\n")
    return trace


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
        self.on_demand = False  # a start_profile() recording runs

    def before_step(self) -> None:
        if self.step == self.first:
            if self.on_demand:
                logger.info("the profile window at step %d is skipped: start_profile() is recording", self.first)
                return
            self.profile = start_torch_profile()

    def after_step(self) -> None:
        self.step += 1
        if self.profile is not None and self.step == self.first + self.count:
            self.end_window()

    def end_window(self) -> None:
        write_profile(self.profile, self.folder, f"rank{self.rank}", f"steps {self.first}..{self.step - 1}")
        logger.info("profiled steps %d..%d of rank %d into %s", self.first, self.step - 1, self.rank, self.folder)
        self.profile = None


class OnDemandProfiler:
    """``start()`` / ``stop()`` around whatever the worker runs in between, traces into ``folder``."""

    def __init__(self, folder: Path, rank: int, window: StepProfiler | None):
        self.folder, self.rank, self.window = folder, rank, window
        self.profile: torch.profiler.profile | None = None

    def start(self) -> None:
        if self.profile is not None:
            raise RuntimeError(f"rank {self.rank} is already profiling; stop_profile() first")
        if self.window is not None:
            if self.window.profile is not None:
                self.window.end_window()  # written early: one torch profiler at a time
            self.window.on_demand = True
        self.profile = start_torch_profile()

    def stop(self) -> Path:
        if self.profile is None:
            raise RuntimeError(f"rank {self.rank} is not profiling; start_profile() first")
        profile, self.profile = self.profile, None
        if self.window is not None:
            self.window.on_demand = False
        trace = write_profile(profile, self.folder, f"rank{self.rank}.{int(time.time() * 1000)}", "start_profile() .. stop_profile()")
        logger.info("profile of rank %d written to %s", self.rank, trace)
        return trace
