"""The ROCm platform: AMD GPUs, which a HIP build of torch exposes as ``torch.cuda``.

Detection must not start the HIP runtime: the front-end process picks the platform
and may fork workers later, and HIP, like CUDA, cannot be used in a child forked
after it started. :func:`rocm_device_count` therefore asks amdsmi (through torch's
``_device_count_amdsmi``, which honours ``HIP_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES``)
and, when amdsmi is missing, counts devices in a short-lived child process.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys

import torch

from runtime.platforms import Platform

logger = logging.getLogger(__name__)

# Kept free for activations until the model runner profiles a forward pass.
ACTIVATION_RESERVE_BYTES = 512 << 20
PROBE_TIMEOUT_S = 60
VISIBLE_DEVICES_ENVS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def rocm_device_count() -> int:
    """Visible AMD GPUs, without starting HIP in this process; 0 on non-HIP builds."""
    if not getattr(torch.version, "hip", None):
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    count = getattr(torch.cuda, "_device_count_amdsmi", lambda: -1)()
    if count >= 0:
        return count
    return probe_in_subprocess(tuple(os.environ.get(name) for name in VISIBLE_DEVICES_ENVS))


@functools.cache
def probe_in_subprocess(visible_devices: tuple[str | None, ...]) -> int:
    """``torch.cuda.device_count()`` in a child process, so that HIP starts there only."""
    del visible_devices  # only the cache key: the child inherits the environment
    code = "import torch; print(torch.cuda.device_count())"
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return int(result.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        logger.warning("could not count ROCm devices (amdsmi unavailable, probe failed: %s)", exc)
        return 0


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
        return rocm_device_count() > 0

    def device(self, local_rank: int = 0) -> torch.device:
        """The worker's GPU, made current (Triton launches on the current device); starts HIP."""
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(f"local rank {local_rank} has no GPU; visible ROCm devices: {count}")
        torch.cuda.set_device(local_rank)
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
