"""``POST /v1/chat/completions``: apply the chat template, then generate n replies, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi.responses import JSONResponse, StreamingResponse

from runtime.entrypoints.openai.errors import from_exception, param_of
from runtime.entrypoints.openai.prompt_inputs import checked_input
from runtime.entrypoints.openai.protocol import ChatCompletionRequest, InvalidField
from runtime.entrypoints.openai.reasoning import Reasoning, ReasoningParser
from runtime.entrypoints.openai.reasoning.grammar_start import prompt_block, reasoning_tags
from runtime.entrypoints.openai.reasoning.think_tags import ThinkTagReasoningParser
from runtime.entrypoints.openai.reasoning_tokens import ReasoningTokenCounter, count_reasoning_tokens
from runtime.entrypoints.openai.responses import (
    SSE_DONE,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    StreamChunks,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    sse_event,
)
from runtime.entrypoints.openai.serving_engine import (
    OpenAIServing,
    add_kv_transfer_fields,
    clamp_logprob,
    prepend,
    structured_output_error,
    top_entries,
)
from runtime.entrypoints.openai.tool_parsers import ToolCallDelta, ToolParser, tool_parser_names
from runtime.entrypoints.openai.tool_parsers.constrained import NamedToolCalls, RequiredToolCalls
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import ReasoningTags, SamplingParams


class OpenAIServingChat(OpenAIServing):
    logprobs_field = "top_logprobs"

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request=None):
        """``raw_request``: the HTTP request (its X-Request-Id names the completion), None where there is none."""
        model = self.check_model(request.model)
        request.check_supported()
        self._check_tool_choice(request)
        params = request.to_sampling_params(self.default_max_tokens())
        self.ctx.limits.check_n(request.n)
        prompt = await asyncio.to_thread(self._checked_prompt, request, params)  # templating and tokenizing
        if params.structured_outputs is not None:  # with --reasoning-parser the grammar starts after the reasoning
            params.structured_outputs.reasoning = self.grammar_reasoning_tags(prompt["prompt_token_ids"])
        request_id, engine_request_id = self.request_ids("chatcmpl", raw_request, request.request_id)
        try:
            first, rest = await self.start(prompt, params, engine_request_id, request.priority)
        except ValueError as exc:
            raise structured_output_error(exc, params, request.structured_output_param()) from None
        stream = prepend(first, rest)
        if request.stream:
            num_prompt = len(first.prompt_token_ids or ()) if first is not None else 0
            body = self._stream(request, model, request_id, stream, num_prompt, prompt["prompt_token_ids"])
            return StreamingResponse(body, media_type="text/event-stream")
        final = None
        async for output in stream:
            final = output
        # Built and encoded in a worker thread: with n choices of logprobs it can be megabytes.
        return await asyncio.to_thread(self._json_response, request, model, request_id, final)

    def _json_response(self, request: ChatCompletionRequest, model: str, request_id: str, final) -> JSONResponse:
        body = self._response(request, model, request_id, final).model_dump()
        if self.ctx.reasoning_parser is None:  # the field comes with --reasoning-parser only, as before it
            for choice in body["choices"]:
                del choice["message"]["reasoning_content"], choice["message"]["reasoning"]
        if request.prompt_logprobs is not None:  # vLLM's
            body["prompt_logprobs"] = self.prompt_logprobs_field(final.prompt_logprobs)
        if request.return_token_ids:  # vLLM's: the prompt's ids, and each choice's
            body["prompt_token_ids"] = final.prompt_token_ids
            token_ids = {output.index: output.token_ids for output in final.outputs}
            for choice in body["choices"]:
                choice["token_ids"] = token_ids[choice["index"]]
        if request.kv_transfer_params is not None:
            add_kv_transfer_fields(body, final)
        return JSONResponse(body)

    def _check_tool_choice(self, request: ChatCompletionRequest) -> None:
        if request.tool_mode == "auto" and request.tools and self.ctx.tool_parser is None:
            what = "tools without tool_choice (which means \"auto\")" if request.tool_choice is None else 'tool_choice "auto"'
            raise InvalidField(
                "tool_choice",
                f"{what} needs the server started with --enable-auto-tool-choice --tool-call-parser NAME "
                f"(parsers: {', '.join(tool_parser_names())}); or set tool_choice to \"none\", \"required\" "
                "or a named function",
            )

    def tool_call_reader(self, request: ChatCompletionRequest) -> ToolParser | None:
        """A fresh reader of one choice's tool calls, or None when the request's output has none."""
        mode = request.tool_mode
        if not request.tools or mode == "none":
            return None
        if mode == "named":
            return NamedToolCalls(request.named_tool().function.name)
        if mode == "required":
            return RequiredToolCalls()
        return self.ctx.tool_parser(self.tokenizer)

    def reasoning_reader(self, request: ChatCompletionRequest, prompt_token_ids=None) -> ReasoningParser | None:
        """A fresh reader of one choice's reasoning, or None without ``--reasoning-parser``. A grammar (structured
        output, tool_choice "required" or named) starts after the reasoning, as vLLM's does, where the engine can
        tell its end (:meth:`grammar_reasoning_tags`); else it constrains the output from its first token, and
        such an output holds reasoning only where it writes the start tag itself."""
        if self.ctx.reasoning_parser is None:
            return None
        explicit_only = request.structured_output_field() is not None and (
            self.grammar_reasoning_tags(prompt_token_ids or []) is None)
        parser = self.ctx.reasoning_parser
        if issubclass(parser, ThinkTagReasoningParser) and prompt_token_ids:  # the prompt may have opened or closed it
            return parser(self.tokenizer, explicit_only=explicit_only,
                          prompt=prompt_block(self.tokenizer, list(prompt_token_ids)))
        return parser(self.tokenizer, explicit_only=explicit_only)

    def grammar_reasoning_tags(self, prompt_token_ids: list[int]) -> ReasoningTags | None:
        """The reasoning block a constrained output after ``prompt_token_ids`` starts with, left free by its grammar."""
        if self.ctx.reasoning_parser is None:
            return None
        return reasoning_tags(self.ctx.reasoning_parser, self.tokenizer, prompt_token_ids)

    def reasoning_counters(self, request: ChatCompletionRequest, prompt_token_ids=None) -> dict[int, ReasoningTokenCounter]:
        """Per choice, the counter of its reasoning tokens for a streamed usage; none without ``--reasoning-parser``
        or where the stream has no usage."""
        if self.ctx.reasoning_parser is None or not request.include_usage:
            return {}
        return {index: ReasoningTokenCounter(self.reasoning_reader(request, prompt_token_ids), self.tokenizer,
                                             request.skip_special_tokens, request.spaces_between_special_tokens)
                for index in range(request.n)}

    def render_prompt(self, request: ChatCompletionRequest) -> dict:
        """The templated conversation as ``{"prompt_token_ids", "prompt"}`` (no second BOS)."""
        messages = [m.to_template_dict() for m in request.messages]
        processor = self.engine.input_processor
        for message in messages:  # before templating: a text too long to fit is refused unread
            processor.check_text(message["content"], "messages")
        kwargs = dict(request.chat_template_kwargs or {})
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
        if request.tools:
            kwargs["tools"] = [tool.model_dump(by_alias=True, exclude_none=True) for tool in request.tools]
        try:
            text = processor.apply_chat_template(messages, request.add_generation_prompt, **kwargs)
        except ValueError:
            raise
        except Exception as exc:  # jinja errors: a conversation the template rejects
            raise ValueError(f"messages could not be rendered by the chat template: {exc}") from None
        ids = processor.encode(text, add_special_tokens=False, field="messages")
        return {"prompt_token_ids": ids, "prompt": text}

    def _checked_prompt(self, request: ChatCompletionRequest, params: SamplingParams) -> dict:
        prompt = self.render_prompt(request)
        try:
            return checked_input(self.engine.input_processor, prompt["prompt_token_ids"], prompt["prompt"], params,
                                 request.max_tokens_param() if request.asks_max_tokens() else None)
        except ValueError as exc:  # a chat request has no prompt field: the templated messages are its prompt
            if getattr(exc, "param", None) is None and param_of(str(exc)) == "prompt":
                raise InvalidField("messages", f"messages (as the chat template renders them): {exc}") from None
            raise

    # ---------------------------------------------------------------- unary
    def _response(
        self, request: ChatCompletionRequest, model: str, request_id: str, final: RequestOutput | None
    ) -> ChatCompletionResponse:
        assert final is not None and final.finished, "a chat stream ended unfinished"
        choices = []
        role = request.reply_role(self.ctx.response_role)
        echoed = request.echoed_text(self.ctx.response_role)
        num_reasoning = None if self.ctx.reasoning_parser is None else 0
        for output in final.outputs:
            splitter = self.reasoning_reader(request, final.prompt_token_ids)
            reasoning, text = (None, output.text) if splitter is None else splitter.extract_reasoning(output.text)
            if splitter is not None:
                num_reasoning += count_reasoning_tokens(splitter, self.tokenizer, output.token_ids, request)
            reasoning = reasoning if request.include_reasoning else None
            content = echoed + (text or "") if echoed or splitter is None else text
            message = ChatMessageOut(role=role, content=content, reasoning_content=reasoning)
            finish_reason = output.finish_reason
            reader = self.tool_call_reader(request)
            if reader is not None:  # tool calls are read in the content only, not in the reasoning
                content, calls = reader.extract_tool_calls(text or "")
                if request.parallel_tool_calls is False:  # OpenAI's: then a message has at most one call
                    calls = calls[:1]
                tool_calls = [
                    ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
                    for call in calls
                ]
                content = echoed + (content or "") if echoed else content
                message = ChatMessageOut(role=role, content=content, reasoning_content=reasoning, tool_calls=tool_calls)
                finish_reason = _finish_reason(request, finish_reason, bool(calls))
            choices.append(ChatChoice(
                index=output.index,
                message=message,
                logprobs=self._logprobs(request, output),
                finish_reason=finish_reason,
                stop_reason=output.stop_reason,
            ))
        num_generated = sum(len(o.token_ids) for o in final.outputs)
        usage = UsageInfo.of(len(final.prompt_token_ids or ()), num_generated, self.cached_tokens([final]), num_reasoning)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def _logprobs(self, request: ChatCompletionRequest, output: CompletionOutput) -> ChatChoiceLogprobs | None:
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0
        content = []
        positions = list(output.logprobs or ())
        as_ids = self.tokens_as_ids(request)
        for token_id, position in zip(output.token_ids, positions):
            chosen = position.get(token_id)
            token = self.token_text(token_id, chosen, as_ids)
            top = [self._top(t, lp, as_ids) for t, lp in top_entries(position, num_top)]
            logprob = clamp_logprob(chosen.logprob) if chosen else -9999.0
            content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=self.token_bytes(token_id, token, as_ids),
                                            top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def _top(self, token_id: int, logprob, as_id: bool = False) -> TopLogprob:
        token = self.token_text(token_id, logprob, as_id)
        return TopLogprob(token=token, logprob=clamp_logprob(logprob.logprob), bytes=self.token_bytes(token_id, token, as_id))

    # -------------------------------------------------------------- streaming
    async def _stream(
        self, request: ChatCompletionRequest, model: str, request_id: str, stream: AsyncGenerator[RequestOutput, None],
        num_prompt: int = 0, prompt_token_ids: list[int] | None = None,
    ) -> AsyncGenerator[str, None]:
        num_generated = 0
        continuous = request.continuous_usage
        counters = self.reasoning_counters(request, prompt_token_ids)
        no_reasoning = 0 if counters else None  # the reasoning tokens of chunks before any token
        last = None  # the latest output (its prefix-cache hits)
        readers = {index: self.tool_call_reader(request) for index in range(request.n)}
        splitters = {index: self.reasoning_reader(request, prompt_token_ids) for index in range(request.n)}
        chunks = StreamChunks(request_id, model, "chat.completion.chunk")
        # vLLM's return_token_ids: the prompt's ids come with the first chunk of each choice
        first_fields = {"prompt_token_ids": list(prompt_token_ids or ())} if request.return_token_ids else {}
        try:
            role = request.reply_role(self.ctx.response_role)
            for index in range(request.n):
                opening = ChatStreamChoice(index=index, delta=DeltaMessage(role=role, content=""))
                usage = UsageInfo.of(num_prompt, 0, reasoning_tokens=no_reasoning) if continuous else None
                yield chunks.event([self._dump(opening)], usage, **first_fields)
            echoed = request.echoed_text(self.ctx.response_role)
            for index in range(request.n if echoed else 0):
                echo = ChatStreamChoice(index=index, delta=DeltaMessage(content=echoed))
                yield chunks.event([self._dump(echo)], UsageInfo.of(num_prompt, 0, reasoning_tokens=no_reasoning)
                                   if continuous else None)
            generated = dict.fromkeys(range(request.n), 0)  # per choice: continuous usage is per choice, as vLLM's
            async for output in stream:
                num_prompt, last = len(output.prompt_token_ids or ()), output
                for completion in output.outputs:
                    num_generated += len(completion.token_ids)
                    generated[completion.index] = generated.get(completion.index, 0) + len(completion.token_ids)
                    counter = counters.get(completion.index)
                    if counter is not None:
                        counter.add(completion.token_ids)
                    choice = self._stream_choice(request, completion, readers.get(completion.index),
                                                 splitters.get(completion.index))
                    if choice is not None:
                        usage = None
                        if continuous:
                            num_reasoning = None if counter is None else counter.count(completion.finish_reason is not None)
                            usage = UsageInfo.of(num_prompt, generated[completion.index], reasoning_tokens=num_reasoning)
                        yield chunks.event([choice], usage)
            if request.include_usage:
                num_reasoning = sum(c.count(finished=True) for c in counters.values()) if counters else None
                cached = self.cached_tokens([last])
                yield chunks.event([], UsageInfo.of(num_prompt, num_generated, cached, num_reasoning))
        except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
            yield sse_event(from_exception(exc).body())
        finally:
            await stream.aclose()
        yield SSE_DONE

    def _dump(self, choice: ChatStreamChoice) -> dict:
        """``choice`` as a dict, its delta without reasoning_content / reasoning where the server has no
        --reasoning-parser."""
        body = choice.model_dump()
        if self.ctx.reasoning_parser is None:
            del body["delta"]["reasoning_content"], body["delta"]["reasoning"]
        return body

    def _stream_choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput, reader: ToolParser | None = None,
        splitter: ReasoningParser | None = None,
    ) -> dict | None:
        """The streamed choice (a dict as ``ChatStreamChoice`` dumps, with vLLM's ``token_ids`` where the request
        asks for them) of one new output; None for nothing new."""
        has_ids = request.return_token_ids and bool(completion.token_ids)  # ids without text are still sent
        text, reasoning = completion.text, None
        if splitter is not None:
            reasoning, text = _split_streamed(splitter, completion)
            reasoning = reasoning if request.include_reasoning else None
        if reader is None and not request.logprobs:  # the common case, without building models
            if not text and not reasoning and completion.finish_reason is None and not has_ids:
                return None
            delta = {"role": None, "content": text or None, "tool_calls": None}
            if splitter is not None:
                delta = {"role": None, "content": text or None, "reasoning_content": reasoning, "reasoning": reasoning,
                         "tool_calls": None}
            choice = {
                "index": completion.index, "delta": delta,
                "logprobs": None, "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            }
            if request.return_token_ids:
                choice["token_ids"] = completion.token_ids
            return choice
        logprobs = self._logprobs(request, completion) if completion.token_ids else None
        content, tool_calls, finish_reason = text, None, completion.finish_reason
        if reader is not None:  # tool calls are read in the content only, not in the reasoning
            content, deltas = reader.extract_tool_calls_streaming(text or "")
            if finish_reason is not None:
                tail, last = reader.finish()
                content = (content or "") + (tail or "") or None
                deltas = deltas + last
                finish_reason = _finish_reason(request, finish_reason, reader.num_streamed_calls > 0)
            if request.parallel_tool_calls is False:  # only the first call, as the unary response keeps
                deltas = [d for d in deltas if d.index == 0]
            tool_calls = [_delta_tool_call(d) for d in deltas] or None
        if not content and not reasoning and tool_calls is None and logprobs is None and finish_reason is None \
                and not has_ids:
            return None
        if content or tool_calls or logprobs or reasoning:
            content = content or None if reader is not None or splitter is not None else content
            delta = DeltaMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls)
        else:
            delta = DeltaMessage()
        choice = self._dump(ChatStreamChoice(
            index=completion.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason,
        ))
        if request.return_token_ids:
            choice["token_ids"] = completion.token_ids
        return choice


def _finish_reason(request: ChatCompletionRequest, finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended normally with calls the model chose to make (tool_choice
    "auto" or "required"); a named tool_choice ends with "stop", as OpenAI's API and vLLM answer."""
    return "tool_calls" if called and finish_reason == "stop" and request.named_tool() is None else finish_reason


def _split_streamed(splitter: ReasoningParser, completion: CompletionOutput) -> Reasoning:
    """The reasoning and content of a choice's new text; at its end, with what the splitter held back."""
    reasoning, content = splitter.extract_reasoning_streaming(completion.text)
    if completion.finish_reason is None:
        return Reasoning(reasoning, content)
    tail = splitter.finish()
    return Reasoning((reasoning or "") + (tail.reasoning or "") or None, (content or "") + (tail.content or "") or None)


def _delta_tool_call(delta: ToolCallDelta) -> DeltaToolCall:
    function = DeltaFunctionCall(name=delta.name, arguments=delta.arguments)
    return DeltaToolCall(
        index=delta.index, id=delta.id, type="function" if delta.id is not None else None, function=function,
    )
