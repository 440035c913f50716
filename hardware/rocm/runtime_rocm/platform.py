"""The ROCm platform: AMD GPUs, which a HIP build of torch exposes as ``torch.cuda``."""

from __future__ import annotations

import torch

from runtime.platforms import Platform

# Kept free for activations until the model runner profiles a forward pass.
ACTIVATION_RESERVE_BYTES = 512 << 20


def kv_cache_budget(free: int, total: int, utilization: float, reserve: int = ACTIVATION_RESERVE_BYTES) -> int:
    """Bytes for the KV cache: the engine's share of ``total`` minus what is already in use.

    ``total - free`` counts the loaded weights and whatever other processes hold.
    """
    used = total - free
    budget = int(total * utilization) - used - reserve
    if budget <= 0:
        raise ValueError(
            f"no device memory left for the KV cache: {used / 2**30:.2f} GiB of {total / 2**30:.2f} GiB "
            f"are in use and gpu_memory_utilization={utilization} allows {total * utilization / 2**30:.2f} GiB "
            f"(with {reserve / 2**20:.0f} MiB kept for activations); raise gpu_memory_utilization or set "
            "kv_cache_memory_bytes / num_gpu_blocks_override"
        )
    return budget


class RocmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"  # HIP builds of torch keep the "cuda" device type
    priority = 10  # as cuda (a torch build is CUDA or HIP, never both); above cpu
    dist_backend = "nccl"  # torch.distributed runs "nccl" on RCCL in HIP builds
    default_attention_backend = "triton"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def is_available(self) -> bool:
        # torch.version.hip is set only in HIP builds. device_count() asks amdsmi
        # first, which does not initialize HIP, so a later fork of the process works.
        if not getattr(torch.version, "hip", None):
            return False
        return torch.cuda.device_count() > 0

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank)

    def total_memory_bytes(self) -> int:
        return torch.cuda.mem_get_info()[1]

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        if cache_config.kv_cache_memory_bytes:
            return cache_config.kv_cache_memory_bytes
        free, total = torch.cuda.mem_get_info()
        return kv_cache_budget(free, total, cache_config.gpu_memory_utilization)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
