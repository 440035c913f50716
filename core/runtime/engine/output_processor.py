"""OutputProcessor: EngineCore outputs (new token ids per request) -> RequestOutputs.

Runs in the front end (offline ``LLMEngine`` and the async server). Per
request it detokenizes incrementally, checks stop strings, converts logprobs
and builds vLLM-style ``RequestOutput``s; children of an ``n > 1`` request are
gathered under their parent's id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.engine.logprobs import TokenTexts
from runtime.engine.messages import EngineCoreOutput, EngineCoreRequest
from runtime.engine.parent_request import ParentRequest
from runtime.engine.request_state import RequestState
from runtime.outputs import RequestOutput


@dataclass
class ProcessedOutputs:
    """What one call of ``process_outputs`` produced.

    ``reqs_to_abort`` are engine request ids that a stop string finished here
    while the EngineCore still runs them: the caller must abort them there.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Keeps the state of every unfinished engine request and turns outputs into RequestOutputs.

    ``tokenizer`` is None with ``skip_tokenizer_init``: texts stay "".
    """

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        """Track ``request``; a child of an ``n > 1`` request names its ``parent`` and ``index``."""
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already running; request ids must be unique")
        if parent is not None and not 0 <= index < parent.n:
            raise ValueError(f"child index {index} out of range for parent {parent.request_id!r} with n={parent.n}")
        state = RequestState(request, prompt, self.tokenizer, self._token_texts, parent, index)
        self.request_states[request_id] = state
        if parent is not None:
            self.parent_requests[parent.request_id] = parent

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Update every request named in ``outputs`` and return this step's RequestOutputs.

        Outputs for requests not tracked (finished or aborted before) are ignored.
        """
        processed = ProcessedOutputs()
        # A parent's RequestOutput is built once all its children of this step are in.
        slots: list[RequestOutput | tuple[ParentRequest, str | None]] = []
        parents_seen: set[str] = set()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None or state.update_silently(output):
                continue
            finish_reason, stop_reason, hit_stop_string = state.update(output)
            if hit_stop_string and not output.finished:
                processed.reqs_to_abort.append(state.request_id)
            completion = state.make_completion_output(finish_reason, stop_reason)
            parent = state.parent
            if completion is not None and parent is None:
                slots.append(state.make_request_output(completion))
            elif completion is not None:
                parent.num_cached_tokens = max(parent.num_cached_tokens, state.num_cached_tokens)
                parent.add_child_output(completion)
                if parent.request_id not in parents_seen:
                    parents_seen.add(parent.request_id)
                    slots.append((parent, state.prompt))
            if finish_reason is not None:
                self._forget(state)
        for slot in slots:
            if isinstance(slot, RequestOutput):
                processed.request_outputs.append(slot)
                continue
            parent_output = slot[0].make_request_output(slot[1])
            if parent_output is not None:
                processed.request_outputs.append(parent_output)
        return processed

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Stop tracking ``request_ids`` (user or child ids); return the engine ids to abort.

        A parent id expands to its children. Ids not tracked are returned as
        they are, so aborting them in the engine is harmless.
        """
        engine_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            if parent is None:
                engine_ids.append(request_id)
                state = self.request_states.get(request_id)
                if state is not None:
                    if state.parent is not None:
                        state.parent.drop_child(state.index)
                    self._forget(state)
                continue
            for child_id in parent.child_ids:
                engine_ids.append(child_id)
                state = self.request_states.get(child_id)
                if state is not None:
                    parent.drop_child(state.index)
                    self._forget(state)
            self.parent_requests.pop(request_id, None)
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """Unfinished engine requests (each child of an ``n > 1`` request counts)."""
        return len(self.request_states)

    def _forget(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
        parent = state.parent
        if parent is not None and parent.finished:
            self.parent_requests.pop(parent.request_id, None)
