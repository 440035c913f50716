"""Range checks of the numeric engine arguments (:class:`runtime.engine_args.EngineArgs`), each error naming the
argument, what it must be and the value it got."""

from __future__ import annotations

import dataclasses


def invalid(name: str, value, allowed: str) -> ValueError:
    """The error of engine argument ``name``: what it must be, and the value it got."""
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def check_numbers(args) -> None:
    """ValueError naming the first numeric engine argument out of range, or a field outside its choices."""
    for name in ("block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise invalid(name, value, "a positive integer")
    for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_cache_memory_bytes",
                 "cpu_num_threads"):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise invalid(name, value, "a positive integer or unset")
    memory = args.structured_output_compile_memory_bytes
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1 << 20:
        raise invalid("structured_output_compile_memory_bytes", memory, "an integer number of bytes, at least 1 MiB")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise invalid("gpu_memory_utilization", args.gpu_memory_utilization, "in (0, 1]")
    timeout = args.structured_output_compile_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise invalid("structured_output_compile_timeout", timeout, "a positive number of seconds")
    if not _is_number(args.swap_space) or args.swap_space < 0:
        raise invalid("swap_space", args.swap_space, "a number of GiB >= 0")
    if not isinstance(args.max_logprobs, int) or args.max_logprobs < -1:
        raise invalid("max_logprobs", args.max_logprobs, "an integer >= 0, or -1 for no limit")
    for f in dataclasses.fields(args):
        choices = f.metadata.get("choices")
        value = getattr(args, f.name)
        if choices and value not in choices:
            raise ValueError(f"{f.name} {value!r} is not valid; choose one of: {', '.join(choices)}")


GENERATION_TASKS = ("auto", "generate")


def check_task(args) -> None:
    """vLLM's task and runner must mean text generation; ValueError naming the bad one and the supported ones."""
    for name in ("task", "runner"):
        value = getattr(args, name)
        if value not in GENERATION_TASKS:
            raise ValueError(
                f"{name} {value!r} is not supported: this engine runs generative models only (no pooling, embedding, "
                f"classification, scoring or reward runners); supported: {', '.join(GENERATION_TASKS)}"
            )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


# vLLM's --override-generation-config keys (generation_config.json names) -> (SamplingParams name, valid, allowed)
_GENERATION_OVERRIDES = {
    "temperature": ("temperature", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": ("top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1, "an integer >= -1"),
    "min_p": ("min_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": ("repetition_penalty", lambda v: _is_number(v) and v > 0, "a number > 0"),
    "max_new_tokens": ("max_tokens", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                       "an integer >= 1"),
}


def override_generation_defaults(defaults: dict, overrides: dict | None) -> dict:
    """The default sampling values ``defaults`` (of ``--generation-config``) with ``--override-generation-config``'s
    on top; ValueError naming a key that is not a sampling field, or a value out of its range."""
    if not overrides:
        return defaults
    if not isinstance(overrides, dict):
        raise invalid("override_generation_config", overrides, "a JSON object such as {\"temperature\": 0.5}")
    merged = dict(defaults)
    for key, value in overrides.items():
        if key not in _GENERATION_OVERRIDES:
            raise ValueError(f"override_generation_config: {key!r} is not a sampling field of the generation config; "
                             f"valid: {', '.join(_GENERATION_OVERRIDES)}")
        name, valid, allowed = _GENERATION_OVERRIDES[key]
        if not valid(value):
            raise invalid(f"override_generation_config's {key}", value, allowed)
        merged[name] = value
    return merged
