"""``max_logprobs``: the most logprobs a request may ask for (vLLM's ``--max-logprobs``, default 20)."""

from __future__ import annotations

from runtime.sampling_params import SamplingParams


def check_max_logprobs(params: SamplingParams, max_logprobs: int, logprobs_field: str = "logprobs") -> None:
    """ValueError naming the field, the number asked and the limit; a limit of -1 allows any number.

    ``logprobs_field`` is the name the caller knows ``params.logprobs`` by (chat's ``top_logprobs``).
    """
    if max_logprobs < 0:
        return
    for attr, name in (("logprobs", logprobs_field), ("prompt_logprobs", "prompt_logprobs")):
        value = getattr(params, attr)
        if value is not None and value > max_logprobs:
            raise ValueError(
                f"{name} asks for {value} logprobs, more than max_logprobs {max_logprobs}; "
                "ask for fewer, or raise the limit with --max-logprobs (LLM(max_logprobs=...))"
            )
