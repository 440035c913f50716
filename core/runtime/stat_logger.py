"""Engine throughput and scheduler state in the log every few seconds (vLLM's periodic stats line).

Fed the engine's step outputs (``record``) and the prompts added (``record_prompt``);
``log`` writes one line covering the time since the previous one and stays quiet while
the engine is idle. A prompt's tokens count in the interval where its request's first
output arrives (its prefill done), as vLLM counts them, not when it was added: an offline
batch added at once would otherwise show all its prompts in the first line and none later.
Off with ``disable_log_stats`` (the offline ``LLM`` default).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from runtime.messages import EngineCoreOutputs

logger = logging.getLogger("runtime.stats")

INTERVAL_ENV = "RUNTIME_LOG_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


def log_stats_interval() -> float:
    """Seconds between stats lines: ``RUNTIME_LOG_STATS_INTERVAL`` (default 10)."""
    value = os.environ.get(INTERVAL_ENV, "")
    try:
        interval = float(value) if value else DEFAULT_INTERVAL_S
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds > 0, got {value!r}") from None
    if interval <= 0:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds > 0, got {value!r}")
    return interval


def show_stats_on_stderr() -> None:
    """Offline use may have no logging set up: then the stats logger gets its own stderr handler."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@dataclass(slots=True)
class StatLogger:
    interval_s: float = DEFAULT_INTERVAL_S  # for maybe_log
    num_prompt_tokens: int = 0  # since the last line
    num_generation_tokens: int = 0
    scheduler_stats: dict = field(default_factory=dict)  # the latest
    last_log_time: float = field(default_factory=time.monotonic)
    _last_prefix: tuple[int, int] = (0, 0)  # cumulative prefix cache (queries, hits) at the last line
    _was_idle: bool = False
    _pending_prompts: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens, until its first output

    def record_prompt(self, request_id: str, num_tokens: int) -> None:
        """A request's prompt, counted when the request's first output arrives."""
        self._pending_prompts[request_id] = num_tokens

    def forget(self, request_ids) -> None:
        """Requests that ended without an output from the core (aborted while waiting)."""
        for request_id in request_ids:
            self._pending_prompts.pop(request_id, None)

    def record(self, outputs: EngineCoreOutputs, scheduler_stats: dict | None = None) -> None:
        """One engine message; ``scheduler_stats``: the server's view of them, where several engines combine."""
        pending = self._pending_prompts
        for output in outputs.outputs:
            self.num_generation_tokens += len(output.new_token_ids)
            if pending:
                self.num_prompt_tokens += pending.pop(output.request_id, 0)
        if outputs.new_tokens is not None:
            self.num_generation_tokens += len(outputs.new_tokens.token_ids)
        stats = scheduler_stats or outputs.scheduler_stats
        if stats:
            self.scheduler_stats = stats

    def maybe_log(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self.last_log_time >= self.interval_s:
            self.log(now)

    def log(self, now: float | None = None) -> str | None:
        """Log (and return) the line for the time since the last one; None while idle."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.last_log_time, 1e-9)
        stats = self.scheduler_stats
        num_running, num_waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        idle = not (self.num_prompt_tokens or self.num_generation_tokens or num_running or num_waiting)
        line = None
        if not (idle and self._was_idle):
            line = (
                f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {num_running} reqs, Waiting: {num_waiting} reqs, "
                f"KV cache usage: {100 * stats.get('kv_cache_usage', 0.0):.1f}%, "
                f"Prefix cache hit rate: {100 * self._take_prefix_hit_rate():.1f}%"
            )
            logger.info(line)
        self._was_idle = idle
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_log_time = now
        return line

    def _take_prefix_hit_rate(self) -> float:
        """Hits / queries of the prefix cache since the last line (and start a new window)."""
        queries = self.scheduler_stats.get("prefix_cache_queries", 0)
        hits = self.scheduler_stats.get("prefix_cache_hits", 0)
        last_queries, last_hits = self._last_prefix
        self._last_prefix = (queries, hits)
        new_queries = queries - last_queries
        return (hits - last_hits) / new_queries if new_queries > 0 else 0.0
