"""Engine configuration: frozen dataclasses with vLLM's names, one per part of the engine.

They are built from the user-facing :class:`runtime.engine_args.EngineArgs` by
:func:`runtime.engine_args.build_engine_config`; this module imports nothing of the runtime.
"""

from __future__ import annotations

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
    served_model_names: tuple[str, ...] = ()  # every name the API answers to; the first is served_model_name
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for
    # SamplingParams defaults from the model's generation_config.json (a request's own values win)
    default_sampling_params: dict = field(default_factory=dict, compare=False)

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
    # KV offload (runtime.kv_transfer.resolve_kv_offload): the connector, its tiers in chain
    # order (device -> cpu -> disk), each tier's capacity in bytes, the disk tier's directory
    # and the cpu tier's eviction policy.
    kv_connector: str | None = None
    kv_offload: tuple[str, ...] = ()
    kv_offload_size: tuple[int, ...] = ()
    kv_offload_dir: str | None = None
    kv_offload_policy: str = "lru"
    # A transfer connector's --kv-transfer-config (runtime.kv_transfer.parse_transfer_config), else None.
    kv_transfer_config: dict | None = field(default=None, compare=False)
    cache_dtype: str = "auto"  # KV cache storage: "auto" (the model's dtype) or an 8-bit float
    # Set by the worker for its KV connector: the attention backend's name for an unusual order of each
    # block's bytes ("" for the usual one; runtime.attention.backend.kv_block_layout). Blocks saved to disk
    # are kept apart by it.
    kv_block_layout: str = field(default="", compare=False)

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
    preemption_mode: str = "recompute"  # or "swap": a preempted request's blocks go to the cpu offload tier


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    executor: str = "uniproc"
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas, each with tensor x pipeline workers

    @property
    def world_size(self) -> int:
        """Workers of one engine (one replica)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


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


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# 8-bit float KV caches store keys and values as they are (scale 1.0), as vLLM does without scales.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
SCHEDULING_POLICIES = ("fcfs", "priority")


def parse_dtype(value: str, config_dtype: torch.dtype | None) -> torch.dtype:
    if value == "auto":
        return config_dtype or torch.float32
    if value not in _DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; choose one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[value]
