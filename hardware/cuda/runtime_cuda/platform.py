"""The CUDA platform: NVIDIA GPUs through a CUDA build of torch.

Detection must not initialize CUDA: the engine's front-end process picks the platform
and may later fork workers, and a process that has called ``cuInit`` cannot use CUDA
in a forked child. So :func:`cuda_device_count` asks NVML (``libnvidia-ml``, through
torch's ``_device_count_nvml``, which honours ``CUDA_VISIBLE_DEVICES``) and, if NVML
cannot be loaded, counts devices in a short-lived subprocess. Only
:meth:`CudaPlatform.device` (called in the worker) initializes CUDA.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import torch

from runtime.platforms import Platform
from runtime_cuda.memory import MemorySnapshot, activation_headroom, kv_cache_budget

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60


def cuda_device_count() -> int:
    """Visible CUDA devices, without initializing CUDA in this process."""
    if torch.version.cuda is None or torch.version.hip is not None:
        return 0  # a CPU-only or ROCm build of torch
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    nvml_count = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    if nvml_count >= 0:
        return nvml_count
    return _probe_in_subprocess(os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.cache
def _probe_in_subprocess(visible_devices: str | None) -> int:
    """``torch.cuda.device_count()`` in a child process, so that CUDA starts there only."""
    del visible_devices  # the cache key: the child inherits the environment
    code = "import torch; print(torch.cuda.device_count())"
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return int(result.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        logger.warning("could not count CUDA devices (NVML unavailable, probe failed: %s)", exc)
        return 0


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    priority = 10  # wins auto-detection over cpu (0)
    dist_backend = "nccl"
    default_attention_backend = "triton"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def is_available(self) -> bool:
        return cuda_device_count() > 0

    def device(self, local_rank: int = 0) -> torch.device:
        """The worker's GPU, made current (Triton launches on the current device).

        Also restarts the peak-memory statistics: the KV budget counts activation
        peaks from here on, not those of an earlier engine in the same process.
        """
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(f"local rank {local_rank} has no GPU; visible CUDA devices: {count}")
        torch.cuda.set_device(local_rank)
        torch.cuda.reset_peak_memory_stats(local_rank)
        return torch.device("cuda", local_rank)

    def total_memory_bytes(self) -> int:
        return torch.cuda.mem_get_info(torch.cuda.current_device())[1]

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes: int) -> int:
        if cache_config.kv_cache_memory_bytes:
            return cache_config.kv_cache_memory_bytes
        torch.cuda.synchronize()
        snapshot = MemorySnapshot.take(torch.cuda.current_device())
        budget = kv_cache_budget(
            snapshot, cache_config.gpu_memory_utilization, model_memory_bytes, activation_headroom(snapshot.total)
        )
        logger.info(
            "KV cache gets %.2f GiB of %.2f GiB (gpu_memory_utilization %.2f, model %.2f GiB)",
            budget / 2**30, snapshot.total / 2**30, cache_config.gpu_memory_utilization, model_memory_bytes / 2**30,
        )
        return budget

    def custom_ops(self) -> dict[str, Callable]:
        """The fused Triton ops of ``runtime_kernels`` that the models use on this platform.

        The model runner builds the model inside ``custom_ops_scope`` of this dict, so
        the norms, the SiLU MLP activation and the rotary embedding run these kernels
        (see ``Platform.custom_ops`` for the names and signatures): ``rms_norm``,
        ``fused_add_rms_norm``, ``rotary_embedding`` (in place, from a cos/sin cache),
        ``silu_and_mul``, ``gemv`` (one-row linear layers of batch-1 decode steps), and
        ``top_k_top_p`` for the sampler (top-p within top-k from one ``topk``, no sort).
        """
        from runtime_kernels.activation import silu_and_mul
        from runtime_kernels.gemv import gemv
        from runtime_kernels.norm import fused_add_rms_norm, rms_norm
        from runtime_kernels.rotary import rotary_embedding
        from runtime_kernels.sampling import top_k_top_p_bounded

        return {
            "rms_norm": rms_norm,
            "fused_add_rms_norm": fused_add_rms_norm,
            "rotary_embedding": rotary_embedding,
            "silu_and_mul": silu_and_mul,
            "gemv": gemv,
            "top_k_top_p": top_k_top_p_bounded,
        }

    def set_threads(self, *args, **kwargs) -> None:
        """GPU work needs no thread settings."""

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    supports_graphs = True

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], torch.Tensor], pool) -> Callable[[], torch.Tensor]:
        """Record ``fn`` into a CUDA graph; the replay returns the tensor ``fn`` returned during capture."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=pool):
            output = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
