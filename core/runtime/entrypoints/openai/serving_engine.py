"""What completions and chat serving share: model check, request ids, running prompts, logprobs."""

from __future__ import annotations

import asyncio
import re
import secrets
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from runtime.engine.input_processor import PromptType
from runtime.entrypoints.logprobs_limit import check_max_logprobs
from runtime.entrypoints.openai.errors import OpenAIError, param_of
from runtime.entrypoints.openai.limits import RequestLimits
from runtime.entrypoints.openai.protocol_sampling import StreamOptions
from runtime.entrypoints.openai.request_logger import RequestLogger
from runtime.outputs import Logprob, RequestOutput
from runtime.sampling_params import SamplingParams

_MIN_LOGPROB = -9999.0  # JSON has no -inf

# An X-Request-Id is used as the request's id (as vLLM) when it is 1 to 256 printable ASCII characters. vLLM takes
# any string; a longer or non-ASCII one is ignored here, as a malformed W3C traceparent is, so that log lines and
# echoed headers stay short and readable: the request gets an id of its own.
MAX_CLIENT_REQUEST_ID_LEN = 256
_CLIENT_REQUEST_ID = re.compile(rf"[\x20-\x7e]{{1,{MAX_CLIENT_REQUEST_ID_LEN}}}")


@dataclass
class ServingContext:
    """The running engine and the names it answers to."""

    engine: object  # AsyncLLM (or anything with generate/abort/tokenizer/input_processor/model_config)
    served_model_names: list[str]
    limits: RequestLimits = RequestLimits()  # --max-n, --max-choices-per-request
    request_logger: RequestLogger | None = None  # None: requests are not logged
    # --enable-auto-tool-choice with --tool-call-parser: the parser class reading tool_choice "auto"
    # outputs; None: "auto" is refused
    tool_parser: type | None = None
    # --reasoning-parser: the parser class splitting chat outputs into reasoning_content and content; None: no split
    reasoning_parser: type | None = None
    response_role: str = "assistant"  # --response-role: the role of the reply in chat responses
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: what a request that does not say gets
    # --enable-prompt-tokens-details: usage has prompt_tokens_details.cached_tokens (prefix-cache hits)
    enable_prompt_tokens_details: bool = False
    # --enable-force-include-usage: every stream ends with the usage chunk, include_usage asked for or not
    enable_force_include_usage: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class OpenAIServing:
    logprobs_field = "logprobs"  # the request field that becomes SamplingParams.logprobs, named in errors

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.engine = ctx.engine
        self._token_bytes = None  # TokenBytes of the tokenizer, made at the first logprobs asked for

    def tokens_as_ids(self, request) -> bool:
        """Whether ``request``'s logprobs name tokens as ``token_id:N``: its own field, else the server's flag."""
        asked = request.return_tokens_as_token_ids
        return self.ctx.return_tokens_as_token_ids if asked is None else asked

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> str:
        """The model name to answer with (the first served name, as vLLM); 404 for a name this server does not serve."""
        if name is None or name in self.ctx.served_model_names:
            return self.ctx.model_name
        raise model_not_found(name, self.ctx.served_model_names)

    def with_forced_usage(self, request):
        """``request`` with ``stream_options.include_usage`` on where the server has --enable-force-include-usage and
        the request streams; its ``continuous_usage_stats`` stays as it asked."""
        if not self.ctx.enable_force_include_usage or not request.stream or request.include_usage:
            return request
        options = request.stream_options
        forced = options.model_copy(update={"include_usage": True}) if options else StreamOptions(include_usage=True)
        return request.model_copy(update={"stream_options": forced})

    def with_model_defaults(self, request):
        """``request`` with the model's default sampling values (``--generation-config``) in the fields it leaves unset;
        its max_tokens is not one of them (see ``default_max_tokens``)."""
        defaults = self.engine.model_config.default_sampling_params
        updates = {k: v for k, v in defaults.items() if k != "max_tokens" and getattr(request, k, None) is None}
        return request.model_copy(update=updates) if updates else request

    def default_max_tokens(self) -> int | None:
        """The model's default max_tokens (``--generation-config``): a cap for a request that sets none, which the
        engine lowers to the room the prompt leaves (as vLLM), so it is not checked against the context."""
        return self.engine.model_config.default_sampling_params.get("max_tokens")

    @staticmethod
    def request_ids(prefix: str, raw_request=None, body_id: str | None = None) -> tuple[str, str]:
        """(response id, engine request id) of a request. As vLLM: ``{prefix}-{X-Request-Id}`` where the client sent
        a usable one, else ``{prefix}-{body_id}`` (the request's ``request_id`` field), and the engine's id adds a
        random suffix to it (two requests in flight may send the same id; aborting one must not touch the other).
        Otherwise both are ``{prefix}-{id}``, the id being the one ``RequestIdMiddleware`` answered with, else a new
        random one."""
        client_id = None if raw_request is None else client_request_id(raw_request.headers)
        client_id = body_id if client_id is None else client_id
        if client_id is not None:
            response_id = f"{prefix}-{client_id}"
            return response_id, f"{response_id}-{secrets.token_hex(8)}"
        made = None if raw_request is None else getattr(raw_request.state, "request_id", None)
        response_id = f"{prefix}-{made or uuid.uuid4().hex}"
        return response_id, response_id

    async def start(
        self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0
    ) -> tuple[RequestOutput | None, AsyncGenerator[RequestOutput, None]]:
        """Start a request and wait for its first output, so bad input fails before any response is sent.

        Returns the first output (None if the stream ended at once) and the generator for the rest.
        """
        check_max_logprobs(params, self.engine.model_config.max_logprobs, self.logprobs_field)
        if self.ctx.request_logger is not None:
            self.ctx.request_logger.log(request_id, prompt, params)
        stream = self.engine.generate(prompt, params, request_id, priority)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return None, stream
        except BaseException:
            await stream.aclose()
            raise
        return first, stream

    async def start_all(
        self, prompts: list[PromptType], params: SamplingParams, request_id: str, priority: int = 0
    ) -> list[tuple[RequestOutput | None, AsyncGenerator[RequestOutput, None]]]:
        """``start`` each prompt as ``{request_id}-{i}``; if one fails, the others are closed."""
        tasks = [
            asyncio.ensure_future(self.start(p, params.clone(), f"{request_id}-{i}", priority))
            for i, p in enumerate(prompts)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, tuple):
                    await result[1].aclose()
            raise

    def token_text(self, token_id: int, logprob: Logprob | None = None, as_id: bool = False) -> str:
        """A token as logprobs show it: its text, or with ``as_id`` (vLLM's ``return_tokens_as_token_ids``)
        ``token_id:N``, which stays exact where a token is part of a character."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int, token: str, as_id: bool = False) -> list[int]:
        """OpenAI's logprob ``bytes`` of a token shown as ``token``: the token's own bytes from the vocabulary (a
        token that is part of a character shows as U+FFFD, whose bytes would say nothing), else ``token``'s."""
        if as_id or self.tokenizer is None:
            return list(token.encode())
        if self._token_bytes is None:
            from runtime.entrypoints.openai.token_bytes import TokenBytes

            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes(token_id, token)

    def cached_tokens(self, outputs) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` of these prompts' outputs (each prompt's prefix-cache hits,
        summed); None without ``--enable-prompt-tokens-details``."""
        if not self.ctx.enable_prompt_tokens_details:
            return None
        return sum(output.num_cached_tokens for output in outputs if output is not None)

    def prompt_logprobs_field(self, prompt_logprobs) -> list | None:
        """vLLM's ``prompt_logprobs`` response field: per prompt position, None (the first) or {token id: {logprob,
        rank, decoded_token}} for the prompt's own token and the most likely ones."""
        if prompt_logprobs is None:
            return None
        return [None if position is None else {
            str(token_id): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": self.token_text(token_id, lp)}
            for token_id, lp in position.items()
        } for position in prompt_logprobs]


def client_request_id(headers) -> str | None:
    """The X-Request-Id of ``headers`` (a case-insensitive mapping) if it is usable as an id, else None."""
    value = headers.get("x-request-id")
    return value if value is not None and _CLIENT_REQUEST_ID.fullmatch(value) else None


def model_not_found(name: str, served_model_names: list[str]) -> OpenAIError:
    """OpenAI's 404 for a model this server does not serve."""
    return OpenAIError(f"The model `{name}` does not exist; this server serves: {', '.join(served_model_names)}",
                       404, param="model", code="model_not_found")


def add_kv_transfer_fields(body: dict, final: RequestOutput) -> None:
    """A prefill/decode request's response (vLLM's fields): the KV connector's ``kv_transfer_params``
    (where a decode instance pulls this prefill's KV), and the prompt tokens not computed here."""
    body["kv_transfer_params"] = final.kv_transfer_params
    if body.get("usage") is not None:
        body["usage"]["prompt_tokens_details"] = {"cached_tokens": final.num_cached_tokens}


def structured_output_error(exc: ValueError, params: SamplingParams, field: str | None) -> Exception:
    """``exc`` from starting a request; one about its output constraint (a schema the guided
    backend cannot compile, no backend installed) names the request field that asked for it."""
    if params.structured_outputs is None or field is None or getattr(exc, "param", None):
        return exc
    if param_of(str(exc)) not in (None, "structured_outputs"):
        return exc  # about another field (prompt, max_tokens, ...)
    return OpenAIError(str(exc), 400, param=field)


def clamp_logprob(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


def top_entries(position: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely (token id, Logprob) pairs of one position, best first."""
    ranked = sorted(position.items(), key=lambda item: item[1].logprob, reverse=True)
    return ranked[:num]


async def prepend(
    first: RequestOutput | None, rest: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    """The stream ``start`` split in two, joined again."""
    try:
        if first is not None:
            yield first
        async for output in rest:
            yield output
    finally:
        await rest.aclose()


async def merge_streams(
    streams: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output), as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, done))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
