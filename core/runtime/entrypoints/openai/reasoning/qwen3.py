"""``qwen3``: Qwen3's ``<think>`` block; an output that does not start with ``<think>`` (thinking turned off,
``enable_thinking: false``) is all content."""

from runtime.entrypoints.openai.reasoning.base import register_reasoning_parser
from runtime.entrypoints.openai.reasoning.think_tags import ThinkTagReasoningParser


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    starts_in_reasoning = False
