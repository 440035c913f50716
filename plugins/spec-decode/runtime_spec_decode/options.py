"""Reading a proposer's options from ``config.plugin_options["speculative_config"]``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPTIONS_KEY = "speculative_config"


def speculative_options(config: Any) -> Mapping:
    """The resolved speculative_config dict of an :class:`runtime.config.EngineConfig` ({} if none)."""
    options = (getattr(config, "plugin_options", None) or {}).get(OPTIONS_KEY) or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"plugin_options[{OPTIONS_KEY!r}] must be a mapping, got {type(options).__name__}")
    return options


def require_model(config: Any, method: str) -> str:
    """The ``model`` option (a local folder or .gguf file), which ``method`` needs."""
    model = speculative_options(config).get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(
            f"speculative method {method!r} needs speculative_config's 'model': the path of its checkpoint, e.g. "
            f'{{"method": "{method}", "model": "/path/to/checkpoint", "num_speculative_tokens": 4}}'
        )
    return model
