"""A request's prompts as checked engine inputs ``{"prompt_token_ids", "prompt"}``.

Tokenizing costs microseconds per character, so the serving layer runs these
in a worker thread (``asyncio.to_thread``): a long prompt delays only its own
request. Each input is checked against the context here, where the prompt's
length is first known, so a request that cannot fit is a 400 before it runs.
"""

from __future__ import annotations

from runtime.engine.input_processor import InputProcessor, PromptType
from runtime.entrypoints.openai.limits import check_context_length
from runtime.sampling_params import SamplingParams


def checked_input(
    processor: InputProcessor, prompt_token_ids: list[int], text: str | None, params: SamplingParams,
    max_tokens_param: str | None,
) -> dict:
    """The engine input of one tokenized prompt (its last ``truncate_prompt_tokens`` tokens where the request asks for
    that); ValueError naming the field if it cannot run. ``max_tokens_param`` is the request field that set
    ``params.max_tokens``; None when the request set none (a model default, lowered to the room left, is no error)."""
    prompt_token_ids, text = processor.truncate(prompt_token_ids, text, params)
    processor.validate(prompt_token_ids, params)
    max_model_len = processor.model_config.max_model_len
    max_tokens = params.max_tokens if max_tokens_param is not None else None
    check_context_length(len(prompt_token_ids), max_tokens, max_model_len, max_tokens_param or "max_tokens",
                         params.min_tokens)
    return {"prompt_token_ids": prompt_token_ids} if text is None else {"prompt_token_ids": prompt_token_ids, "prompt": text}


def tokenize_prompts(
    processor: InputProcessor, prompts: list[PromptType], params: SamplingParams, max_tokens_param: str | None = "max_tokens"
) -> list[dict]:
    """``checked_input`` of each prompt (text or token ids), in order; of several, an error about one of them
    names it by its index ("prompt[1] must not be empty")."""
    inputs = []
    for index, prompt in enumerate(prompts):
        try:
            prompt_token_ids, text = processor.tokenize(prompt)
            inputs.append(checked_input(processor, prompt_token_ids, text, params, max_tokens_param))
        except ValueError as exc:
            message = str(exc)
            if len(prompts) == 1 or getattr(exc, "param", None) is not None or not message.startswith("prompt "):
                raise
            raise ValueError(f"prompt[{index}]{message.removeprefix('prompt')}") from None
    return inputs
