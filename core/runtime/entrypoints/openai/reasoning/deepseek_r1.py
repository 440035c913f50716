"""``deepseek_r1``: DeepSeek-R1's ``<think>`` block; its chat templates may open the block in the prompt, so
an output without the start tag is reasoning up to ``</think>`` (all of it when there is no end tag)."""

from runtime.entrypoints.openai.reasoning.base import register_reasoning_parser
from runtime.entrypoints.openai.reasoning.think_tags import ThinkTagReasoningParser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    starts_in_reasoning = True
