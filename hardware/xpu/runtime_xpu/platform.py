"""The XPU platform: Intel GPUs through ``torch.xpu``.

Detection, the worker's device and the KV cache budget are the shared
:class:`runtime.platforms.gpu.GpuPlatform`'s over ``torch.xpu``, whose device count
starts no device context. What is XPU's own: the collective backend, and memory
figures on torch builds older than ``torch.xpu.mem_get_info``.
"""

from __future__ import annotations

import torch

from runtime.platforms.gpu import GpuPlatform


def xpu_dist_backend() -> str:
    """``xccl`` where torch ships it (2.8+), else oneCCL's ``ccl`` (oneccl_bindings_for_pytorch)."""
    import torch.distributed as dist

    is_xccl_available = getattr(dist, "is_xccl_available", None)
    if is_xccl_available is not None and is_xccl_available():
        return "xccl"
    return "ccl"


class XpuPlatform(GpuPlatform):
    name = "xpu"
    device_type = "xpu"
    priority = 5  # above cpu; below cuda and rocm when a machine has both kinds of GPU
    label = "XPU"
    count_hook = "device_count"  # torch.xpu counts devices without creating a context

    @property
    def dist_backend(self) -> str:  # decided when asked: importing torch.distributed is not free
        return xpu_dist_backend()

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes; torch before 2.5 lacks ``torch.xpu.mem_get_info``."""
        if hasattr(torch.xpu, "mem_get_info"):
            return torch.xpu.mem_get_info()
        index = torch.xpu.current_device()
        total = torch.xpu.get_device_properties(index).total_memory
        return total - torch.xpu.memory_reserved(index), total
