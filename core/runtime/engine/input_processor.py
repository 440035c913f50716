"""Turn user prompts into EngineCoreRequests: tokenize, apply chat templates, validate."""

from __future__ import annotations

import time
from typing import Any

from runtime.config import ModelConfig
from runtime.engine.messages import EngineCoreRequest
from runtime.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer):
        self.model_config = model_config
        self.tokenizer = tokenizer

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
        return self.tokenizer.encode(prompt), prompt

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {value}")

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[EngineCoreRequest, str | None]:
        prompt_token_ids, prompt_text = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        params = params.clone()
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
