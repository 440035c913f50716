"""What one request may cost the server: completions asked for, and tokens against the context.

Checked before anything is tokenized or sent to the engine, so a request
that asks for too much is a 400 naming the field, the value and the limit
(and the flag that moves it), never a server busy for minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_N = 128  # OpenAI's own limit on n
DEFAULT_MAX_CHOICES_PER_REQUEST = 2048  # n x number of prompts of one /v1/completions request
# JSON parsing and validation run on the event loop (about 0.1-0.5 s per MiB on a small CPU),
# so the body limit bounds how long one request can keep the others (and /health) waiting.
# 2 MiB holds a 128k-token prompt, as text or as token ids; text-generation-inference's default is 2 MB.
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024


def positive_int(flag: str, value) -> int:
    """``value`` if it is an integer >= 1, else a ValueError naming the flag."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request bounds of ``runtime serve`` (``--max-n``, ``--max-choices-per-request``, ``--max-body-bytes``)."""

    max_n: int = DEFAULT_MAX_N
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        positive_int("--max-n", self.max_n)
        positive_int("--max-choices-per-request", self.max_choices_per_request)
        positive_int("--max-body-bytes", self.max_body_bytes)

    @classmethod
    def from_args(cls, args) -> "RequestLimits":
        """The limits of the ``runtime serve`` flags (defaults where a flag is missing)."""
        defaults = cls()
        values = {name: getattr(args, name, None) for name in ("max_n", "max_choices_per_request", "max_body_bytes")}
        return cls(**{name: getattr(defaults, name) if value is None else value for name, value in values.items()})

    def check_n(self, n: int, num_prompts: int = 1) -> None:
        """ValueError if ``n`` completions of each of ``num_prompts`` prompts is more than allowed."""
        if n > self.max_n:
            raise ValueError(f"n must be at most {self.max_n} on this server (--max-n), got {n}")
        num_choices = n * num_prompts
        if num_choices > self.max_choices_per_request:
            raise ValueError(
                f"prompt: {num_prompts} prompts with n={n} ask for {num_choices} completions; this server "
                f"answers at most {self.max_choices_per_request} per request (--max-choices-per-request)"
            )


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str,
                         min_tokens: int = 0) -> None:
    """ValueError (starting with ``param``) if the prompt and ``max_tokens`` together exceed the context;
    without ``max_tokens`` (the rest of the context), if ``min_tokens`` does not fit in it (as vLLM, which
    sets ``max_tokens`` to the rest of the context and then checks ``min_tokens`` against it).

    The wording carries the same facts as vLLM's and OpenAI's message (and its
    "maximum context length" phrase, which clients look for).
    """
    room = max(max_model_len - num_prompt_tokens, 0)
    if max_tokens is None:
        if min_tokens > room:
            raise ValueError(
                f"min_tokens must be at most the {room} tokens the context leaves after the prompt "
                f"({num_prompt_tokens} of {max_model_len}), got {min_tokens}"
            )
        return
    if num_prompt_tokens + max_tokens <= max_model_len:
        return
    raise ValueError(
        f"{param}: this model's maximum context length is {max_model_len} tokens, but the request needs "
        f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt and {max_tokens} in the completion); "
        f"shorten the prompt or set {param} to at most {room}"
    )
