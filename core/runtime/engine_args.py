"""The user-facing engine arguments and how they become a frozen ``EngineConfig``.

``EngineArgs`` is the flat set of arguments with vLLM's names: ``LLM(**kwargs)`` and the
CLI flags are both generated from its fields. :func:`build_engine_config` validates them,
resolves the platform and the model, and builds the per-part configs of :mod:`runtime.config`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from runtime.config import (
    _DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from runtime.speculative_config import proposer_max_model_len, resolve_speculative_config
from runtime.kv_transfer import (
    OFFLOADING_CONNECTOR, PREEMPTION_MODES, kv_offload_fields, parse_transfer_config, resolve_kv_offload,
)
from runtime.engine_arg_checks import check_numbers as _check_numbers
from runtime.engine_arg_checks import check_task as _check_task
from runtime.engine_arg_checks import invalid as _fail
from runtime.engine_arg_checks import override_generation_defaults as _override_defaults
from runtime.engine_arg_values import eos_token_ids as _eos_token_ids
from runtime.engine_arg_values import graph_sizes, resolve_dtype  # noqa: F401 (imported from here too)
from runtime.engine_arg_values import model_max_len as _model_max_len
from runtime.engine_arg_values import model_max_len_source
from runtime.model_loader.tokenizer import TOKENIZER_MODES

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def _arg(default, help: str, choices=None, kind: str | None = None, flag_aliases=()):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if kind is not None:
        meta["kind"] = kind  # registry kind whose names are the valid values
    if flag_aliases:
        meta["aliases"] = tuple(flag_aliases)
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """Every engine argument, with vLLM's names; CLI flags are generated from these."""

    model: str = _arg("", "local Hugging Face folder or .gguf file")
    task: str = _arg("auto", "vLLM's task: auto or generate (text generation, the only task here)")
    runner: str = _arg("auto", "vLLM's runner: auto or generate (no pooling runner here)")
    revision: str | None = _arg(
        None, "the model's hub revision (branch, tag or commit). Models are local paths (no hub downloads): a Hugging "
        "Face cache snapshot (.../models--ORG--NAME/snapshots/COMMIT) must be that revision; another folder records "
        "none and is used as it is, with a warning",
    )
    code_revision: str | None = _arg(None, "revision of the model folder's own code (trust_remote_code), checked as revision")
    tokenizer_revision: str | None = _arg(None, "the tokenizer's revision, checked as revision on the tokenizer path")
    tokenizer: str | None = _arg(None, "tokenizer folder (default: the model's)")
    tokenizer_mode: str = _arg(
        "auto", "auto / hf: the fast tokenizer when there is one; slow: transformers' Python tokenizer",
        choices=TOKENIZER_MODES,
    )
    trust_remote_code: bool = _arg(
        False, "let transformers run the model folder's own Python code (auto_map) for its config and tokenizer; "
        "the model itself always runs a built-in or plugin-registered architecture",
    )
    skip_tokenizer_init: bool = _arg(False, "run on token ids only, without a tokenizer")
    chat_template: str | None = _arg(None, "chat template file, or the Jinja text itself (default: the tokenizer's)")
    served_model_name: list[str] | str | None = _arg(
        None, "model name(s) in the API; requests may use any, responses carry the first (default: the model argument "
        "exactly as given, as vLLM's)"
    )
    generation_config: str = _arg(
        "auto", "default sampling parameters: auto (the model's generation_config.json), vllm (none: neutral "
        "defaults), or a folder holding a generation_config.json; a request's own values win",
    )
    override_generation_config: dict | None = _arg(
        None, "default sampling values over the generation config's, as JSON (vLLM's): {\"temperature\": 0.5}; keys: "
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens",
    )
    max_logprobs: int = _arg(20, "most logprobs / prompt_logprobs a request may ask for (-1: no limit)")
    disable_log_stats: bool = _arg(False, "do not log throughput and scheduler stats periodically")
    dtype: str = _arg("auto", "weight and activation dtype", choices=("auto",) + tuple(_DTYPES))
    seed: int = _arg(0, "random seed for weights (dummy) and unseeded sampling")
    max_model_len: int | None = _arg(None, "maximum prompt + output length (default: the model's)")
    load_format: str = _arg("auto", "weight format", choices=LOAD_FORMATS)
    quantization: str | None = _arg(None, "quantization method", kind="quant_method", flag_aliases=("-q",))
    block_size: int = _arg(16, "tokens per KV cache block")
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of shared prompt prefixes")
    num_gpu_blocks_override: int | None = _arg(None, "number of KV cache blocks (overrides memory sizing)")
    kv_cache_memory_bytes: int | None = _arg(None, "bytes of memory for the KV cache")
    gpu_memory_utilization: float = _arg(0.9, "fraction of device memory the engine may use")
    kv_cache_dtype: str = _arg(
        "auto", "KV cache storage dtype: auto (the model's) or fp8 / fp8_e4m3 (8-bit floats, unscaled)",
        choices=("auto",) + tuple(KV_CACHE_DTYPES),
    )
    max_num_seqs: int = _arg(256, "maximum number of running requests")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one engine step")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over several steps")
    scheduling_policy: str = _arg("fcfs", "order of waiting requests", choices=SCHEDULING_POLICIES)
    async_scheduling: bool = _arg(
        False, "schedule each step while the device still runs the previous one (overlaps host work with the GPU)"
    )
    tensor_parallel_size: int = _arg(1, "number of tensor-parallel workers", flag_aliases=("-tp",))
    pipeline_parallel_size: int = _arg(1, "number of pipeline stages (layers split across workers)", flag_aliases=("-pp",))
    data_parallel_size: int = _arg(1, "number of engine replicas behind one front end", flag_aliases=("-dp",))
    executor: str = _arg("uniproc", "executor", kind="executor", flag_aliases=("--distributed-executor-backend",))
    platform: str | None = _arg(None, "hardware platform (default: first available)", kind="platform")
    attention_backend: str | None = _arg(None, "attention backend (default: the platform's)", kind="attention_backend")
    cpu_num_threads: int | None = _arg(None, "torch threads on the CPU platform")
    enforce_eager: bool = _arg(False, "always run the model eagerly (no CUDA graphs)")
    enable_sleep_mode: bool = _arg(
        False, "allow sleep() / wake_up(): free the weights' and the KV cache's device memory while idle (vLLM's)"
    )
    cuda_graph_sizes: list[int] | None = _arg(
        None, "decode batch sizes to capture as CUDA graphs (default: 1 2 4 8 16 ... up to max_num_seqs, at most 512)"
    )
    speculative_config: dict | str | None = _arg(
        None, "speculative decoding, as JSON (vLLM's): {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}; num_speculative_tokens in 1..16. Drafts are "
        "verified exactly (greedy outputs are unchanged); async scheduling falls back to synchronous steps with it",
    )
    speculative_method: str | None = _arg(
        None, "short for speculative_config's method (merged into it)", kind="proposer"
    )
    num_speculative_tokens: int | None = _arg(
        None, "short for speculative_config's num_speculative_tokens (merged into it)"
    )
    kv_offload: str | None = _arg(None, "KV offload tiers in chain order: cpu, disk or cpu,disk (runtime-plugin-kv-offload)")
    kv_offload_size: str | float | None = _arg(None, "each offload tier's capacity, e.g. 8GiB,64GiB (default 4GiB, 32GiB)")
    kv_offload_dir: str | None = _arg(None, "directory of the disk offload tier's block files (kept across restarts)")
    kv_offload_policy: str | None = _arg(None, "eviction policy of the cpu offload tier: lru or arc (default lru)")
    kv_transfer_config: dict | str | None = _arg(None, "vLLM's spelling, JSON: {\"kv_connector\": \"OffloadingConnector\", "
                                                 "\"kv_connector_extra_config\": {\"tiers\", \"size\", \"dir\", \"policy\"}}")
    swap_space: float = _arg(4, "vLLM's CPU swap space in GiB: accepted and unused (--preemption-mode swap keeps "
                             "preempted KV in the --kv-offload cpu tier)")
    preemption_mode: str = _arg("recompute", "preempted requests' KV: recompute, or swap to the cpu tier", choices=PREEMPTION_MODES)
    guided_decoding_backend: str | None = _arg(
        None, "structured output (guided decoding) backend (default: outlines when runtime-plugin-outlines is installed)",
        kind="guided_backend", flag_aliases=("--guided-backend",),
    )
    structured_output_compile_timeout: float = _arg(
        60.0, "seconds a request's grammar may take to compile (from its arrival) before the request fails",
    )
    structured_output_compile_memory_bytes: int = _arg(
        4 << 30, "bytes of memory one grammar compile may take (backends that compile in a child process, e.g. "
        "outlines); a spec that needs more fails its request",
    )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def keyword_aliases(cls) -> dict[str, str]:
        """vLLM's keyword for a field named otherwise here (its long flag alias, ``_`` for ``-``) -> the field."""
        return {alias[2:].replace("-", "_"): f.name for f in dataclasses.fields(cls)
                for alias in f.metadata.get("aliases", ()) if alias.startswith("--")}

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        for alias, name in cls.keyword_aliases().items():
            if alias in kwargs:
                if name in kwargs:
                    raise ValueError(f"{alias} and {name} name the same engine argument; give one")
                kwargs[name] = kwargs.pop(alias)
        valid = set(cls.field_names())
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        return build_engine_config(self)


