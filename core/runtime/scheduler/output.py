"""Per-request results of a step: the EngineCoreOutput record, and grammar completion."""

from __future__ import annotations

import logging

from runtime.messages import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.stopping import join_logprobs

logger = logging.getLogger(__name__)

_FINISHED = RequestStatus.FINISHED_STOPPED  # this and every status above it


def grammar_ends(request: Request, grammar, token: int) -> bool:
    """Advance the grammar over a sampled token; finish the request once the grammar is complete."""
    if not grammar.accept_tokens([token]):
        # The bitmask allows only tokens the grammar accepts, so this is a backend bug: end the
        # request rather than let it run unconstrained.
        logger.error("request %s: the grammar rejected sampled token %d; finishing it", request.request_id, token)
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        request.grammar.ended = True
        return True
    return False


def make_output(request: Request, new_tokens: list[int], runner_output: ModelRunnerOutput, row) -> EngineCoreOutput:
    """The step's output record of ``request``; ``row`` is its first logprobs row (None: none)."""
    logprobs = prompt_logprobs = None
    if request.sampling_params.logprobs is not None and new_tokens and runner_output.logprobs is not None and row is not None:
        lp = runner_output.logprobs
        end = row + len(new_tokens)  # fewer than sampled when a stop ends the request mid-run
        logprobs = LogprobsLists(lp.token_ids[row:end], lp.logprobs[row:end], lp.ranks[row:end])
    if request.prompt_logprobs and request.num_computed_tokens >= request.num_prompt_tokens:
        prompt_logprobs = join_logprobs(request.prompt_logprobs)
        request.prompt_logprobs = []
    status = request.status
    finish_reason = status.finish_reason if status >= _FINISHED else None
    num_cached_tokens = request.num_cached_tokens if request.num_cached_tokens > 0 else 0
    # Positional, in field order: msgspec parses keyword arguments noticeably slower.
    ended_by_grammar = request.grammar is not None and request.grammar.ended
    return EngineCoreOutput(
        request.request_id, new_tokens, logprobs, prompt_logprobs, finish_reason, request.stop_reason, num_cached_tokens,
        ended_by_grammar,
    )
