"""``POST /v1/completions``: one or more prompts, n completions each, streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

from fastapi.responses import JSONResponse, StreamingResponse

from runtime.entrypoints.openai.errors import from_exception
from runtime.entrypoints.openai.prompt_inputs import tokenize_prompts
from runtime.entrypoints.openai.protocol import CompletionRequest
from runtime.entrypoints.openai.responses import (
    SSE_DONE,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    StreamChunks,
    UsageInfo,
    sse_event,
)
from runtime.entrypoints.openai.serving_engine import (
    OpenAIServing,
    add_kv_transfer_fields,
    clamp_logprob,
    merge_streams,
    prepend,
    structured_output_error,
    top_entries,
)
from runtime.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request=None):
        """``raw_request``: the HTTP request (its X-Request-Id names the completion), None where there is none."""
        model = self.check_model(request.model)
        request.check_supported()
        params = request.to_sampling_params(self.default_max_tokens())
        prompts = request.prompts()
        self.ctx.limits.check_n(request.n, len(prompts))
        max_tokens_param = "max_tokens" if request.asks_max_tokens() else None
        inputs = await asyncio.to_thread(tokenize_prompts, self.engine.input_processor, prompts, params, max_tokens_param)
        request_id, engine_request_id = self.request_ids("cmpl", raw_request, request.request_id)
        try:
            started = await self.start_all(inputs, params, engine_request_id, request.priority)
        except ValueError as exc:
            raise structured_output_error(exc, params, request.structured_output_param()) from None
        streams = [prepend(first, rest) for first, rest in started]
        if request.stream:
            body = self._stream(request, model, request_id, streams)
            return StreamingResponse(body, media_type="text/event-stream")
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in merge_streams(streams):
            finals[index] = output
        # Built and encoded in a worker thread: with n choices of logprobs it can be megabytes.
        return await asyncio.to_thread(self._json_response, request, model, request_id, finals)

    def _json_response(self, request: CompletionRequest, model: str, request_id: str, finals) -> JSONResponse:
        body = self._response(request, model, request_id, finals).model_dump()
        if request.prompt_logprobs is not None:  # vLLM's: each choice carries its prompt's logprobs
            fields = [self.prompt_logprobs_field(final.prompt_logprobs) for final in finals]
            for choice in body["choices"]:
                choice["prompt_logprobs"] = fields[choice["index"] // request.n]
        if request.return_token_ids:  # vLLM's extension: the ids of each prompt and choice
            for choice in body["choices"]:
                final = finals[choice["index"] // request.n]
                output = returned(request, next(o for o in final.outputs if o.index == choice["index"] % request.n))
                choice["prompt_token_ids"], choice["token_ids"] = final.prompt_token_ids, output.token_ids
        if request.kv_transfer_params is not None:
            add_kv_transfer_fields(body, finals[0])
        return JSONResponse(body)

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
                output = returned(request, output)
                num_generated += len(output.token_ids)
                choices.append(self._choice(request, prompt_index, final, output))
        choices.sort(key=lambda c: c.index)
        usage = UsageInfo.of(num_prompt, num_generated, self.cached_tokens(finals))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def _choice(
        self, request: CompletionRequest, prompt_index: int, final: RequestOutput, output: CompletionOutput
    ) -> CompletionChoice:
        text, logprobs = output.text, None
        prefix = self._prompt_text(final) if request.echo else ""
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            tokens_end = 0  # see _stream_choice: offsets never go backwards
            if request.echo:
                tokens_end = self._add_logprobs(logprobs, request, final.prompt_token_ids, final.prompt_logprobs, 0)
            self._add_logprobs(logprobs, request, output.token_ids, output.logprobs, max(len(prefix), tokens_end))
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

    def _add_logprobs(self, out: CompletionLogprobs, request: CompletionRequest, token_ids, positions, offset: int) -> int:
        """Append tokens (``token_id:N`` where the request or the server asks), ``request.logprobs`` top entries and
        text offsets (from ``offset``); return the offset after them."""
        num_top, as_ids = request.logprobs, self.tokens_as_ids(request)
        token_ids = list(token_ids or ())
        positions = list(positions or ())
        positions += [None] * (len(token_ids) - len(positions))
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position else None
            token = self.token_text(token_id, chosen, as_ids)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if position is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            top = top_entries(position, num_top)
            if chosen is not None and all(t != token_id for t, _ in top):
                top.append((token_id, chosen))  # OpenAI's (and vLLM's): the chosen token too, up to logprobs + 1
            out.top_logprobs.append({self.token_text(t, lp, as_ids): clamp_logprob(lp.logprob) for t, lp in top})
        return offset

    # -------------------------------------------------------------- streaming
    async def _stream(
        self, request: CompletionRequest, model: str, request_id: str, streams: list[AsyncGenerator]
    ) -> AsyncGenerator[str, None]:
        num_prompt = num_generated = 0
        offsets: dict[int, int] = {}  # choice index -> text offset so far (for logprobs)
        generated: dict[int, int] = {}  # choice index -> its tokens so far (continuous usage is per choice, as vLLM's)
        lasts: dict[int, RequestOutput] = {}  # prompt index -> its latest output (for its prefix-cache hits)
        chunks = StreamChunks(request_id, model, "text_completion")
        continuous = request.continuous_usage
        merged = merge_streams(streams)
        try:
            async for prompt_index, output in merged:
                lasts[prompt_index] = output
                for completion in output.outputs:
                    completion = returned(request, completion)
                    index = prompt_index * request.n + completion.index
                    first = index not in offsets
                    if first and completion.index == 0:
                        num_prompt += len(output.prompt_token_ids or ())
                    num_generated += len(completion.token_ids)
                    generated[index] = generated.get(index, 0) + len(completion.token_ids)
                    choice = self._stream_choice(request, output, completion, index, first, offsets)
                    if choice is not None:
                        usage = UsageInfo.of(len(output.prompt_token_ids or ()), generated[index]) if continuous else None
                        yield chunks.event([choice], usage)
            if request.include_usage:
                yield chunks.event([], UsageInfo.of(num_prompt, num_generated, self.cached_tokens(lasts.values())))
        except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
            yield sse_event(from_exception(exc).body())
        finally:
            await merged.aclose()
        yield SSE_DONE

    def _stream_choice(
        self, request: CompletionRequest, output: RequestOutput, completion: CompletionOutput,
        index: int, first: bool, offsets: dict[int, int],
    ) -> dict | None:
        """The streamed choice (a dict as ``CompletionChoice`` dumps) of one new output; None for nothing new."""
        text = completion.text
        logprobs = None
        # Offsets are positions in the text, except that tokens holding part of a character each show a
        # replacement character, and so may count more than the text does: offsets never go backwards.
        offset = offsets.get(index, 0)
        tokens_end = offset
        if first and request.echo:
            prefix = self._prompt_text(output)
            if request.logprobs is not None:
                logprobs = CompletionLogprobs()
                tokens_end = self._add_logprobs(logprobs, request, output.prompt_token_ids, output.prompt_logprobs, 0)
            text = prefix + text
            offset = max(len(prefix), tokens_end)
        if request.logprobs is not None and completion.token_ids:
            logprobs = logprobs or CompletionLogprobs()
            tokens_end = self._add_logprobs(logprobs, request, completion.token_ids, completion.logprobs, offset)
        offsets[index] = max(offset + len(completion.text), tokens_end)
        has_ids = request.return_token_ids and (completion.token_ids or first)  # the first carries the prompt's
        if not text and logprobs is None and completion.finish_reason is None and not has_ids:
            return None
        choice = {
            "index": index, "text": text, "logprobs": logprobs.model_dump() if logprobs is not None else None,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
        }
        if request.return_token_ids:  # vLLM's: the prompt's ids in the first chunk of each choice, then only new ones
            if first:
                choice["prompt_token_ids"] = list(output.prompt_token_ids or ())
            choice["token_ids"] = completion.token_ids
        return choice


def returned(request: CompletionRequest, output: CompletionOutput) -> CompletionOutput:
    """``output`` as the response shows it: with ``echo`` and ``max_tokens`` 0 the token the engine had to sample is
    left out, and a finished output ends by "length" (as OpenAI's and vLLM's)."""
    if not request.echo_only:
        return output
    finish_reason = None if output.finish_reason is None else "length"
    return dataclasses.replace(output, text="", token_ids=[], logprobs=None, finish_reason=finish_reason, stop_reason=None)
