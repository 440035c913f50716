"""The XPU platform: Intel GPUs through ``torch.xpu``."""

from __future__ import annotations

import torch

from runtime.platforms import Platform

# Kept free for activations until the model runner profiles a forward pass.
ACTIVATION_RESERVE_BYTES = 512 << 20


def kv_cache_budget(free: int, total: int, utilization: float, reserve: int = ACTIVATION_RESERVE_BYTES) -> int:
    """Bytes for the KV cache: the engine's share of ``total`` minus what is already in use."""
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


def xpu_dist_backend() -> str:
    """``xccl`` where torch ships it (2.8+), else oneCCL's ``ccl`` (oneccl_bindings_for_pytorch)."""
    import torch.distributed as dist

    is_xccl_available = getattr(dist, "is_xccl_available", None)
    if is_xccl_available is not None and is_xccl_available():
        return "xccl"
    return "ccl"


def xpu_mem_get_info(device: int | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes of an XPU; older torch lacks ``torch.xpu.mem_get_info``."""
    if hasattr(torch.xpu, "mem_get_info"):
        return torch.xpu.mem_get_info(device)
    index = torch.xpu.current_device() if device is None else device
    total = torch.xpu.get_device_properties(index).total_memory
    return total - torch.xpu.memory_reserved(index), total


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    priority = 5  # above cpu; below cuda and rocm when a machine has both kinds of GPU
    default_attention_backend = "triton"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    @property
    def dist_backend(self) -> str:  # decided when asked: importing torch.distributed is not free
        return xpu_dist_backend()

    def is_available(self) -> bool:
        xpu = getattr(torch, "xpu", None)
        return xpu is not None and xpu.is_available()

    def device(self, local_rank: int = 0) -> torch.device:
        """The worker's GPU, made current (Triton launches on the current device)."""
        count = torch.xpu.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(f"local rank {local_rank} has no GPU; visible XPU devices: {count}")
        torch.xpu.set_device(local_rank)
        return torch.device("xpu", local_rank)

    def total_memory_bytes(self) -> int:
        return xpu_mem_get_info()[1]

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        if cache_config.kv_cache_memory_bytes:
            return cache_config.kv_cache_memory_bytes
        free, total = xpu_mem_get_info()
        return kv_cache_budget(free, total, cache_config.gpu_memory_utilization)

    def synchronize(self) -> None:
        torch.xpu.synchronize()
