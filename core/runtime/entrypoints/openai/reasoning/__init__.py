"""Reasoning parsers for chat completions (``--reasoning-parser NAME``): the model's reasoning goes to
``reasoning_content``, the rest to ``content``."""

from runtime.entrypoints.openai.reasoning.base import (
    Reasoning,
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)
from runtime.entrypoints.openai.reasoning import deepseek_r1, qwen3  # noqa: F401 - they register themselves

__all__ = [
    "Reasoning",
    "ReasoningParser",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
