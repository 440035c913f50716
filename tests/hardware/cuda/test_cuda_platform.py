"""The CUDA platform's registration, fork-safe detection and KV memory budget."""

from __future__ import annotations

import pytest
import torch

from runtime.platforms import select_platform
from runtime_cuda.memory import GIB, MemorySnapshot, activation_headroom, kv_cache_budget
from runtime_cuda.platform import CudaPlatform, cuda_device_count


def test_plugin_registers_platform_and_backends(plugin_manager):
    platform = plugin_manager.registry("platform").get("cuda")
    assert (platform.priority, platform.dist_backend, platform.default_attention_backend) == (10, "nccl", "triton")
    assert platform.priority > plugin_manager.registry("platform").get("cpu").priority
    backends = plugin_manager.registry("attention_backend")
    assert backends.component("triton").options["platforms"] == ["cuda", "rocm", "xpu"]
    assert backends.component("sdpa").options["platforms"] == ["cuda", "cpu"]
    assert backends.component("triton").plugin == "cuda"
    assert backends.get("sdpa")().name == "sdpa"


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU-only torch build")
def test_unavailable_without_cuda_and_cpu_still_wins(plugin_manager):
    assert cuda_device_count() == 0
    assert not CudaPlatform().is_available()
    assert select_platform().name == "cpu"
    with pytest.raises(ValueError, match="platform 'cuda' is installed but not available"):
        select_platform("cuda")


def test_detection_does_not_initialize_cuda():
    was_initialized = torch.cuda.is_initialized()
    CudaPlatform().is_available()
    assert torch.cuda.is_initialized() == was_initialized


def snapshot(total_gib=80, free_gib=78, reserved_gib=1.5, peak_gib=1.2) -> MemorySnapshot:
    return MemorySnapshot(int(total_gib * GIB), int(free_gib * GIB), int(reserved_gib * GIB), int(peak_gib * GIB))


def test_budget_takes_utilization_minus_model_context_and_activations():
    # 80 GiB card, 0.5 GiB outside torch (80 - 78 - 1.5), model 1.2 GiB, 2 GiB headroom.
    budget = kv_cache_budget(snapshot(), 0.9, model_bytes=int(1.2 * GIB), headroom=2 * GIB)
    assert budget == int(80 * GIB * 0.9) - int(0.5 * GIB) - int(1.2 * GIB) - 2 * GIB


def test_measured_peak_beyond_headroom_is_reserved():
    budget = kv_cache_budget(snapshot(peak_gib=6.2), 0.9, model_bytes=int(1.2 * GIB), headroom=2 * GIB)
    assert budget == int(80 * GIB * 0.9) - int(0.5 * GIB) - int(1.2 * GIB) - 5 * GIB


def test_no_memory_left_is_an_error_with_numbers():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.1 of 80.00 GiB allows 8.00 GiB.*model takes 7.00 GiB"):
        kv_cache_budget(snapshot(), 0.1, model_bytes=7 * GIB, headroom=2 * GIB)


def test_headroom_default_env_and_bad_env(monkeypatch):
    monkeypatch.delenv("RUNTIME_CUDA_ACTIVATION_HEADROOM_GIB", raising=False)
    assert activation_headroom(80 * GIB) == 2 * GIB
    assert activation_headroom(8 * GIB) == int(0.8 * GIB)  # small cards: 10%
    monkeypatch.setenv("RUNTIME_CUDA_ACTIVATION_HEADROOM_GIB", "0.5")
    assert activation_headroom(80 * GIB) == GIB // 2
    monkeypatch.setenv("RUNTIME_CUDA_ACTIVATION_HEADROOM_GIB", "lots")
    with pytest.raises(ValueError, match="must be a number of GiB, got 'lots'"):
        activation_headroom(80 * GIB)


def test_explicit_kv_cache_bytes_win():
    from runtime.config import CacheConfig

    assert CudaPlatform().kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=123456), 10) == 123456


def test_custom_ops_name_the_kernels():
    from runtime.models.ops import CUSTOM_OPS

    ops = CudaPlatform().custom_ops()
    assert sorted(ops) == ["fused_add_rms_norm", "gemv", "rms_norm", "rotary_embedding", "silu_and_mul", "top_k_top_p"]
    assert set(ops) == set(CUSTOM_OPS)  # every op the models know, none they would ignore
    assert ops["silu_and_mul"].__module__ == "runtime_kernels.activation"
    assert ops["gemv"].__module__ == "runtime_kernels.gemv"
    assert ops["top_k_top_p"].__module__ == "runtime_kernels.sampling"
