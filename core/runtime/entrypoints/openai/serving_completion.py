"""``POST /v1/completions``: one or more prompts, n completions each, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi.responses import JSONResponse, StreamingResponse

from runtime.entrypoints.openai.errors import from_exception
from runtime.entrypoints.openai.protocol import CompletionRequest
from runtime.entrypoints.openai.responses import (
    SSE_DONE,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
    sse_event,
)
from runtime.entrypoints.openai.serving_engine import OpenAIServing, clamp_logprob, merge_streams, prepend, top_entries
from runtime.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest):
        model = self.check_model(request.model)
        request.check_supported()
        params = request.to_sampling_params()
        prompts = request.prompts()
        request_id = self.new_request_id("cmpl")
        started = await self.start_all(prompts, params, request_id, request.priority)
        streams = [prepend(first, rest) for first, rest in started]
        if request.stream:
            body = self._stream(request, model, request_id, streams)
            return StreamingResponse(body, media_type="text/event-stream")
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in merge_streams(streams):
            finals[index] = output
        return JSONResponse(self._response(request, model, request_id, finals).model_dump())

    # ---------------------------------------------------------------- unary
    def _response(
        self, request: CompletionRequest, model: str, request_id: str, finals: list[RequestOutput | None]
    ) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        num_prompt = num_generated = 0
        for prompt_index, final in enumerate(finals):
            assert final is not None and final.finished, "a completion stream ended unfinished"
            num_prompt += len(final.prompt_token_ids or ())
            for output in final.outputs:
                num_generated += len(output.token_ids)
                choices.append(self._choice(request, prompt_index, final, output))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=UsageInfo.of(num_prompt, num_generated))

    def _choice(
        self, request: CompletionRequest, prompt_index: int, final: RequestOutput, output: CompletionOutput
    ) -> CompletionChoice:
        text, logprobs = output.text, None
        prefix = self._prompt_text(final) if request.echo else ""
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            if request.echo:
                self._add_logprobs(logprobs, final.prompt_token_ids, final.prompt_logprobs, request.logprobs, 0)
            self._add_logprobs(logprobs, output.token_ids, output.logprobs, request.logprobs, len(prefix))
        return CompletionChoice(
            index=prompt_index * request.n + output.index,
            text=prefix + text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(output.prompt_token_ids or [])

    def _add_logprobs(self, out: CompletionLogprobs, token_ids, positions, num_top: int, offset: int) -> int:
        """Append tokens, logprobs and text offsets (from ``offset``); return the offset after them."""
        token_ids = list(token_ids or ())
        positions = list(positions or ())
        positions += [None] * (len(token_ids) - len(positions))
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position else None
            token = self.token_text(token_id, chosen)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if position is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            top = top_entries(position, num_top)
            out.top_logprobs.append({self.token_text(t, lp): clamp_logprob(lp.logprob) for t, lp in top})
        return offset

    # -------------------------------------------------------------- streaming
    async def _stream(
        self, request: CompletionRequest, model: str, request_id: str, streams: list[AsyncGenerator]
    ) -> AsyncGenerator[str, None]:
        num_prompt = num_generated = 0
        offsets: dict[int, int] = {}  # choice index -> text offset so far (for logprobs)
        merged = merge_streams(streams)
        try:
            async for prompt_index, output in merged:
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    first = index not in offsets
                    if first and completion.index == 0:
                        num_prompt += len(output.prompt_token_ids or ())
                    num_generated += len(completion.token_ids)
                    choice = self._stream_choice(request, output, completion, index, first, offsets)
                    if choice is None:
                        continue
                    chunk = CompletionResponse(id=request_id, model=model, choices=[choice])
                    if request.stream_options and request.stream_options.continuous_usage_stats:
                        chunk.usage = UsageInfo.of(num_prompt, num_generated)
                    yield sse_event(chunk, include_usage=chunk.usage is not None)
            if request.include_usage:
                final = CompletionResponse(id=request_id, model=model, choices=[], usage=UsageInfo.of(num_prompt, num_generated))
                yield sse_event(final)
        except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
            yield sse_event(from_exception(exc).body())
        finally:
            await merged.aclose()
        yield SSE_DONE

    def _stream_choice(
        self, request: CompletionRequest, output: RequestOutput, completion: CompletionOutput,
        index: int, first: bool, offsets: dict[int, int],
    ) -> CompletionChoice | None:
        text = completion.text
        logprobs = None
        offset = offsets.get(index, 0)
        if first and request.echo:
            prefix = self._prompt_text(output)
            if request.logprobs is not None:
                logprobs = CompletionLogprobs()
                self._add_logprobs(logprobs, output.prompt_token_ids, output.prompt_logprobs, request.logprobs, 0)
            text = prefix + text
            offset = len(prefix)
        if request.logprobs is not None and completion.token_ids:
            logprobs = logprobs or CompletionLogprobs()
            self._add_logprobs(logprobs, completion.token_ids, completion.logprobs, request.logprobs, offset)
        offsets[index] = offset + len(completion.text)
        if not text and logprobs is None and completion.finish_reason is None:
            return None
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        )
