"""Structured output after the reasoning: a request whose ``structured_outputs.reasoning`` names the
tags of a reasoning block samples that block unconstrained, and its grammar holds from the first token
after the block's end tag (vLLM's structured output with a reasoning parser).

An output goes through up to three phases, told apart from its own tokens:

- opening (the output may open the block itself, as Qwen3's do): its first token is sampled from the
  grammar's first tokens plus the start tag (one token). The start tag opens the reasoning; any other
  token is the content's first, and the grammar takes it.
- reasoning: no constraint, until the output's tokens since the reasoning began end with the end tag's
  ids (one id for Qwen3 and DeepSeek-R1, whose ``</think>`` is an added token; a tag of several tokens
  counts only where the model writes exactly that sequence).
- content: every token goes to the grammar, which starts fresh on the first one.

The gate advances where the grammar does, on the tokens that come back from a step, so it and the
grammar always agree with the request's output tokens (which a preempted request keeps). A bitmask row
is given to a request in the reasoning only while a token of an earlier step is still in flight (async
scheduling): that token may end the reasoning, and the row is filled after it is back (every token
allowed while still reasoning). Speculative drafts are cut before any draft that would end the
reasoning, so a step's tokens after the end tag are never sampled unconstrained.
"""

from __future__ import annotations

import numpy as np

from runtime.sampling_params import ReasoningTags

OPENING, REASONING, CONTENT = 0, 1, 2


class ReasoningGate:
    """Where one output is: opening, in the reasoning or in the content (see the module docstring)."""

    __slots__ = ("end_ids", "start_id", "phase", "reasoning_from")

    def __init__(self, tags: ReasoningTags):
        self.end_ids = list(tags.end_token_ids)
        self.start_id = tags.start_token_ids[0] if len(tags.start_token_ids) == 1 else None
        if tags.starts_in_reasoning:
            self.phase = REASONING
        else:  # a start tag of several tokens cannot be offered beside the grammar: the grammar holds at once
            self.phase = OPENING if self.start_id is not None else CONTENT
        self.reasoning_from = 0  # index of the output's first reasoning token

    @property
    def is_reasoning(self) -> bool:
        return self.phase == REASONING

    def advance(self, output_ids: list[int]) -> bool:
        """The output's last token (``output_ids[-1]``) was appended; whether the grammar takes it."""
        if self.phase == CONTENT:
            return True
        if self.phase == OPENING:
            if output_ids[-1] == self.start_id:
                self.phase, self.reasoning_from = REASONING, len(output_ids)
                return False
            self.phase = CONTENT
            return True
        if self._ends_reasoning(output_ids, len(output_ids)):
            self.phase = CONTENT
        return False

    def _ends_reasoning(self, tokens: list[int], end: int) -> bool:
        """Whether ``tokens[:end]`` ends with the end tag inside the reasoning."""
        size = len(self.end_ids)
        return end - self.reasoning_from >= size and tokens[end - size:end] == self.end_ids

    def num_free_drafts(self, output_ids: list[int], drafts: list[int]) -> int:
        """How many leading ``drafts`` a step may verify unconstrained: in the reasoning, those before the
        first that would complete the end tag (the token after it must be sampled under the grammar);
        none in the other phases, whose tokens need the grammar's mask."""
        if self.phase != REASONING:
            return 0
        tokens = output_ids + drafts
        for index in range(len(drafts)):
            if self._ends_reasoning(tokens, len(output_ids) + index + 1):
                return index
        return len(drafts)

    def add_start_tag(self, bitmask: np.ndarray) -> None:
        """Allow the start tag in ``bitmask`` (one row of int32 words; see
        :func:`runtime.structured_output.allocate_token_bitmask`) while the output may still open the block."""
        if self.phase == OPENING:
            word, bit = divmod(self.start_id, 32)
            if word < bitmask.shape[0]:
                bitmask.view(np.uint32)[word] |= np.uint32(1 << bit)
