"""Where a constrained chat output's grammar starts when the server has a reasoning parser.

The engine leaves the reasoning block free and starts the grammar after it (``structured_outputs.reasoning``,
see :mod:`runtime.scheduler.reasoning_gate`); it needs the tags as token ids, read here from the tokenizer.
``</think>`` and ``<think>`` are single added tokens for Qwen3 and DeepSeek-R1; a tag that the tokenizer
spells over several tokens is matched as that id sequence, so the model must write it the same way.
"""

from __future__ import annotations

from runtime.entrypoints.openai.reasoning.think_tags import END, START, ThinkTagReasoningParser
from runtime.sampling_params import ReasoningTags

PROMPT_TAIL = 8  # tokens of the prompt's end searched for a tag (the generation prompt's last few)


def reasoning_tags(parser: type, tokenizer, prompt_token_ids: list[int]) -> ReasoningTags | None:
    """The tags of the reasoning block an output of ``parser`` (a reasoning parser class) starts with, for
    ``structured_outputs.reasoning``; None where the grammar holds from the first token: a parser without
    ``<think>`` tags, no tokenizer, or a prompt that closed the block already (it ends with the end tag and
    whitespace, as Qwen3's template writes with ``enable_thinking: false``).

    A prompt that opened the block (it ends with the start tag and whitespace, as DeepSeek-R1's template
    writes) puts the output in the reasoning from its first token, whatever the parser assumes.
    """
    if tokenizer is None or not issubclass(parser, ThinkTagReasoningParser):
        return None
    end = tokenizer.encode(END, add_special_tokens=False)
    start = tokenizer.encode(START, add_special_tokens=False)
    block = prompt_block(tokenizer, prompt_token_ids, start, end)
    if block == "closed":
        return None
    return ReasoningTags(end, start, parser.starts_in_reasoning or block == "opened")


def prompt_block(tokenizer, prompt_token_ids: list[int], start: list[int] | None = None,
                 end: list[int] | None = None) -> str | None:
    """How the prompt leaves the ``<think>`` block: "opened" (it ends with the start tag and whitespace),
    "closed" (with the end tag), or None (neither: the output says). The parsers' ``prompt`` argument."""
    if tokenizer is None:
        return None
    end = tokenizer.encode(END, add_special_tokens=False) if end is None else end
    start = tokenizer.encode(START, add_special_tokens=False) if start is None else start
    closed = _ends_with_tag(tokenizer, prompt_token_ids, end)
    opened = _ends_with_tag(tokenizer, prompt_token_ids, start)
    if closed > opened:
        return "closed"
    return "opened" if opened > closed else None


def _ends_with_tag(tokenizer, prompt: list[int], tag: list[int]) -> int:
    """Where ``tag`` starts in ``prompt`` (1 + index) when only whitespace follows it within the last
    PROMPT_TAIL tokens; 0 when it does not end the prompt that way."""
    last = len(prompt) - len(tag)
    for index in range(last, max(-1, last - PROMPT_TAIL), -1):
        if prompt[index:index + len(tag)] == tag:
            rest = prompt[index + len(tag):]
            return index + 1 if not rest or not tokenizer.decode(rest).strip() else 0
    return 0
