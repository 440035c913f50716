"""Values the engine config derives from the engine arguments and the checkpoint: the dtype, the maximum length,
the EOS token ids and the decode batch sizes captured as CUDA graphs."""

from __future__ import annotations

import torch

from runtime.config import parse_dtype
from runtime.engine_arg_checks import invalid


def eos_token_ids(resolved) -> tuple[int, ...]:
    """The EOS ids of the generation config, then of the model config, each once."""
    ids: list[int] = []
    for source in (getattr(resolved, "generation_config", None), resolved.hf_config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        for token in eos if isinstance(eos, (list, tuple)) else [eos]:
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)


MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")


def model_max_len(hf_config) -> int:
    """The longest sequence the model config allows (2048 when it names none)."""
    for name in MAX_LEN_KEYS:
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 2048


def model_max_len_source(hf_config, gguf_file: str | None) -> str:
    """Where :func:`model_max_len` found its value, for errors: the GGUF file's context_length, or the config key."""
    key = next((name for name in MAX_LEN_KEYS if getattr(hf_config, name, None)), None)
    if key is None:
        return "the config names no length; 2048 is assumed"
    if gguf_file:
        return f"the GGUF file's context_length ({key})"
    return f"the config's {key}"


MAX_DEFAULT_GRAPH_SIZE = 512


def graph_sizes(args) -> tuple[int, ...]:
    """Decode batch sizes to capture: the user's list, or 1, 2, 4, every multiple of 8 and max_num_seqs (<= 512)."""
    if args.enforce_eager:
        return ()
    if args.cuda_graph_sizes is not None:
        bad = [s for s in args.cuda_graph_sizes if not isinstance(s, int) or s < 1]
        if bad or not args.cuda_graph_sizes:
            raise invalid("cuda_graph_sizes", args.cuda_graph_sizes, "a non-empty list of positive integers")
        return tuple(sorted(set(s for s in args.cuda_graph_sizes if s <= args.max_num_seqs)))
    limit = min(args.max_num_seqs, MAX_DEFAULT_GRAPH_SIZE)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, limit + 1, 8)) if s <= limit} | {limit}))


def resolve_dtype(value: str, resolved, platform) -> torch.dtype:
    """``--dtype`` as a torch dtype. ``auto`` is the platform's choice for the checkpoint's dtype:
    its config's, else its safetensors weights' (as vLLM reads them), else none (a GGUF file's
    blocks, a folder without weights)."""
    if value != "auto":
        return parse_dtype(value, None)
    hf_config = resolved.hf_config
    # transformers 5 names it ``dtype`` (reading ``torch_dtype`` there warns); 4.x ``torch_dtype``.
    config_dtype = getattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    if not isinstance(config_dtype, torch.dtype):
        config_dtype = None
    if config_dtype is None and not resolved.gguf_file:
        from runtime.model_loader.safetensors_weights import safetensors_float_dtype

        config_dtype = safetensors_float_dtype(resolved.path)
    return platform.default_dtype(config_dtype)