DEFAULT_GUIDED_BACKEND = "outlines"


def default_guided_backend(name: str | None) -> str | None:
    """The chosen guided decoding backend, else outlines when it is installed, else None."""
    if name is not None:
        return name
    from runtime.plugins import get_registry

    return DEFAULT_GUIDED_BACKEND if DEFAULT_GUIDED_BACKEND in get_registry("guided_backend") else None


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


def served_model_names(args: EngineArgs) -> tuple[str, ...]:
    """The API names of the model: the given one(s), else the model argument exactly as given (vLLM's default)."""
    given = args.served_model_name
    names = [given] if isinstance(given, str) else list(given or ())
    if any(not isinstance(n, str) or not n for n in names):
        raise _fail("served_model_name", given, "a non-empty name or a list of them")
    return tuple(dict.fromkeys(names)) or (str(args.model),)  # str: LLM() takes a pathlib.Path too


def build_model_config(args: EngineArgs, platform) -> ModelConfig:
    from runtime.model_loader import resolve_model
    from runtime.model_loader.generation_defaults import default_sampling_params
    from runtime.model_loader.tokenizer import load_chat_template
    from runtime.model_revision import check_revisions
    from runtime.quantization import GGUF_DEQUANTIZE_ENV, build_quant_config, default_gguf_method, select_quant_method

    if not args.model:
        raise ValueError("model must be a local Hugging Face folder or .gguf file, got an empty value")
    resolved = resolve_model(
        args.model, tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code,
        tokenizer_mode=args.tokenizer_mode,
        chat_template=load_chat_template(args.chat_template) if args.chat_template is not None else None,
    )
    check_revisions(args, resolved)
    dtype = resolve_dtype(args.dtype, resolved, platform)
    if dtype not in platform.supported_dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in platform.supported_dtypes)
        raise ValueError(f"dtype {dtype} is not supported on platform {platform.name!r}; supported: {names}")
    derived = _model_max_len(resolved.hf_config)
    max_model_len = args.max_model_len or derived
    if max_model_len > derived:
        raise ValueError(f"max_model_len {max_model_len} is larger than the model's maximum {derived} "
                         f"({model_max_len_source(resolved.hf_config, resolved.gguf_file)})")
    names = served_model_names(args)
    quantization = select_quant_method(args.quantization, resolved.hf_config)
    if quantization is None and resolved.gguf_file and args.load_format != "dummy":  # dummy weights have no blocks
        packed = default_gguf_method(resolved.gguf_file, dtype, platform, args.tensor_parallel_size,
                                     args.pipeline_parallel_size)
        if packed is not None:
            quantization = packed[0]
            logger.info("GGUF weights stay packed (--quantization %s): %s; %s=1 dequantizes them at load instead",
                        quantization, packed[1], GGUF_DEQUANTIZE_ENV)
    model_config = ModelConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=args.seed,
        skip_tokenizer_init=args.skip_tokenizer_init,
        served_model_name=names[0],
        served_model_names=names,
        max_logprobs=args.max_logprobs,
        default_sampling_params=_override_defaults(default_sampling_params(args.generation_config, resolved),
                                                   args.override_generation_config),
        quantization=quantization,
        resolved=resolved,
        architecture=resolved.architecture,
        gguf_file=resolved.gguf_file,
        vocab_size=int(resolved.hf_config.vocab_size),
        eos_token_ids=_eos_token_ids(resolved),
    )
    resolved.quant_config = build_quant_config(model_config, platform)  # the loader builds linears through it
    return model_config


