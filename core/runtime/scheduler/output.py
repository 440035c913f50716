"""Per-request results of a step: sampled tokens appended up to a stop, the output records (or, for
plain one-token outputs, columns), drafts verified, and grammar completion."""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime.messages import EngineCoreOutput, LogprobsLists, ModelRunnerOutput, NewTokens, SchedulerOutput
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.stopping import check_stop, join_logprobs

logger = logging.getLogger(__name__)

# Enum members looked up once: a class attribute lookup costs ~150 ns on Python 3.11,
# and the per-request loops below do several per request and step.
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
    output = EngineCoreOutput(
        request.request_id, new_tokens, logprobs, prompt_logprobs, finish_reason, request.stop_reason, num_cached_tokens,
        ended_by_grammar,
    )
    if new_tokens and len(request.output_token_ids) == len(new_tokens):  # its first token: when it queued and first ran
        output.queued_time, output.scheduled_time = request.queued_time, request.scheduled_time
    return output


def append_tokens(
    request: Request, tokens, runner_output: ModelRunnerOutput, row: int | None, max_model_len: int
) -> EngineCoreOutput | None:
    """Append sampled ``tokens`` up to the first that ends the request; its output record (``row``:
    its first logprobs row), or None for a prompt chunk that has nothing to report yet."""
    new_tokens: list[int] = []
    request_grammar = request.grammar
    grammar = request_grammar.grammar if request_grammar is not None else None
    for token in tokens:
        request.append_output_token(token)
        new_tokens.append(token)
        if check_stop(request, max_model_len):
            break
        if grammar is not None and request_grammar.takes(request.output_token_ids) and grammar_ends(request, grammar, token):
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


def append_any_tokens(
    requests: dict[str, Request],
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    max_model_len: int,
    observe_drafts: Callable[[int, int], None],
) -> list[EngineCoreOutput]:
    """Any step (drafts verified, logprobs, prompt logprobs): every output as a record.

    ``observe_drafts(num_drafts, num_accepted)`` is told of each request whose drafts were verified.
    """
    sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
    row_of = {}  # first logprobs row of each request that sampled (one row per sampled token)
    if runner_output.logprobs is not None:
        row = 0
        for req_id, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            row_of[req_id] = row
            row += len(tokens)
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    prompt_chunks = runner_output.prompt_logprobs
    outputs: list[EngineCoreOutput] = []
    for req_id in scheduler_output.num_scheduled_tokens:
        request = requests.get(req_id)
        if request is None or request.status != _RUNNING:
            continue  # aborted or preempted while the step ran
        if prompt_chunks and req_id in prompt_chunks and not request.output_token_ids:
            request.prompt_logprobs.append(prompt_chunks[req_id])
        if req_id in sampled and request.num_output_placeholders:
            request.num_output_placeholders -= 1  # its token is back
        if spec_tokens and req_id in spec_tokens and req_id in sampled:
            # k drafts verified, m = accepted + 1 tokens emitted: the rejected drafts'
            # positions count as not computed (their KV is overwritten later).
            num_drafts, num_emitted = len(spec_tokens[req_id]), len(sampled[req_id])
            request.num_computed_tokens -= num_drafts + 1 - num_emitted
            observe_drafts(num_drafts, num_emitted - 1)
        output = append_tokens(request, sampled.get(req_id, ()), runner_output, row_of.get(req_id), max_model_len)
        if output is not None:
            outputs.append(output)
    return outputs
