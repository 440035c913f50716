"""The XPU platform on a simulated Intel GPU: detection, selection, dist backend, memory.

No Intel GPU is present: torch.xpu's and torch.distributed's queries are monkeypatched.
The shared GpuPlatform logic is tested on its own in tests/platforms; here, that XPU
wires it up over torch.xpu, with its own collective backend and older-torch memory query.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed

from runtime.attention.backend import select_attention_backend
from runtime.config import CacheConfig
from runtime.platforms import select_platform

from runtime_kernels.attention_backend import TritonAttentionBackend
from runtime_xpu.platform import XpuPlatform

from support.simulated_gpu import check_device_makes_the_rank_current

GiB = 1 << 30
HEADROOM_ENV = "RUNTIME_XPU_ACTIVATION_HEADROOM_GIB"


def test_not_available_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 0)
    assert not XpuPlatform().is_available()


def test_detected_through_torch_xpu(fake_intel_gpu, monkeypatch):
    platform = XpuPlatform()
    assert platform.is_available()
    assert (platform.default_attention_backend, platform.priority) == ("triton", 5)
    check_device_makes_the_rank_current(monkeypatch, platform, "XPU")  # on torch.xpu, device "xpu"


def test_auto_detection_prefers_xpu_over_cpu(xpu_manager, fake_intel_gpu):
    assert select_platform().name == "xpu"
    assert select_platform("cpu").name == "cpu"


def test_without_a_device_cpu_is_chosen_and_xpu_is_refused(xpu_manager, monkeypatch):
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 0)
    assert select_platform().name == "cpu"
    with pytest.raises(ValueError, match="platform 'xpu' is installed but not available on this machine; available: cpu"):
        select_platform("xpu")


def test_default_backend_is_runtime_kernels_triton(xpu_manager, fake_intel_gpu):
    assert xpu_manager.infos["xpu"].registered == {"platform": ["xpu"]}  # the backend is not its to register
    assert xpu_manager.registry("attention_backend").component("triton").plugin == "kernels"
    backend = select_attention_backend(None, select_platform(), torch.float16, head_size=64)
    assert isinstance(backend, TritonAttentionBackend)


def test_dist_backend_xccl_or_ccl(monkeypatch):
    platform = XpuPlatform()
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: True, raising=False)
    assert platform.dist_backend == "xccl"
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: False)
    assert platform.dist_backend == "ccl"
    monkeypatch.delattr(torch.distributed, "is_xccl_available")  # torch before 2.8
    assert platform.dist_backend == "ccl"


def test_kv_cache_budget_from_a_memory_snapshot(fake_intel_gpu, monkeypatch):
    """8 GiB in use, 6 GiB of it held by torch (4 GiB weights): 2 GiB outside torch; peak 1 GiB above the weights."""
    monkeypatch.delenv(HEADROOM_ENV, raising=False)
    platform = XpuPlatform()
    assert platform.total_memory_bytes() == 32 * GiB
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.5), model_memory_bytes=4 * GiB)
    assert budget == 16 * GiB - 2 * GiB - 4 * GiB - 2 * GiB  # the 2 GiB default headroom beats the 1 GiB peak
    assert platform.kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=4096), 0) == 4096
    with pytest.raises(ValueError, match=f"no GPU memory is left for the KV cache.*lower {HEADROOM_ENV}"):
        platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.2), 4 * GiB)


def test_memory_without_mem_get_info(fake_intel_gpu, monkeypatch):
    """Older torch: total from the device properties, free = total - reserved."""
    monkeypatch.delattr(torch.xpu, "mem_get_info", raising=False)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 0)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda index: SimpleNamespace(total_memory=10 * GiB))
    monkeypatch.setattr(torch.xpu, "memory_reserved", lambda index=None: 2 * GiB)
    monkeypatch.setattr(torch.xpu, "max_memory_allocated", lambda index=None: 0)
    monkeypatch.setenv(HEADROOM_ENV, "0.5")
    platform = XpuPlatform()
    assert platform.total_memory_bytes() == 10 * GiB
    assert platform.mem_get_info() == (8 * GiB, 10 * GiB)
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=1.0), 0)
    assert budget == 10 * GiB - GiB // 2  # nothing outside torch: free = total - reserved
