"""The ROCm platform on a simulated AMD GPU: detection, selection, memory, Triton backend.

No AMD GPU is present: torch.version.hip and torch.cuda's queries are monkeypatched.
"""

import pathlib
import sys
import tomllib

import pytest
import torch

from runtime.attention.backend import select_attention_backend
from runtime.config import CacheConfig
from runtime.platforms import select_platform

import runtime_rocm
from runtime_rocm import triton_backend
from runtime_rocm import platform as rocm_platform
from runtime_rocm.platform import ACTIVATION_RESERVE_BYTES, RocmPlatform, rocm_device_count

GiB = 1 << 30
ROCM_DIR = pathlib.Path(__file__).resolve().parents[3] / "hardware" / "rocm"


def test_pyproject_entry_point():
    project = tomllib.loads((ROCM_DIR / "pyproject.toml").read_text())["project"]
    assert project["name"] == "runtime-plugin-rocm"
    assert project["entry-points"]["runtime"] == {"rocm": "runtime_rocm"}
    assert "runtime" in project["dependencies"]


def test_not_available_on_a_cpu_build_of_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 1)
    assert not RocmPlatform().is_available()
    assert rocm_device_count() == 0


def test_hip_build_without_devices(fake_amd_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 0)
    assert not RocmPlatform().is_available()


def test_detected_without_starting_hip(fake_amd_gpu, monkeypatch):
    platform = RocmPlatform()
    assert platform.is_available()  # fake_amd_gpu makes torch.cuda.init, device_count & co raise
    assert (platform.dist_backend, platform.default_attention_backend) == ("nccl", "triton")
    # the worker's device() may start HIP: it makes the local rank's GPU current
    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert platform.device(1) == torch.device("cuda", 1) and current == [1]
    with pytest.raises(ValueError, match="local rank 2 has no GPU; visible ROCm devices: 2"):
        platform.device(2)


def test_without_amdsmi_devices_are_counted_in_a_child_process(fake_amd_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: -1)
    seen = []
    monkeypatch.setattr(rocm_platform, "probe_in_subprocess", lambda envs: seen.append(envs) or 3)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1,2")
    assert rocm_device_count() == 3
    assert seen[0][0] == "0,1,2"


def test_probe_subprocess_reads_the_childs_count():
    # The child runs this machine's CPU build of torch: no devices.
    assert rocm_platform.probe_in_subprocess.__wrapped__((None, None, None)) == 0


def test_auto_detection_prefers_rocm_over_cpu(rocm_manager, fake_amd_gpu):
    assert select_platform().name == "rocm"
    assert select_platform("cpu").name == "cpu"  # --platform cpu still picks cpu


def test_without_a_device_cpu_is_chosen_and_rocm_is_refused(rocm_manager, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert select_platform().name == "cpu"
    with pytest.raises(ValueError, match="platform 'rocm' is installed but not available on this machine; available: cpu"):
        select_platform("rocm")


def test_kv_cache_budget_from_mem_get_info(fake_amd_gpu):
    platform = RocmPlatform()
    assert platform.total_memory_bytes() == 16 * GiB
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.9), model_memory_bytes=0)
    assert budget == int(16 * GiB * 0.9) - 4 * GiB - ACTIVATION_RESERVE_BYTES
    assert platform.kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=123456), 0) == 123456
    with pytest.raises(ValueError, match=r"4.00 GiB of 16.00 GiB are in use and gpu_memory_utilization=0.25"):
        platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.25), 0)


@pytest.fixture
def fake_triton_module(tmp_path, monkeypatch):
    """A stand-in for the Triton attention backend's module, found only through BACKEND_TARGETS."""
    package = tmp_path / "fake_triton_kernels_rocm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "attention.py").write_text(
        "class TritonAttentionBackend:\n    name = 'triton'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        triton_backend, "BACKEND_TARGETS", ("missing_pkg_for_test.attention:X", "fake_triton_kernels_rocm.attention:TritonAttentionBackend")
    )
    yield "fake_triton_kernels_rocm.attention"
    for name in ("fake_triton_kernels_rocm", "fake_triton_kernels_rocm.attention"):
        sys.modules.pop(name, None)


def test_triton_backend_registered_lazily_when_installed(fake_triton_module, fake_amd_gpu):
    from runtime import plugins

    manager = plugins.PluginManager(["cpu"])
    manager.register(runtime_rocm, "rocm", "0.1.0", "runtime-plugin-rocm")
    component = manager.registry("attention_backend").component("triton")
    assert component.plugin == "rocm"
    assert component.options["platforms"] == ["cuda", "rocm", "xpu"]
    assert fake_triton_module not in sys.modules  # found, not imported
    saved = plugins._manager
    plugins.reset_plugin_manager(manager)
    try:
        backend = select_attention_backend(None, select_platform(), torch.bfloat16, head_size=64)
    finally:
        plugins.reset_plugin_manager(saved)
    assert type(backend).__module__ == fake_triton_module and backend.name == "triton"


def test_no_triton_backend_installed_is_a_clear_error(fake_amd_gpu, monkeypatch):
    from runtime import plugins

    monkeypatch.setattr(triton_backend, "BACKEND_TARGETS", ("missing_pkg_for_test.attention:X",))
    assert triton_backend.find_backend_target() is None
    manager = plugins.PluginManager(["cpu"])
    manager.register(runtime_rocm, "rocm", "0.1.0", "runtime-plugin-rocm")
    assert "triton" not in manager.registry("attention_backend")
    assert manager.infos["rocm"].registered == {"platform": ["rocm"]}
    saved = plugins._manager
    plugins.reset_plugin_manager(manager)
    try:
        with pytest.raises(ValueError, match="unknown attention backend 'triton'.*runtime-plugin-cuda provides 'triton'"):
            select_attention_backend(None, select_platform(), torch.bfloat16, head_size=64)
    finally:
        plugins.reset_plugin_manager(saved)
