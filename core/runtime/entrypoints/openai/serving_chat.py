"""``POST /v1/chat/completions``: apply the chat template, then generate n replies, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi.responses import JSONResponse, StreamingResponse

from runtime.entrypoints.openai.errors import from_exception
from runtime.entrypoints.openai.protocol import ChatCompletionRequest
from runtime.entrypoints.openai.responses import (
    SSE_DONE,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    sse_event,
)
from runtime.entrypoints.openai.serving_engine import OpenAIServing, clamp_logprob, prepend, top_entries
from runtime.outputs import CompletionOutput, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest):
        model = self.check_model(request.model)
        request.check_supported()
        params = request.to_sampling_params()
        prompt = self.render_prompt(request)
        request_id = self.new_request_id("chatcmpl")
        first, rest = await self.start(prompt, params, request_id, request.priority)
        stream = prepend(first, rest)
        if request.stream:
            return StreamingResponse(self._stream(request, model, request_id, stream), media_type="text/event-stream")
        final = None
        async for output in stream:
            final = output
        return JSONResponse(self._response(request, model, request_id, final).model_dump())

    def render_prompt(self, request: ChatCompletionRequest) -> dict:
        """The templated conversation as ``{"prompt_token_ids", "prompt"}`` (no second BOS)."""
        messages = [m.to_template_dict() for m in request.messages]
        kwargs = dict(request.chat_template_kwargs or {})
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
        processor = self.engine.input_processor
        try:
            text = processor.apply_chat_template(messages, request.add_generation_prompt, **kwargs)
        except ValueError:
            raise
        except Exception as exc:  # jinja errors: a conversation the template rejects
            raise ValueError(f"messages could not be rendered by the chat template: {exc}") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt_token_ids": ids, "prompt": text}

    # ---------------------------------------------------------------- unary
    def _response(
        self, request: ChatCompletionRequest, model: str, request_id: str, final: RequestOutput | None
    ) -> ChatCompletionResponse:
        assert final is not None and final.finished, "a chat stream ended unfinished"
        choices = [
            ChatChoice(
                index=output.index,
                message=ChatMessageOut(content=output.text),
                logprobs=self._logprobs(request, output),
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
            for output in final.outputs
        ]
        num_generated = sum(len(o.token_ids) for o in final.outputs)
        usage = UsageInfo.of(len(final.prompt_token_ids or ()), num_generated)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def _logprobs(self, request: ChatCompletionRequest, output: CompletionOutput) -> ChatChoiceLogprobs | None:
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0
        content = []
        positions = list(output.logprobs or ())
        for token_id, position in zip(output.token_ids, positions):
            chosen = position.get(token_id)
            token = self.token_text(token_id, chosen)
            top = [self._top(t, lp) for t, lp in top_entries(position, num_top)]
            logprob = clamp_logprob(chosen.logprob) if chosen else -9999.0
            content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def _top(self, token_id: int, logprob) -> TopLogprob:
        token = self.token_text(token_id, logprob)
        return TopLogprob(token=token, logprob=clamp_logprob(logprob.logprob), bytes=list(token.encode()))

    # -------------------------------------------------------------- streaming
    async def _stream(
        self, request: ChatCompletionRequest, model: str, request_id: str, stream: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[str, None]:
        num_prompt = num_generated = 0
        continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)
        try:
            for index in range(request.n):
                role = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                yield sse_event(ChatCompletionChunk(id=request_id, model=model, choices=[role]), include_usage=False)
            async for output in stream:
                num_prompt = len(output.prompt_token_ids or ())
                for completion in output.outputs:
                    num_generated += len(completion.token_ids)
                    choice = self._stream_choice(request, completion)
                    if choice is None:
                        continue
                    chunk = ChatCompletionChunk(id=request_id, model=model, choices=[choice])
                    if continuous:
                        chunk.usage = UsageInfo.of(num_prompt, num_generated)
                    yield sse_event(chunk, include_usage=continuous)
            if request.include_usage:
                final = ChatCompletionChunk(id=request_id, model=model, choices=[], usage=UsageInfo.of(num_prompt, num_generated))
                yield sse_event(final)
        except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
            yield sse_event(from_exception(exc).body())
        finally:
            await stream.aclose()
        yield SSE_DONE

    def _stream_choice(self, request: ChatCompletionRequest, completion: CompletionOutput) -> ChatStreamChoice | None:
        logprobs = self._logprobs(request, completion) if completion.token_ids else None
        if not completion.text and logprobs is None and completion.finish_reason is None:
            return None
        return ChatStreamChoice(
            index=completion.index,
            delta=DeltaMessage(content=completion.text) if completion.text or logprobs else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
