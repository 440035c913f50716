"""The ROCm platform on a simulated AMD GPU: detection, selection, memory, Triton backend.

No AMD GPU is present: torch.version.hip and torch.cuda's queries are monkeypatched.
The shared GpuPlatform logic is tested on its own in tests/platforms; here, that ROCm
wires it up: amdsmi, HIP's visible-device variables, the ``cuda`` device type.
"""

import pytest
import torch

from runtime.attention.backend import select_attention_backend
from runtime.config import CacheConfig
from runtime.platforms import gpu, select_platform

from runtime_kernels.attention_backend import TritonAttentionBackend
from runtime_rocm.platform import RocmPlatform

from support.simulated_gpu import check_device_makes_the_rank_current

GiB = 1 << 30


def test_not_available_on_a_cpu_build_of_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 1)
    assert not RocmPlatform().is_available()
    assert RocmPlatform().device_count() == 0


def test_hip_build_without_devices(fake_amd_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 0)
    assert not RocmPlatform().is_available()


def test_detected_without_starting_hip(fake_amd_gpu, monkeypatch):
    platform = RocmPlatform()
    assert platform.is_available()  # fake_amd_gpu makes torch.cuda.init, device_count & co raise
    assert (platform.dist_backend, platform.default_attention_backend, platform.priority) == ("nccl", "triton", 10)
    # the worker's device() may start HIP: it makes the local rank's GPU (torch.cuda, device "cuda") current
    check_device_makes_the_rank_current(monkeypatch, platform, "ROCm")


def test_without_amdsmi_devices_are_counted_in_a_child_process(fake_amd_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: -1)
    seen = []
    monkeypatch.setattr(gpu, "probe_in_subprocess", lambda device_type, envs: seen.append((device_type, envs)) or 3)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1,2")
    assert RocmPlatform().device_count() == 3
    device_type, envs = seen[0]
    assert device_type == "cuda" and envs[0] == "0,1,2"  # HIP builds count through torch.cuda


def test_auto_detection_prefers_rocm_over_cpu(rocm_manager, fake_amd_gpu):
    assert select_platform().name == "rocm"
    assert select_platform("cpu").name == "cpu"  # --platform cpu still picks cpu


def test_without_a_device_cpu_is_chosen_and_rocm_is_refused(rocm_manager, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert select_platform().name == "cpu"
    with pytest.raises(ValueError, match="platform 'rocm' is installed but not available on this machine; available: cpu"):
        select_platform("rocm")


def test_kv_cache_budget_from_a_memory_snapshot(fake_amd_gpu, monkeypatch):
    """4 GiB in use: torch holds 3 GiB (1 GiB weights), 1 GiB is outside torch."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1 * GiB)
    monkeypatch.delenv("RUNTIME_ROCM_ACTIVATION_HEADROOM_GIB", raising=False)
    platform = RocmPlatform()
    assert platform.total_memory_bytes() == 16 * GiB
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.9), model_memory_bytes=GiB)
    headroom = int(1.6 * GiB)  # 10 % of the card, below the 2 GiB default
    assert budget == int(16 * GiB * 0.9) - 1 * GiB - 1 * GiB - headroom
    assert platform.kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=123456), 0) == 123456
    with pytest.raises(ValueError, match=r"no GPU memory is left.*gpu_memory_utilization 0.2 of 16.00 GiB.*"
                                         r"lower RUNTIME_ROCM_ACTIVATION_HEADROOM_GIB"):
        platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.2), GiB)


def test_default_backend_is_runtime_kernels_triton(rocm_manager, fake_amd_gpu):
    assert rocm_manager.infos["rocm"].registered == {"platform": ["rocm"]}  # the backend is not its to register
    component = rocm_manager.registry("attention_backend").component("triton")
    assert component.plugin == "kernels" and "rocm" in component.options["platforms"]
    backend = select_attention_backend(None, select_platform(), torch.bfloat16, head_size=64)
    assert isinstance(backend, TritonAttentionBackend)


def test_without_runtime_kernels_the_default_backend_is_a_clear_error(fake_amd_gpu):
    import runtime_rocm
    from runtime import plugins

    manager = plugins.PluginManager(["cpu"])
    manager.register(runtime_rocm, "rocm", "0.1.0", "runtime-plugin-rocm")
    assert "triton" not in manager.registry("attention_backend")
    saved = plugins._manager
    plugins.reset_plugin_manager(manager)
    try:
        with pytest.raises(ValueError, match="unknown attention backend 'triton'.*runtime-kernels provides 'triton'"):
            select_attention_backend(None, select_platform(), torch.bfloat16, head_size=64)
    finally:
        plugins.reset_plugin_manager(saved)
