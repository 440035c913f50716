"""The XPU platform on a simulated Intel GPU: detection, selection, dist backend, memory.

No Intel GPU is present: torch.xpu's and torch.distributed's queries are monkeypatched.
"""

import pathlib
import tomllib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed

from runtime.config import CacheConfig
from runtime.platforms import select_platform

from runtime_xpu.platform import ACTIVATION_RESERVE_BYTES, XpuPlatform

GiB = 1 << 30
XPU_DIR = pathlib.Path(__file__).resolve().parents[3] / "hardware" / "xpu"


def test_pyproject_entry_point():
    project = tomllib.loads((XPU_DIR / "pyproject.toml").read_text())["project"]
    assert project["name"] == "runtime-plugin-xpu"
    assert project["entry-points"]["runtime"] == {"xpu": "runtime_xpu"}
    assert "runtime" in project["dependencies"]


def test_not_available_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert not XpuPlatform().is_available()


def test_detected_through_torch_xpu(fake_intel_gpu, monkeypatch):
    platform = XpuPlatform()
    assert platform.is_available()
    assert platform.default_attention_backend == "triton"
    current = []
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    monkeypatch.setattr(torch.xpu, "set_device", current.append)
    assert platform.device(1) == torch.device("xpu", 1) and current == [1]
    with pytest.raises(ValueError, match="local rank 2 has no GPU; visible XPU devices: 2"):
        platform.device(2)


def test_auto_detection_prefers_xpu_over_cpu(xpu_manager, fake_intel_gpu):
    assert select_platform().name == "xpu"
    assert select_platform("cpu").name == "cpu"


def test_without_a_device_cpu_is_chosen_and_xpu_is_refused(xpu_manager, monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert select_platform().name == "cpu"
    with pytest.raises(ValueError, match="platform 'xpu' is installed but not available on this machine; available: cpu"):
        select_platform("xpu")


def test_dist_backend_xccl_or_ccl(monkeypatch):
    platform = XpuPlatform()
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: True, raising=False)
    assert platform.dist_backend == "xccl"
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: False)
    assert platform.dist_backend == "ccl"
    monkeypatch.delattr(torch.distributed, "is_xccl_available")  # torch before 2.8
    assert platform.dist_backend == "ccl"


def test_kv_cache_budget_from_mem_get_info(fake_intel_gpu):
    platform = XpuPlatform()
    assert platform.total_memory_bytes() == 32 * GiB
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.5), model_memory_bytes=0)
    assert budget == 16 * GiB - 8 * GiB - ACTIVATION_RESERVE_BYTES
    assert platform.kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=4096), 0) == 4096
    with pytest.raises(ValueError, match="no device memory left for the KV cache"):
        platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.2), 0)


def test_memory_without_mem_get_info(monkeypatch):
    """Older torch: total from the device properties, free = total - reserved."""
    monkeypatch.delattr(torch.xpu, "mem_get_info", raising=False)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 0)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda index: SimpleNamespace(total_memory=10 * GiB))
    monkeypatch.setattr(torch.xpu, "memory_reserved", lambda index: 2 * GiB)
    platform = XpuPlatform()
    assert platform.total_memory_bytes() == 10 * GiB
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=1.0), 0)
    assert budget == 8 * GiB - ACTIVATION_RESERVE_BYTES
