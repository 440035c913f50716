"""``n > 1``: one user request fanned out into n child requests, and gathered back.

The EngineCore only knows single-completion requests. The front end sends n
children (ids ``"{i}_{request_id}"``) and folds their completions into one
``RequestOutput`` under the parent's id, ordered by completion index.
"""

from __future__ import annotations

import copy

import msgspec

from runtime.messages import EngineCoreRequest
from runtime.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from runtime.sampling_params import RequestOutputKind


def child_request_id(index: int, parent_request_id: str) -> str:
    return f"{index}_{parent_request_id}"


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine requests for ``request``: itself when ``n == 1``, else n children.

    Each child has a copy of the sampling params with ``n=1`` and, when a seed
    is set, ``seed + i``, so the n samples differ but stay reproducible. The
    copies are shallow (O(1) each, not a deep copy per child): the children
    share the parent's stop lists and logit bias, which nothing mutates.

    A prefill for a remote decode (``kv_transfer_params`` with ``do_remote_decode``)
    computes one prompt: child 0 keeps the KV blocks for the decode instance (its
    ``kv_transfer_params`` become the parent's); the others do not lease theirs, which
    nobody could pull (they would be held until their lease expired).
    """
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for index in range(params.n):
        child_params = copy.copy(params)
        child_params.n = 1
        if params.seed is not None:
            child_params.seed = params.seed + index
        if index > 0 and _remote_decode(params):
            child_params.extra_args = {k: v for k, v in params.extra_args.items() if k != "kv_transfer_params"}
        child_id = child_request_id(index, request.request_id)
        children.append(msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params))
    return children


def _remote_decode(params) -> bool:
    transfer = params.extra_args.get("kv_transfer_params") if params.extra_args else None
    return isinstance(transfer, dict) and bool(transfer.get("do_remote_decode"))


def _concat(earlier: CompletionOutput, later: CompletionOutput) -> CompletionOutput:
    """Two deltas of one child within one step, as one delta."""
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return CompletionOutput(
        index=later.index,
        text=earlier.text + later.text,
        token_ids=earlier.token_ids + later.token_ids,
        cumulative_logprob=later.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
    )


class ParentRequest:
    """Gathers the completions of the n children of one request.

    ``CUMULATIVE``: each output holds the newest completion of every child
    seen so far. ``DELTA``: each output holds the children with something
    new. ``FINAL_ONLY``: one output with all n completions once all finished.
    """

    def __init__(self, request: EngineCoreRequest):
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.n = params.n
        self.child_ids = [child_request_id(i, request.request_id) for i in range(params.n)]
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None  # child 0's (see fan_out)
        self._unfinished_indices = set(range(params.n))
        self._outputs: dict[int, CompletionOutput] = {}  # by completion index
        self._prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return not self._unfinished_indices

    def add_child_output(self, completion: CompletionOutput) -> None:
        index = completion.index
        earlier = self._outputs.get(index)
        if self.output_kind == RequestOutputKind.DELTA and earlier is not None:
            completion = _concat(earlier, completion)
        self._outputs[index] = completion
        if completion.finished():
            self._unfinished_indices.discard(index)

    def drop_child(self, index: int) -> None:
        """Stop waiting for child ``index`` (it was aborted on its own)."""
        self._unfinished_indices.discard(index)

    def make_request_output(self, prompt: str | None) -> RequestOutput | None:
        """The parent's output for this step, or None when there is nothing to send."""
        finished = self.finished
        if not self._outputs or (self.output_kind == RequestOutputKind.FINAL_ONLY and not finished):
            return None
        outputs = [self._outputs[i] for i in sorted(self._outputs)]
        if self.output_kind == RequestOutputKind.DELTA:
            self._outputs.clear()
        return RequestOutput(
            request_id=self.request_id,
            prompt=prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(),
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=self.kv_transfer_params,
        )

    def _take_prompt_logprobs(self) -> PromptLogprobs | None:
        if self.output_kind != RequestOutputKind.DELTA:
            return self.prompt_logprobs
        if self._prompt_logprobs_sent or self.prompt_logprobs is None:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs
