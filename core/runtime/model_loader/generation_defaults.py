"""Default sampling parameters from a model's ``generation_config.json`` (vLLM's ``--generation-config``).

``auto`` takes the model's file, ``vllm`` ignores it (neutral defaults), and a folder path
reads that folder's ``generation_config.json``. Only the sampling fields below are taken;
a request's own values always win over them.
"""

from __future__ import annotations

import os

from runtime.model_loader.resolve import ResolvedModel, read_generation_config

GENERATION_CONFIG_MODES = ("auto", "vllm")
# generation_config.json name -> SamplingParams name
_SAMPLING_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def default_sampling_params(generation_config: str, resolved: ResolvedModel) -> dict:
    """``{SamplingParams field: value}`` that the source ``generation_config`` sets."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        config = resolved.generation_config
    else:
        config = _folder_generation_config(generation_config)
    if config is None:
        return {}
    values = config.to_diff_dict()
    return {ours: values[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if values.get(theirs) is not None}


def _folder_generation_config(value: str):
    folder = os.path.abspath(os.path.expanduser(value))
    config = read_generation_config(folder) if os.path.isdir(folder) else None
    if config is None:
        raise ValueError(
            f"generation_config {value!r} is not a folder holding generation_config.json; "
            f"choose one of: {', '.join(GENERATION_CONFIG_MODES)}, or such a folder"
        )
    return config
