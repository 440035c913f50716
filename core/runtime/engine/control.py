"""Control calls on an engine core: vLLM's sleep mode (``sleep`` / ``wake_up`` / ``is_sleeping``), the
profiler (``start_profile`` / ``stop_profile``) and ``reset_prefix_cache``.

The offline ``LLM`` calls them on its in-process EngineCore (``core.control``); the server sends them to
the engine process as UTILITY messages (runtime.engine.core_proc), which runs only the names in
``CONTROL_METHODS`` (:func:`run_control_call`). A refusal is a ValueError for a bad argument and an
:class:`EngineControlError` for the engine's state or configuration; either leaves the engine running.
"""

from __future__ import annotations

import logging
from typing import Any

from runtime.worker.profiling import DIR_ENV, profiler_dir
from runtime.worker.sleep import SLEEP_TAGS

logger = logging.getLogger(__name__)

CONTROL_METHODS = ("sleep", "wake_up", "is_sleeping", "start_profile", "stop_profile", "reset_prefix_cache")
SLEEP_LEVELS = {1: "weights kept in host memory, KV cache discarded", 2: "weights and KV cache discarded"}


class EngineControlError(RuntimeError):
    """The engine refused a control call in its current state or configuration (sleep mode off, requests
    running, no profiler folder ...)."""


class EngineControl:
    """The sleep and profiling state of one EngineCore; ``enable_sleep_mode`` as the engine was started."""

    def __init__(self, core, enable_sleep_mode: bool):
        self.core = core
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = 0
        self.sleeping_tags: set[str] = set()
        self.profiling = False
        self.freed_bytes: list[dict] = []  # the last sleep's, per worker rank: {"weights": n, "kv_cache": n}

    # ------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the weights and the KV cache (see runtime.worker.sleep); the prefix
        cache is reset first. Refused while requests are unfinished."""
        self._check_sleep_mode("sleep")
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            valid = "; ".join(f"{k} ({v})" for k, v in SLEEP_LEVELS.items())
            raise ValueError(f"sleep level {level!r} is not valid; valid: {valid}")
        if self.sleeping_tags:
            raise EngineControlError(
                f"the engine is already asleep (level {self.sleep_level}; asleep: {', '.join(sorted(self.sleeping_tags))}); "
                "call wake_up() first"
            )
        core = self.core
        core.drain_kv_saves()  # blocks of finished requests on their way to the offload tiers
        num_unfinished = core.scheduler.get_num_unfinished_requests()
        if num_unfinished:
            raise EngineControlError(
                f"cannot sleep with {num_unfinished} unfinished request(s) in the engine; "
                "let them finish or abort them first"
            )
        if core.has_unfinished_requests():
            raise EngineControlError("cannot sleep while KV blocks are still being saved to the offload tiers; try again")
        if not core.reset_prefix_cache():
            raise EngineControlError("cannot sleep: the prefix cache could not be reset (KV blocks are still in use)")
        self.freed_bytes = core.executor.collective_rpc("sleep", (level,))
        self.sleep_level = level
        self.sleeping_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | str | None = None) -> None:
        """Bring back what sleep freed, all of it or the parts ``tags`` names ("weights", "kv_cache")."""
        self._check_sleep_mode("wake_up")
        tags = list(SLEEP_TAGS) if tags is None else [tags] if isinstance(tags, str) else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up tag {unknown[0]!r} is not valid; valid: {', '.join(SLEEP_TAGS)}")
        tags = [t for t in SLEEP_TAGS if t in tags and t in self.sleeping_tags]
        if not tags:
            return  # awake already, as vLLM: nothing to do
        self.core.executor.collective_rpc("wake_up", (tags,))
        self.sleeping_tags.difference_update(tags)
        if not self.sleeping_tags:
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        """True while any part freed by sleep is not back."""
        return bool(self.sleeping_tags)

    def check_awake(self) -> None:
        """ValueError (the request's failure, not the engine's) while asleep."""
        if self.sleeping_tags:
            raise ValueError(
                f"the engine is asleep (sleep level {self.sleep_level}; asleep: {', '.join(sorted(self.sleeping_tags))}); "
                "call wake_up() before adding requests"
            )

    def _check_sleep_mode(self, call: str) -> None:
        if not self.enable_sleep_mode:
            raise EngineControlError(
                f"{call}() needs sleep mode: start the engine with enable_sleep_mode=True (--enable-sleep-mode)"
            )

    # --------------------------------------------------------------- profiler
    def start_profile(self) -> None:
        """Start torch.profiler in every worker; traces go to RUNTIME_TORCH_PROFILER_DIR at stop_profile."""
        if profiler_dir() is None:
            raise EngineControlError(
                f"start_profile() needs {DIR_ENV} (vLLM's VLLM_TORCH_PROFILER_DIR): set it to the folder for the "
                "traces before the engine starts"
            )
        if self.profiling:
            raise EngineControlError("a profile is already recording; call stop_profile() first")
        self.core.executor.collective_rpc("start_profile")
        self.profiling = True

    def stop_profile(self) -> list[str]:
        """Stop the profile and write each worker's trace; returns their paths in rank order."""
        if not self.profiling:
            raise EngineControlError("no profile is recording; call start_profile() first")
        self.profiling = False
        return self.core.executor.collective_rpc("stop_profile")

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Write a profile still recording, so that stopping the engine does not lose it."""
        if self.profiling:
            try:
                self.stop_profile()
            except Exception:  # noqa: BLE001 - shutting down: report, do not mask the caller's error
                logger.exception("writing the profile that was recording failed while shutting down")


def run_control_call(core, method: str, args: list) -> tuple[bool, Any]:
    """``(True, result)`` of ``core.control.<method>(*args)``, or ``(False, [error kind, message])`` for a
    refusal; other failures propagate (the engine goes down, as for a failed step)."""
    if method not in CONTROL_METHODS:
        return False, ["ValueError", f"unknown engine control call {method!r}; valid: {', '.join(CONTROL_METHODS)}"]
    try:
        return True, getattr(core.control, method)(*args)
    except ValueError as exc:
        return False, ["ValueError", str(exc)]
    except EngineControlError as exc:
        return False, ["EngineControlError", str(exc)]


def control_error(kind: str, message: str) -> Exception:
    """The exception a refusal sent back by :func:`run_control_call` is raised as."""
    return ValueError(message) if kind == "ValueError" else EngineControlError(message)
