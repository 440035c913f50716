"""The CPU platform: always available, KV cache sized from a memory setting."""

from __future__ import annotations

import os

import torch

from runtime.platforms import Platform, cpu_flags

DEFAULT_KV_CACHE_BYTES = 4 << 30  # 4 GiB, like vLLM's CPU default KV space
LAZY_ZERO_MIN_BYTES = 64 << 20  # above glibc's largest mmap threshold (32 MiB)
KV_CACHE_ENV = "RUNTIME_CPU_KVCACHE_SPACE"  # GiB, an alternative to kv_cache_memory_bytes
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; Arm's Features


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX-512 BF16 or AMX, Arm BF16)."""
    return bool(BF16_FLAGS & cpu_flags())


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0  # any accelerator platform wins auto-detection
    dist_backend = "gloo"
    default_attention_backend = "cpu_paged"
    supported_dtypes = (torch.float32, torch.bfloat16)

    def is_available(self) -> bool:
        return True

    def total_memory_bytes(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        if cache_config.kv_cache_memory_bytes:
            return cache_config.kv_cache_memory_bytes
        env = os.environ.get(KV_CACHE_ENV)
        if env:
            try:
                return int(float(env) * (1 << 30))
            except ValueError:
                raise ValueError(f"{KV_CACHE_ENV} must be a number of GiB, got {env!r}") from None
        return min(DEFAULT_KV_CACHE_BYTES, self.total_memory_bytes() // 4)

    def allocate_kv_cache(self, shape, dtype, device) -> torch.Tensor:
        # Attention reads whole blocks and masks the unused slots, so they must hold
        # finite values. A large allocation is fresh mmap'd memory, which the kernel
        # hands out zeroed and commits only as blocks are written: a big default cache
        # then costs nothing up front. Small ones may reuse heap memory: zero them.
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if size < LAZY_ZERO_MIN_BYTES:
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        # float16 matmuls are slow on CPUs; bfloat16 keeps the range of the checkpoint. Weights
        # that name no dtype (a GGUF file's blocks) run in bfloat16 where the CPU computes it
        # natively, as vLLM's auto takes a lower precision for them; a float32 checkpoint stays
        # float32 (the precision the correctness suites compare in).
        if config_dtype == torch.float16:
            return torch.bfloat16
        if config_dtype is None:
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return config_dtype

    def set_threads(self, num_threads: int | None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)

    # Decode steps run compiled (runtime_cpu.compile) unless RUNTIME_CPU_COMPILE=0 or --enforce-eager.
    supports_graphs = True
    compiles_graphs = True

    def compile_model(self, model):
        from runtime_cpu.compile import compile_model

        return compile_model(model)
