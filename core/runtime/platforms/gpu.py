"""What the GPU platforms (CUDA, ROCm, XPU) share: detection, device, KV cache memory.

torch drives each of these GPUs through a device module, ``torch.<device_type>``
(``torch.cuda`` for CUDA and for HIP builds, ``torch.xpu`` for Intel), with the same
queries. A platform plugin subclasses :class:`GpuPlatform` and sets only what differs:
its name, priority, collective backend, the ``torch.version`` attribute of the torch
builds that drive it and the function that counts its devices without starting the
device runtime.

Detection must not start the device runtime: the engine's front-end process picks the
platform and may later fork workers, and a process that has started CUDA (or HIP) cannot
use it in a forked child. So :meth:`GpuPlatform.device_count` asks a management
library (NVML, amdsmi) through ``count_hook`` and, when that is missing, counts devices
in a short-lived child process. Only :meth:`GpuPlatform.device`, called in the worker,
starts the runtime.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys

import torch

from runtime.platforms import Platform
from runtime.platforms.gpu_memory import GIB, MemorySnapshot, activation_headroom, kv_cache_budget

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60


@functools.cache
def probe_in_subprocess(device_type: str, visible_devices: tuple[str | None, ...]) -> int:
    """``torch.<device_type>.device_count()`` in a child process, so that the runtime starts there only."""
    del visible_devices  # only the cache key: the child inherits the environment
    code = f"import torch; print(torch.{device_type}.device_count())"
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return int(result.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        logger.warning("could not count torch.%s devices in a child process: %s", device_type, exc)
        return 0


class GpuPlatform(Platform):
    """A GPU that torch drives through ``torch.<device_type>`` (see the module docstring)."""

    device_type = "cuda"
    priority = 10  # any GPU wins auto-detection over cpu (0)
    default_attention_backend = "triton"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    label = "GPU"  # the device kind in messages: "visible CUDA devices: 2"
    torch_build: str | None = None  # the torch.version attribute set by builds for this GPU (None: any)
    count_hook: str | None = None  # torch.<device_type> function counting devices without the runtime, -1 if unable
    visible_devices_envs: tuple[str, ...] = ()  # variables that change what the child-process probe sees

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        # Weights that name no dtype (a GGUF file's blocks) run in bfloat16, as vLLM's auto takes
        # a 16-bit type for them: float32 would double their memory and time. (Asking the device
        # whether it computes bfloat16 would start the GPU runtime in this process, before workers fork.)
        return torch.bfloat16 if config_dtype is None else config_dtype

    @property
    def torch_module(self):
        """``torch.cuda`` or ``torch.xpu``: where the device queries live."""
        return getattr(torch, self.device_type)

    @property
    def headroom_env(self) -> str:
        """The variable that sets the activation headroom of the KV budget, in GiB."""
        return f"RUNTIME_{self.name.upper()}_ACTIVATION_HEADROOM_GIB"

    # ---------------------------------------------------------------- detection
    def is_available(self) -> bool:
        return self.device_count() > 0

    def is_torch_build(self) -> bool:
        """Whether this torch was built for this kind of GPU."""
        return self.torch_build is None or bool(getattr(torch.version, self.torch_build, None))

    def device_count(self) -> int:
        """Visible devices, without starting the device runtime in this process."""
        module = getattr(torch, self.device_type, None)
        if module is None or not self.is_torch_build():
            return 0
        if module.is_initialized():
            return module.device_count()
        count = getattr(module, self.count_hook, lambda: -1)() if self.count_hook else -1
        if count >= 0:
            return count
        return probe_in_subprocess(self.device_type, tuple(os.environ.get(n) for n in self.visible_devices_envs))

    # ---------------------------------------------------------------- the worker's device
    def device(self, local_rank: int = 0) -> torch.device:
        """The worker's GPU, made current (Triton launches on the current device); starts the runtime.

        Also restarts the peak-memory statistics: the KV budget counts activation
        peaks from here on, not those of an earlier engine in the same process.
        """
        module = self.torch_module
        count = module.device_count()
        if not 0 <= local_rank < count:
            valid = f"0 to {count - 1}" if count else "none"
            raise ValueError(
                f"local rank {local_rank} has no GPU; visible {self.label} devices: {count} (valid local ranks: {valid})"
            )
        module.set_device(local_rank)
        module.reset_peak_memory_stats(local_rank)
        return torch.device(self.device_type, local_rank)

    def synchronize(self) -> None:
        self.torch_module.synchronize()

    # ---------------------------------------------------------------- memory
    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the current device, as the driver sees them."""
        return self.torch_module.mem_get_info()

    def memory_snapshot(self) -> MemorySnapshot:
        """The current device's memory, for the KV budget."""
        free, total = self.mem_get_info()
        module = self.torch_module
        return MemorySnapshot(total, free, module.memory_reserved(), module.max_memory_allocated())

    def total_memory_bytes(self) -> int:
        return self.mem_get_info()[1]

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        """``kv_cache_memory_bytes`` when set, else the budget of :mod:`runtime.platforms.gpu_memory`."""
        if cache_config.kv_cache_memory_bytes:
            return cache_config.kv_cache_memory_bytes
        self.synchronize()
        snapshot = self.memory_snapshot()
        utilization = cache_config.gpu_memory_utilization
        headroom = activation_headroom(snapshot.total, self.headroom_env)
        budget = kv_cache_budget(snapshot, utilization, model_memory_bytes, headroom, self.headroom_env)
        logger.info(
            "KV cache gets %.2f GiB of %.2f GiB (gpu_memory_utilization %.2f, model %.2f GiB)",
            budget / GIB, snapshot.total / GIB, utilization, model_memory_bytes / GIB,
        )
        return budget