def _names_offloading_connector(raw) -> bool:
    return bool(raw) and parse_transfer_config(raw)["kv_connector"] == OFFLOADING_CONNECTOR


def build_parallel_config(args: EngineArgs) -> ParallelConfig:
    """The parallel layout; more than one worker (tensor x pipeline) runs on the multiproc
    executor when the executor is left at its default, as vLLM picks ``mp`` then."""
    executor = args.executor
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size
    if world_size > 1 and executor == "uniproc":
        executor = "multiproc"
    offload = bool(args.kv_offload) or _names_offloading_connector(args.kv_transfer_config)
    if world_size > 1 and args.kv_transfer_config and not offload:
        raise ValueError(f"--kv-transfer-config runs with one worker only for now, got {world_size} (tensor x pipeline parallel)")
    return ParallelConfig(args.tensor_parallel_size, executor, args.pipeline_parallel_size, args.data_parallel_size)


def build_engine_config(args: EngineArgs) -> EngineConfig:
    from runtime.platforms import select_platform
    from runtime.quantization import canonical_quant_method

    if isinstance(args.dtype, torch.dtype):  # vLLM takes a torch dtype too (LLM(..., dtype=torch.float16))
        name = next((n for n, d in _DTYPES.items() if d == args.dtype), None)
        args = dataclasses.replace(args, dtype=name or str(args.dtype).removeprefix("torch."))
    _check_numbers(args)
    _check_task(args)
    args.quantization = canonical_quant_method(args.quantization)
    _check_plugin_choices(args)
    speculative_config = resolve_speculative_config(args)
    kv_offload = resolve_kv_offload(args)
    platform = select_platform(args.platform)
    model_config = build_model_config(args, platform)
    if speculative_config and args.max_model_len is None:  # the model's own length: a shorter draft lowers it
        capped = proposer_max_model_len(speculative_config, model_config.max_model_len)
        model_config = dataclasses.replace(model_config, max_model_len=capped)
    max_len = model_config.max_model_len
    budget = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    if not args.enable_chunked_prefill and budget < max_len:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_len}); "
            "enable chunked prefill or raise the budget"
        )
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            **kv_offload_fields(kv_offload),
            cache_dtype=args.kv_cache_dtype,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            policy=args.scheduling_policy,
            async_scheduling=args.async_scheduling,
            preemption_mode=args.preemption_mode,
        ),
        parallel_config=build_parallel_config(args),
        device_config=DeviceConfig(
            platform.name, args.attention_backend, args.cpu_num_threads, args.enforce_eager, graph_sizes(args)
        ),
        load_config=LoadConfig(args.load_format),
        plugin_options={
            "speculative_config": speculative_config,
            "speculative_method": speculative_config["method"] if speculative_config else None,
            "num_speculative_tokens": speculative_config["num_speculative_tokens"] if speculative_config else 0,
            "guided_decoding_backend": default_guided_backend(args.guided_decoding_backend),
            "structured_output_compile_timeout": args.structured_output_compile_timeout,
            "structured_output_compile_memory_bytes": args.structured_output_compile_memory_bytes,
            "enable_sleep_mode": args.enable_sleep_mode,
        },
    )
