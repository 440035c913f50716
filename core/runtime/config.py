"""Engine configuration: frozen dataclasses with vLLM's names.

``EngineArgs`` is the flat set of user-facing arguments (``LLM(**kwargs)`` and the
CLI flags are both generated from its fields); ``EngineArgs.create_engine_config``
validates them and builds the frozen per-part configs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None
    dtype: torch.dtype
    max_model_len: int
    seed: int
    skip_tokenizer_init: bool
    served_model_name: str
    quantization: str | None
    resolved: Any = field(compare=False, repr=False)  # model_loader.ResolvedModel
    architecture: str = ""
    gguf_file: str | None = None
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()

    @property
    def hf_config(self):
        return self.resolved.hf_config


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_offload: str | None = None
    kv_offload_size: float | None = None
    cache_dtype: str = "auto"  # KV cache storage: "auto" (the model's dtype) or an 8-bit float

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.cache_dtype == "auto" else KV_CACHE_DTYPES[self.cache_dtype]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    async_scheduling: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    executor: str = "uniproc"


@dataclass(frozen=True)
class DeviceConfig:
    platform: str
    attention_backend: str | None = None
    num_threads: int | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes captured as graphs (sorted)


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "auto"


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    plugin_options: dict = field(default_factory=dict, compare=False)


def _arg(default, help: str, choices=None, kind: str | None = None, flag_aliases=()):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if kind is not None:
        meta["kind"] = kind  # registry kind whose names are the valid values
    if flag_aliases:
        meta["aliases"] = tuple(flag_aliases)
    return field(default=default, metadata=meta)


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# 8-bit float KV caches store keys and values as they are (scale 1.0), as vLLM does without scales.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineArgs:
    """Every engine argument, with vLLM's names; CLI flags are generated from these."""

    model: str = _arg("", "local Hugging Face folder or .gguf file")
    tokenizer: str | None = _arg(None, "tokenizer folder (default: the model's)")
    skip_tokenizer_init: bool = _arg(False, "run on token ids only, without a tokenizer")
    served_model_name: str | None = _arg(None, "model name in the API (default: the model path's name)")
    dtype: str = _arg("auto", "weight and activation dtype", choices=("auto",) + tuple(_DTYPES))
    seed: int = _arg(0, "random seed for weights (dummy) and unseeded sampling")
    max_model_len: int | None = _arg(None, "maximum prompt + output length (default: the model's)")
    load_format: str = _arg("auto", "weight format", choices=LOAD_FORMATS)
    quantization: str | None = _arg(None, "quantization method", kind="quant_method")
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
    tensor_parallel_size: int = _arg(1, "number of tensor-parallel workers")
    executor: str = _arg("uniproc", "executor", kind="executor", flag_aliases=("--distributed-executor-backend",))
    platform: str | None = _arg(None, "hardware platform (default: first available)", kind="platform")
    attention_backend: str | None = _arg(None, "attention backend (default: the platform's)", kind="attention_backend")
    cpu_num_threads: int | None = _arg(None, "torch threads on the CPU platform")
    enforce_eager: bool = _arg(False, "always run the model eagerly (no CUDA graphs)")
    cuda_graph_sizes: list[int] | None = _arg(
        None, "decode batch sizes to capture as CUDA graphs (default: 1 2 4 8 16 ... up to max_num_seqs, at most 512)"
    )
    speculative_method: str | None = _arg(None, "speculative decoding proposer", kind="proposer")
    num_speculative_tokens: int = _arg(0, "draft tokens per step")
    kv_offload: str | None = _arg(None, "KV cache offload tier", kind="kv_tier")
    kv_offload_size: float | None = _arg(None, "size of the KV offload tier in GiB")
    guided_backend: str | None = _arg(None, "structured output backend", kind="guided_backend")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        valid = set(cls.field_names())
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        from runtime.config_builder import build_engine_config

        return build_engine_config(self)


def parse_dtype(value: str, config_dtype: torch.dtype | None) -> torch.dtype:
    if value == "auto":
        return config_dtype or torch.float32
    if value not in _DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; choose one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[value]
