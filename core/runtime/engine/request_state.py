"""What the front end keeps per engine request while it runs: text, ids, logprobs."""

from __future__ import annotations

from runtime.engine.detokenizer import BaseDetokenizer, NoopDetokenizer, make_detokenizer
from runtime.engine.logprobs import TokenTexts, convert_logprobs
from runtime.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from runtime.engine.parent_request import ParentRequest
from runtime.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from runtime.sampling_params import RequestOutputKind


class RequestState:
    """One engine request (a child when ``n > 1``) as seen by the OutputProcessor."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer,
        token_texts: TokenTexts | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        stream_interval: int = 1,
    ):
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.parent = parent
        self.index = index
        self.output_kind = params.output_kind
        self.detokenizer: BaseDetokenizer = make_detokenizer(tokenizer, request.prompt_token_ids, params)
        self.token_texts = token_texts if params.detokenize else None
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None
        self.stream_interval = stream_interval  # a DELTA output waits for this many new tokens
        self._num_sent_tokens = 0
        self._prompt_logprobs_sent = False
        # FINAL_ONLY without text: until the last step, an output only adds token ids.
        self.is_ids_only_final = self.output_kind == RequestOutputKind.FINAL_ONLY and isinstance(
            self.detokenizer, NoopDetokenizer
        )

    def update_silently(self, output: EngineCoreOutput) -> bool:
        """Take in an output that yields no RequestOutput and needs no text or logprobs.

        Returns False, changing nothing, when ``output`` needs ``update`` and
        ``make_completion_output`` (the last output, logprobs, text to build).
        """
        if (
            not self.is_ids_only_final
            or output.finish_reason is not None
            or output.new_logprobs is not None
            or output.new_prompt_logprobs is not None
        ):
            return False
        if output.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        self.detokenizer.update(output.new_token_ids, False)
        return True

    def update(self, output: EngineCoreOutput) -> tuple[FinishReason | None, int | str | None, bool]:
        """Take in one step's output; return ``(finish_reason, stop_reason, hit_stop_string)``."""
        if output.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        if output.new_prompt_logprobs is not None:
            self._add_prompt_logprobs(output)
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        num_before = self.detokenizer.num_output_tokens
        # A request its grammar completed ends on a text token; EOS and stop ids stay out of the text.
        stop_terminated = finish_reason == FinishReason.STOP and not output.ended_by_grammar
        stop_str = self.detokenizer.update(output.new_token_ids, stop_terminated)
        if stop_str is None and finish_reason is not None:
            stop_str = self.detokenizer.flush()
        if output.new_logprobs is not None and self.logprobs is not None:
            num_kept = self.detokenizer.num_output_tokens - num_before
            rows = convert_logprobs(output.new_logprobs, num_kept, self.token_texts)
            self.logprobs.extend(rows)
            # The chosen token is each row's first entry.
            self.cumulative_logprob += sum(next(iter(row.values())).logprob for row in rows)
        if stop_str is not None:
            return FinishReason.STOP, stop_str, True
        return finish_reason, stop_reason, False

    def _add_prompt_logprobs(self, output: EngineCoreOutput) -> None:
        rows = convert_logprobs(output.new_prompt_logprobs, None, self.token_texts)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.prompt_logprobs.extend(rows)
        if self.parent is not None and self.parent.prompt_logprobs is None:
            self.parent.prompt_logprobs = self.prompt_logprobs

    def make_completion_output(
        self, finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> CompletionOutput | None:
        """This step's completion for the request, honouring ``output_kind``; None for nothing to send."""
        finished = finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        token_ids = self.detokenizer.output_token_ids
        if delta and not finished and self._waits_for_interval(len(token_ids)):
            return None
        text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = self.logprobs
        if delta:
            start, self._num_sent_tokens = self._num_sent_tokens, len(token_ids)
            token_ids = token_ids[start:]
            logprobs = logprobs[start:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=FinishReason(finish_reason).value if finished else None,
            stop_reason=stop_reason if finished else None,
        )

    def _waits_for_interval(self, num_tokens: int) -> bool:
        """Whether a streamed output holds back: fewer than ``stream_interval`` new tokens since the last
        one sent (the first token goes at once, for the time to first token)."""
        return self.stream_interval > 1 and 0 < self._num_sent_tokens > num_tokens - self.stream_interval

    def make_request_output(self, completion: CompletionOutput) -> RequestOutput:
        """The output of a request without a parent."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(),
            outputs=[completion],
            finished=completion.finished(),
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
