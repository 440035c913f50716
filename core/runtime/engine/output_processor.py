"""OutputProcessor: EngineCore outputs (new token ids per request) -> RequestOutputs.

Runs in the front end (offline ``LLMEngine`` and the async server). Per
request it detokenizes incrementally, checks stop strings, converts logprobs
and builds vLLM-style ``RequestOutput``s; children of an ``n > 1`` request are
gathered under their parent's id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.engine.detokenizer import IncrementalDetokenizer, batch_decoder
from runtime.engine.logprobs import TokenTexts
from runtime.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, NewTokens
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

    ``tokenizer`` is None with ``skip_tokenizer_init``: texts stay "". A streamed (DELTA)
    request sends an output once ``stream_interval`` new tokens are in (the first and
    the last at once), vLLM's ``--stream-interval``.
    """

    def __init__(self, tokenizer=None, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # FINAL_ONLY requests without text: request id -> its output ids (the detokenizer's list),
        # all that a plain token changes until the request's last output.
        self._ids_only_final: dict[str, list[int]] = {}
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self._batch_decode = batch_decoder(tokenizer) if tokenizer is not None else None

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        """Track ``request``; a child of an ``n > 1`` request names its ``parent`` and ``index``."""
        if parent is not None and not 0 <= index < parent.n:
            raise ValueError(f"child index {index} out of range for parent {parent.request_id!r} with n={parent.n}")
        self.add_states(self.new_states([request], prompt, parent, index))

    def new_states(
        self, requests: list[EngineCoreRequest], prompt: str | None, parent: ParentRequest | None = None, first_index: int = 0
    ) -> list[RequestState]:
        """The states of one request's engine requests (its n children when ``parent``), not yet tracked.

        Reads only the tokenizer, so the server builds them in a worker thread; ``add_states`` tracks them.
        """
        return [
            RequestState(request, prompt, self.tokenizer, self._token_texts, parent, index, self.stream_interval)
            for index, request in enumerate(requests, first_index)
        ]

    def add_states(self, states: list[RequestState]) -> None:
        """Track ``states``; ValueError, tracking none of them, if an id is already running."""
        running = next((s.request_id for s in states if s.request_id in self.request_states), None)
        if running is not None:
            raise ValueError(f"request id {running!r} is already running; request ids must be unique")
        for state in states:
            self.request_states[state.request_id] = state
            if state.is_ids_only_final:
                self._ids_only_final[state.request_id] = state.detokenizer.output_token_ids
            if state.parent is not None:
                self.parent_requests[state.parent.request_id] = state.parent

    def process_outputs(self, outputs: list[EngineCoreOutput], new_tokens: NewTokens | None = None) -> ProcessedOutputs:
        """Update every request named in ``outputs`` and ``new_tokens`` (the step's plain one-token
        outputs, column by column) and return this step's RequestOutputs.

        Outputs for requests not tracked (finished or aborted before) are ignored.
        """
        processed = ProcessedOutputs()
        if self._batch_decode is not None and len(outputs) + (len(new_tokens.request_ids) if new_tokens else 0) > 1:
            self._predecode(outputs, new_tokens)
        # A parent's RequestOutput is built once all its children of this step are in.
        slots: list[RequestOutput | tuple[ParentRequest, str | None]] = []
        parents_seen: set[str] = set()
        states = self.request_states
        if new_tokens is not None:
            ids_only_final = self._ids_only_final
            for req_id, token in zip(new_tokens.request_ids, new_tokens.token_ids):
                output_ids = ids_only_final.get(req_id)
                if output_ids is not None:
                    output_ids.append(token)
                elif (state := states.get(req_id)) is not None:
                    self._process_one(state, EngineCoreOutput(req_id, [token]), processed, slots, parents_seen)
        for output in outputs:
            state = states.get(output.request_id)
            if state is not None and not state.update_silently(output):
                self._process_one(state, output, processed, slots, parents_seen)
        for slot in slots:
            if isinstance(slot, RequestOutput):
                processed.request_outputs.append(slot)
                continue
            parent_output = slot[0].make_request_output(slot[1])
            if parent_output is not None:
                processed.request_outputs.append(parent_output)
        return processed

    def _process_one(
        self, state: RequestState, output: EngineCoreOutput, processed: ProcessedOutputs, slots: list, parents_seen: set[str]
    ) -> None:
        """Take in an output that needs text, logprobs or a RequestOutput built (``slots``: see process_outputs)."""
        finish_reason, stop_reason, hit_stop_string = state.update(output)
        if hit_stop_string and not output.finished:
            processed.reqs_to_abort.append(state.request_id)
        completion = state.make_completion_output(finish_reason, stop_reason)
        parent = state.parent
        if completion is not None and parent is None:
            slots.append(state.make_request_output(completion))
        elif completion is not None:
            parent.num_cached_tokens = max(parent.num_cached_tokens, state.num_cached_tokens)
            if state.kv_transfer_params is not None:
                parent.kv_transfer_params = state.kv_transfer_params
            parent.add_child_output(completion)
            if parent.request_id not in parents_seen:
                parents_seen.add(parent.request_id)
                slots.append((parent, state.prompt))
        if finish_reason is not None:
            self._forget(state)

    def _predecode(self, outputs: list[EngineCoreOutput], new_tokens: NewTokens | None) -> None:
        """Decode the text windows of this step's new tokens (one per request) in one batch call per
        ``skip_special_tokens`` value, instead of two ``tokenizer.decode`` calls per request."""
        single = [
            (output.request_id, output.new_token_ids[0])
            for output in outputs
            # several tokens (spec decode) or maybe a stop token left out of the text: one by one
            if len(output.new_token_ids) == 1 and output.finish_reason != FinishReason.STOP
        ]
        if new_tokens is not None:
            single.extend(zip(new_tokens.request_ids, new_tokens.token_ids))
        groups: dict[bool, list[tuple[IncrementalDetokenizer, tuple[list[int], list[int]]]]] = {}
        for req_id, token in single:
            state = self.request_states.get(req_id)
            detokenizer = state.detokenizer if state is not None else None
            if isinstance(detokenizer, IncrementalDetokenizer) and detokenizer.can_batch_decode:
                windows = detokenizer.decode_windows(token)
                groups.setdefault(detokenizer.skip_special_tokens, []).append((detokenizer, windows))
        for skip_special_tokens, items in groups.items():
            texts = self._batch_decode([window for _, windows in items for window in windows], skip_special_tokens)
            for i, (detokenizer, _) in enumerate(items):
                detokenizer.set_predecoded(texts[2 * i], texts[2 * i + 1])

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
        self._ids_only_final.pop(state.request_id, None)
        parent = state.parent
        if parent is not None and parent.finished:
            self.parent_requests.pop(parent.request_id, None)
