"""One log line per request received by the server (``--disable-log-requests`` turns it off)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from runtime.sampling_params import SamplingParams

logger = logging.getLogger("runtime.requests")

DEFAULT_MAX_LOG_LEN = 200  # characters of the prompt shown; -1 shows all


@dataclass(frozen=True, slots=True)
class RequestLogger:
    max_log_len: int = DEFAULT_MAX_LOG_LEN

    def log(self, request_id: str, prompt, params: SamplingParams) -> None:
        """``Received request <id>: prompt: '...', params: SamplingParams(...)``."""
        text = prompt.get("prompt", prompt.get("prompt_token_ids")) if isinstance(prompt, dict) else prompt
        shown = repr(text)
        if self.max_log_len >= 0 and len(shown) > self.max_log_len:
            shown = shown[: self.max_log_len] + f"... ({len(shown)} characters)"
        logger.info("Received request %s: prompt: %s, params: %s", request_id, shown, params)
