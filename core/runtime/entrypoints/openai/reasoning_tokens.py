"""``usage.completion_tokens_details.reasoning_tokens``: how many of a choice's generated tokens are reasoning
(with ``--reasoning-parser``).

The generated tokens are decoded one by one (as the engine does), noting where each token's text begins; the
parser's ``reasoning_span`` places the reasoning in that text, its tags left out. A token counts when its text
begins inside the reasoning. So a tag is never reasoning: not a single-token ``<think>`` or ``</think>``, nor
any piece of a tag spelled over several tokens (a piece ``>\\n`` that ends the start tag and begins the reasoning
does not count either), nor anything after the end tag. A token that begins in the reasoning and runs into the
end tag counts. Special tokens that decode to nothing (an EOS at the end) count only inside open reasoning.
Without a tokenizer (``skip_tokenizer_init``) there is no text, and no reasoning token.
"""

from __future__ import annotations

from bisect import bisect_left

from runtime.engine.detokenizer import make_detokenizer
from runtime.entrypoints.openai.reasoning import ReasoningParser
from runtime.sampling_params import SamplingParams


class ReasoningTokenCounter:
    """The reasoning tokens of one choice, its tokens handed in as they come (``add``)."""

    def __init__(self, parser: ReasoningParser, tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._parser = parser
        params = SamplingParams(skip_special_tokens=skip_special_tokens,
                                spaces_between_special_tokens=spaces_between_special_tokens)
        self._detokenizer = None if tokenizer is None else make_detokenizer(tokenizer, [], params)
        self._starts: list[int] = []  # where each token's text begins in the decoded text
        self._settled: int | None = None  # the count, once the end tag is in: later tokens cannot change it

    def add(self, token_ids: list[int]) -> None:
        if self._detokenizer is None or self._settled is not None:
            return
        for token_id in token_ids:
            self._starts.append(len(self._detokenizer.output_text))
            self._detokenizer.update([token_id], False)

    def count(self, finished: bool = False) -> int:
        """The reasoning tokens so far; ``finished``: no token comes after (text held back is released)."""
        if self._settled is not None or self._detokenizer is None:
            return self._settled or 0
        if finished:
            self._detokenizer.flush()
        text = self._detokenizer.output_text
        span = self._parser.reasoning_span(text)
        if span is None:
            return 0
        start, end = span
        count = bisect_left(self._starts, end) - bisect_left(self._starts, start)
        if end < len(text):  # the reasoning has ended
            self._settled = count
        return count


def count_reasoning_tokens(parser: ReasoningParser, tokenizer, token_ids: list[int], request) -> int:
    """The reasoning tokens of a whole output of ``request`` (its skip_special_tokens decide the text)."""
    counter = ReasoningTokenCounter(parser, tokenizer, request.skip_special_tokens, request.spaces_between_special_tokens)
    counter.add(token_ids)
    return counter.count(finished=True)
