"""Turn user prompts into EngineCoreRequests: tokenize, apply chat templates, validate."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from runtime.config import ModelConfig
from runtime.messages import EngineCoreRequest
from runtime.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


NO_GUIDED_BACKEND = (
    "structured output needs a guided decoding backend and none is installed; install "
    "runtime-plugin-outlines (pip install -e plugins/outlines), or pick an installed one with --guided-decoding-backend"
)


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer, guided_backend: str | None = None,
                 scheduling_policy: str = "fcfs"):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.guided_backend = guided_backend  # the engine's guided decoding backend, None when there is none
        self.scheduling_policy = scheduling_policy

    def tokenize(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt: a string, {"prompt": ...} or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self._check_ids(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids'; got keys {sorted(prompt)}")
        if isinstance(prompt, list):
            return self._check_ids(prompt), None
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init=True pass prompt_token_ids")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return self.encode(prompt), prompt

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """Token ids of ``text``; ValueError naming ``field`` for a text too long to fit or not valid Unicode."""
        self.check_text(text, field)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_text(self, text: str, field: str = "prompt") -> None:
        """ValueError if ``text`` cannot fit in the context (by its length alone) or has unpaired surrogates.

        Costs O(len(text)) at most, so it runs before tokenizing, which costs microseconds per character.
        """
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise ValueError(
                f"{field} has {len(text)} characters; no text of more than {limit} characters fits in "
                f"max_model_len={self.model_config.max_model_len} tokens (no token of this tokenizer "
                f"spans more than {limit // self.model_config.max_model_len} bytes)"
            )
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{field} is not valid Unicode: {exc.reason} at character {exc.start}") from None

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """The most characters a text can have and still be at most max_model_len tokens (None: unknown).

        No token spans more bytes of text than the UTF-8 length of its vocabulary entry (byte-level
        BPE spells each byte as one character, SentencePiece pieces are no shorter than the text they
        stand for), and a character is at least one byte. Tokenizers that delete characters while
        normalizing are not accounted for.
        """
        get_vocab = getattr(self.tokenizer, "get_vocab", None)
        if get_vocab is None:
            return None
        longest = max((len(piece.encode("utf-8", "surrogatepass")) for piece in get_vocab()), default=0)
        return self.model_config.max_model_len * max(longest, 1)

    @staticmethod
    def _check_ids(ids) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; it is disabled by skip_tokenizer_init=True")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model_config.model!r} has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def truncate(self, prompt_token_ids: list[int], text: str | None, params: SamplingParams) -> tuple[list[int], str | None]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: the last max_model_len) and its text, which is
        dropped once it names more than they do; or the prompt as it is. ValueError (as vLLM's) for a
        ``truncate_prompt_tokens`` longer than the context, which no prompt could run with."""
        keep = params.truncate_prompt_tokens
        max_len = self.model_config.max_model_len
        if keep is not None and keep > max_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_len}); "
                             f"use at most {max_len}, or -1 to keep the last max_model_len tokens")
        if keep == -1:
            keep = max_len
        if keep is None or len(prompt_token_ids) <= keep:
            return prompt_token_ids, text
        return prompt_token_ids[-keep:], None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, but max_model_len is {max_len}; "
                f"the prompt must be shorter than {max_len} tokens"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range; valid ids are 0..{vocab - 1}")
        if params.logit_bias:
            bad_bias = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
            if bad_bias is not None:
                raise ValueError(f"logit_bias token id {bad_bias} is out of range; valid ids are 0..{vocab - 1}")
        if params.allowed_token_ids:
            bad_allowed = next((t for t in params.allowed_token_ids if not 0 <= t < vocab), None)
            if bad_allowed is not None:
                raise ValueError(f"allowed_token_ids: token id {bad_allowed} is out of range; valid ids are 0..{vocab - 1}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {value}")
        if params.structured_outputs is not None:
            if self.guided_backend is None:
                raise ValueError(NO_GUIDED_BACKEND)
            if self.tokenizer is None:
                raise ValueError("structured output needs the tokenizer; it is disabled by skip_tokenizer_init=True")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs the tokenizer; it is disabled by skip_tokenizer_init=True")

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[EngineCoreRequest, str | None]:
        if priority != 0 and self.scheduling_policy != "priority":
            # as vLLM: a priority would be silently ignored under first-come-first-served scheduling
            raise ValueError(f"priority {priority} needs --scheduling-policy priority; this engine schedules "
                             f"{self.scheduling_policy} (priority must be 0)")
        prompt_token_ids, prompt_text = self.truncate(*self.tokenize(prompt), params)
        self.validate(prompt_token_ids, params)
        params = with_prompt_cache_salt(params.clone(), prompt)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time=time.time(),
            priority=priority,
            eos_token_id=tokenizer_eos,
        )
        return request, prompt_text


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences that ban ``words``: each word as it is and after a space (at the start of the text and
    inside it). vLLM keeps the second only when it has as many tokens as the first; here it is kept whenever it
    differs, since a word inside a text is often one token with its space where it alone is several
    (SmolLM2's " careful" against "care" + "ful")."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for sequence in (plain, spaced):
            if sequence and sequence not in sequences:
                sequences.append(sequence)
    return sequences


def with_prompt_cache_salt(params: SamplingParams, prompt: PromptType) -> SamplingParams:
    """``params`` with the ``cache_salt`` of a prompt dict (vLLM's place for it), validated."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return params
    salt = prompt["cache_salt"]
    if params.cache_salt is not None and params.cache_salt != salt:
        raise ValueError(
            f"cache_salt differs between the prompt dict ({salt!r}) and SamplingParams ({params.cache_salt!r})"
        )
    return dataclasses.replace(params, cache_salt=salt)
