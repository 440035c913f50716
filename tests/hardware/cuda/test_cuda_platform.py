"""The CUDA platform's registration, fork-safe detection and KV memory budget.

Detection and the budget's arithmetic are the shared GpuPlatform's (tests/platforms);
here: what CUDA sets, and its own custom ops.
"""

from __future__ import annotations

import pytest
import torch

from runtime.platforms import select_platform
from runtime.plugins import BUILTIN_PLUGIN_NAME
from runtime.platforms.gpu import GpuPlatform
from runtime_cuda.platform import CudaPlatform


def test_plugin_registers_the_platform_and_finds_its_backends(plugin_manager):
    platform = plugin_manager.registry("platform").get("cuda")
    assert isinstance(platform, GpuPlatform)
    assert (platform.priority, platform.dist_backend, platform.default_attention_backend) == (10, "nccl", "triton")
    assert platform.priority > plugin_manager.registry("platform").get("cpu").priority
    assert plugin_manager.infos["cuda"].registered == {"platform": ["cuda"]}
    backends = plugin_manager.registry("attention_backend")
    assert backends.component("triton").plugin == "kernels"  # runtime-kernels, once for every GPU platform
    assert backends.component("triton").options["platforms"] == ["cuda", "rocm", "xpu"]
    assert backends.component("sdpa").plugin == BUILTIN_PLUGIN_NAME  # core's reference, every platform
    assert backends.component("sdpa").options.get("platforms") is None
    assert backends.get("sdpa")().name == "sdpa"


def test_counts_through_nvml_on_cuda_builds_only(monkeypatch):
    platform = CudaPlatform()
    assert (platform.count_hook, platform.visible_devices_envs, platform.headroom_env) == (
        "_device_count_nvml", ("CUDA_VISIBLE_DEVICES",), "RUNTIME_CUDA_ACTIVATION_HEADROOM_GIB"
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8-simulated")
    monkeypatch.setattr(torch.version, "hip", "6.2-simulated")  # a ROCm build reports both
    assert not platform.is_torch_build() and platform.device_count() == 0
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 4)
    assert platform.device_count() == 4 and platform.is_available()


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU-only torch build")
def test_unavailable_without_cuda_and_cpu_still_wins(plugin_manager):
    assert CudaPlatform().device_count() == 0
    assert not CudaPlatform().is_available()
    assert select_platform().name == "cpu"
    with pytest.raises(ValueError, match="platform 'cuda' is installed but not available"):
        select_platform("cuda")


def test_detection_does_not_initialize_cuda():
    was_initialized = torch.cuda.is_initialized()
    CudaPlatform().is_available()
    assert torch.cuda.is_initialized() == was_initialized


def test_explicit_kv_cache_bytes_win():
    from runtime.config import CacheConfig

    assert CudaPlatform().kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=123456), 10) == 123456


def test_custom_ops_name_the_kernels():
    from runtime.models.ops import CUSTOM_OPS

    ops = CudaPlatform().custom_ops()
    assert sorted(ops) == ["apply_token_bitmask", "argmax", "fused_add_rms_norm", "gemv", "rms_norm", "rms_norm_gemv",
                           "rotary_embedding", "silu_and_mul", "silu_and_mul_gemv", "top_k_top_p"]
    assert set(ops) == set(CUSTOM_OPS)  # every op the models know, none they would ignore
    assert ops["silu_and_mul"].__module__ == "runtime_kernels.activation"
    assert ops["gemv"].__module__ == ops["silu_and_mul_gemv"].__module__ == ops["rms_norm_gemv"].__module__ == "runtime_kernels.gemv"
    assert ops["top_k_top_p"].__module__ == ops["argmax"].__module__ == "runtime_kernels.sampling"
    assert ops["apply_token_bitmask"].__module__ == "runtime_kernels.bitmask"
