"""Per-request results of a step: sampled tokens appended up to a stop, the output records (or, for
plain one-token outputs, columns), and grammar completion."""

from __future__ import annotations

import logging

from runtime.messages import EngineCoreOutput, LogprobsLists, ModelRunnerOutput, NewTokens
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.stopping import check_stop, join_logprobs

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
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


def append_tokens(
    request: Request, tokens, runner_output: ModelRunnerOutput, row: int | None, max_model_len: int
) -> EngineCoreOutput | None:
    """Append sampled ``tokens`` up to the first that ends the request; its output record (``row``:
    its first logprobs row), or None for a prompt chunk that has nothing to report yet."""
    new_tokens: list[int] = []
    grammar = request.grammar.grammar if request.grammar is not None else None
    for token in tokens:
        request.append_output_token(token)
        new_tokens.append(token)
        if check_stop(request, max_model_len):
            break
        if grammar is not None and grammar_ends(request, grammar, token):
            break
    if not new_tokens and not (request.prompt_logprobs and request.num_computed_tokens >= request.num_prompt_tokens):
        return None
    return make_output(request, new_tokens, runner_output, row)


def append_plain_tokens(
    requests: dict[str, Request], runner_output: ModelRunnerOutput, max_model_len: int, any_stop_ids: set[int]
) -> tuple[NewTokens | None, list[EngineCoreOutput]]:
    """A step of one sampled token per request and no logprobs (the usual decode step).

    A token that is not a request's first (that output carries ``num_cached_tokens``) and
    cannot end it goes into the columns, with no record and no call per request; the others
    take :func:`append_tokens`. ``any_stop_ids`` holds every request's stop ids (a token
    outside it stops none). Requests that did not sample have nothing to report.
    """
    request_ids: list[str] = []
    token_ids: list[int] = []
    outputs: list[EngineCoreOutput] = []
    for req_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
        request = requests.get(req_id)
        if request is None or request.status != _RUNNING:
            continue  # aborted or preempted while the step ran
        if request.num_output_placeholders:
            request.num_output_placeholders -= 1  # its token is back
        token = sampled[0]
        output_ids = request.output_token_ids
        num_output = len(output_ids) + 1  # with this token
        if (
            num_output == 1 or num_output >= request.max_tokens or request.num_tokens >= max_model_len - 1
            or token in any_stop_ids or request.grammar is not None
        ):
            outputs.append(append_tokens(request, sampled, runner_output, None, max_model_len))
            continue
        output_ids.append(token)
        request.all_token_ids.append(token)
        request.num_tokens += 1
        request_ids.append(req_id)
        token_ids.append(token)
    return (NewTokens(request_ids, token_ids) if request_ids else None), outputs
