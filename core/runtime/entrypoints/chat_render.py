"""How the offline ``LLM.chat`` turns a conversation into prompt text, with vLLM's options."""

from __future__ import annotations

import json
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")


def refuse_unsupported(**options: Any) -> None:
    """A clear error for a vLLM option this engine does not have (LoRA, multimodal) when it is set."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"{name} is not supported by this engine (no LoRA adapters or multimodal inputs); "
                             f"leave it None")


def template_messages(messages: list[dict], content_format: str = "auto") -> list[dict]:
    """The messages as the chat template reads them.

    ``"auto"`` and ``"string"``: a content given as OpenAI parts becomes the text of its text parts, one per
    line; ``"openai"``: every content becomes a list of parts. Tool call arguments given as JSON text become
    objects, as templates expect (and as vLLM passes them)."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format {content_format!r} is not valid; choose one of: "
                         f"{', '.join(CONTENT_FORMATS)}")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {type(message).__name__}")
        message = dict(message)
        content = message.get("content")
        if content_format == "openai":
            if isinstance(content, str):
                message["content"] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            message["content"] = "\n".join(_part_text(part) for part in content)
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_with_object_arguments(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"only text content parts are supported, got {kind!r}")
    text = part.get("text", "")
    if not isinstance(text, str):
        raise ValueError(f"the 'text' of a text content part must be a string, got {type(text).__name__}")
    return text


def _call_with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat(processor, messages: list[dict], template_kwargs: dict) -> str:
    """The conversation rendered by the model's template, or by ``template_kwargs["chat_template"]`` when set."""
    kwargs = dict(template_kwargs)
    if kwargs.get("add_generation_prompt") and kwargs.get("continue_final_message"):
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true; "
                         "pass add_generation_prompt=False to continue the last message")
    if kwargs.get("tools") is None:
        kwargs.pop("tools", None)
    template = kwargs.pop("chat_template", None)
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    if template is None:
        return processor.apply_chat_template(messages, add_generation_prompt, **kwargs)
    if processor.tokenizer is None:
        raise ValueError("chat needs a tokenizer; it is disabled by skip_tokenizer_init=True")
    return processor.tokenizer.apply_chat_template(
        messages, tokenize=False, chat_template=template, add_generation_prompt=add_generation_prompt, **kwargs
    )
