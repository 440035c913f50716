"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Unknown fields are ignored, as OpenAI and vLLM do. Range checks live in
SamplingParams, whose ValueErrors name the field; ``to_sampling_params``
turns a request into one. The models themselves only bound what must hold
before anything runs (and what /openapi.json tells clients and fuzzers):
integers fit in 64 bits, floats are finite, per-request lists are bounded.

The fields both requests share are in ``protocol_sampling``, the chat request in ``protocol_chat``;
this module holds the completion and tokenizer requests and re-exports the others.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from runtime.entrypoints.openai.protocol_base import Int64, InvalidField, JsonObject, OpenAIBaseModel, Texts, TokenIdLists, TokenIds
from runtime.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatMessage
from runtime.entrypoints.openai.protocol_sampling import (
    SamplingFields, StreamOptions, check_logprobs, check_prompt_logprobs, parse_logit_bias,
)
from runtime.entrypoints.openai.protocol_tools import MAX_TOOLS, ChatTool, required_tools_schema

__all__ = [  # the request models, and names imported from here before they moved to protocol_*
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest", "InvalidField", "SamplingFields",
    "StreamOptions", "Texts", "TokenIdLists", "TokenIds", "TokenizeRequest", "parse_logit_bias", "required_tools_schema",
]


class CompletionRequest(SamplingFields):
    prompt: str | Texts | TokenIds | TokenIdLists
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None
    prompt_logprobs: Int64 | None = None
    return_token_ids: bool = False  # vLLM's: choices carry token_ids (and prompt_token_ids when not streamed)

    @property
    def echo_only(self) -> bool:
        """OpenAI's (and vLLM's) ``echo`` with ``max_tokens`` 0: the prompt (and its logprobs) back, nothing generated."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens  # the engine samples one token, which is not returned

    def _num_logprobs(self) -> int | None:
        check_logprobs("logprobs", self.logprobs)
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        check_prompt_logprobs(self.prompt_logprobs, self.stream)
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None

    def check_supported(self) -> None:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) or be unset, got {self.best_of}")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings, or token id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if self.kv_transfer_params is not None and len(prompt) > 1:
            raise InvalidField("kv_transfer_params", f"kv_transfer_params needs one prompt, got {len(prompt)}")
        return list(prompt)



class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None  # rendered by the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's, as in chat requests
    chat_template_kwargs: JsonObject | None = None  # vLLM's, as in chat requests


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds
