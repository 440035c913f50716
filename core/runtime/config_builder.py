"""Validate ``EngineArgs`` and turn them into a frozen ``EngineConfig``."""

from __future__ import annotations

import dataclasses
import os

import torch

from runtime.config import (
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_dtype,
)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def _fail(name: str, value, allowed: str) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_numbers(args: EngineArgs) -> None:
    for name in ("block_size", "max_num_seqs", "tensor_parallel_size"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise _fail(name, value, "a positive integer")
    for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise _fail(name, value, "a positive integer or unset")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise _fail("gpu_memory_utilization", args.gpu_memory_utilization, "in (0, 1]")
    if args.num_speculative_tokens < 0:
        raise _fail("num_speculative_tokens", args.num_speculative_tokens, ">= 0")
    for f in dataclasses.fields(args):
        choices = f.metadata.get("choices")
        value = getattr(args, f.name)
        if choices and value not in choices:
            raise ValueError(f"{f.name} {value!r} is not valid; choose one of: {', '.join(choices)}")


def _check_plugin_choices(args: EngineArgs) -> None:
    """Every plugin-provided choice must name something a plugin registered."""
    from runtime.plugins import get_registry

    for f in dataclasses.fields(args):
        kind = f.metadata.get("kind")
        value = getattr(args, f.name)
        if kind and value is not None:
            registry = get_registry(kind)
            if value not in registry:
                raise ValueError(f"--{f.name.replace('_', '-')}: " + registry.unknown_message(value))


def _eos_token_ids(resolved) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(resolved, "generation_config", None), resolved.hf_config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        for token in eos if isinstance(eos, (list, tuple)) else [eos]:
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)


def _model_max_len(hf_config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 2048


MAX_DEFAULT_GRAPH_SIZE = 512


def graph_sizes(args: EngineArgs) -> tuple[int, ...]:
    """Decode batch sizes to capture: the user's list, or 1, 2, 4, every multiple of 8 and max_num_seqs (<= 512)."""
    if args.enforce_eager:
        return ()
    if args.cuda_graph_sizes is not None:
        bad = [s for s in args.cuda_graph_sizes if not isinstance(s, int) or s < 1]
        if bad or not args.cuda_graph_sizes:
            raise _fail("cuda_graph_sizes", args.cuda_graph_sizes, "a non-empty list of positive integers")
        return tuple(sorted(set(s for s in args.cuda_graph_sizes if s <= args.max_num_seqs)))
    limit = min(args.max_num_seqs, MAX_DEFAULT_GRAPH_SIZE)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, limit + 1, 8)) if s <= limit} | {limit}))


def build_model_config(args: EngineArgs, platform) -> ModelConfig:
    from runtime.model_loader import resolve_model

    if not args.model:
        raise ValueError("model must be a local Hugging Face folder or .gguf file, got an empty value")
    resolved = resolve_model(args.model, tokenizer=args.tokenizer)
    config_dtype = getattr(resolved.hf_config, "dtype", None) or getattr(resolved.hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    dtype = parse_dtype(args.dtype, config_dtype if isinstance(config_dtype, torch.dtype) else None)
    if args.dtype == "auto":
        dtype = platform.default_dtype(dtype)
    if dtype not in platform.supported_dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in platform.supported_dtypes)
        raise ValueError(f"dtype {dtype} is not supported on platform {platform.name!r}; supported: {names}")
    derived = _model_max_len(resolved.hf_config)
    max_model_len = args.max_model_len or derived
    if max_model_len > derived:
        raise ValueError(f"max_model_len {max_model_len} is larger than the model's maximum {derived}")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return ModelConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=args.seed,
        skip_tokenizer_init=args.skip_tokenizer_init,
        served_model_name=name,
        quantization=args.quantization,
        resolved=resolved,
        architecture=resolved.architecture,
        gguf_file=resolved.gguf_file,
        vocab_size=int(resolved.hf_config.vocab_size),
        eos_token_ids=_eos_token_ids(resolved),
    )


def build_engine_config(args: EngineArgs) -> EngineConfig:
    from runtime.platforms import select_platform

    _check_numbers(args)
    _check_plugin_choices(args)
    platform = select_platform(args.platform)
    model_config = build_model_config(args, platform)
    max_len = model_config.max_model_len
    budget = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    if not args.enable_chunked_prefill and budget < max_len:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_len}); "
            "enable chunked prefill or raise the budget"
        )
    if args.tensor_parallel_size != 1 and args.executor == "uniproc":
        raise ValueError("tensor_parallel_size > 1 needs a multi-worker executor; the 'uniproc' executor runs one worker")
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_offload=args.kv_offload,
            kv_offload_size=args.kv_offload_size,
            cache_dtype=args.kv_cache_dtype,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            policy=args.scheduling_policy,
            async_scheduling=args.async_scheduling,
        ),
        parallel_config=ParallelConfig(args.tensor_parallel_size, args.executor),
        device_config=DeviceConfig(
            platform.name, args.attention_backend, args.cpu_num_threads, args.enforce_eager, graph_sizes(args)
        ),
        load_config=LoadConfig(args.load_format),
        plugin_options={
            "speculative_method": args.speculative_method,
            "num_speculative_tokens": args.num_speculative_tokens,
            "guided_backend": args.guided_backend,
        },
    )
