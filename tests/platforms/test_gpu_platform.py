"""The GpuPlatform base shared by cuda, rocm and xpu, on a simulated torch.cuda.

No GPU is present: the device module's queries are monkeypatched, and everything that
would start the device runtime raises unless a test says otherwise.
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import CacheConfig
from runtime.platforms import gpu
from runtime.platforms.gpu import GpuPlatform
from runtime.platforms.gpu_memory import GIB

from support.simulated_gpu import check_device_makes_the_rank_current

HEADROOM_ENV = "RUNTIME_SIMGPU_ACTIVATION_HEADROOM_GIB"


class SimGpu(GpuPlatform):
    name = "simgpu"
    device_type = "cuda"
    label = "SIM"
    torch_build = "simgpu"
    count_hook = "_device_count_sim"
    visible_devices_envs = ("SIM_VISIBLE_DEVICES",)


def _must_not_run(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"torch.cuda.{name} was called, which starts the device runtime")

    return fail


@pytest.fixture
def sim(monkeypatch):
    """A torch build for "simgpu" whose management library sees 2 devices; nothing starts the runtime."""
    monkeypatch.setattr(torch.version, "simgpu", "1.0", raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_sim", lambda: 2, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("init", "_lazy_init", "current_device", "device_count", "set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, _must_not_run(name))
    monkeypatch.delenv(HEADROOM_ENV, raising=False)
    return monkeypatch


def test_detection_counts_through_the_hook_without_starting_the_runtime(sim):
    platform = SimGpu()
    assert platform.device_count() == 2 and platform.is_available()
    assert (platform.priority, platform.default_attention_backend) == (10, "triton")
    assert platform.headroom_env == HEADROOM_ENV


def test_auto_dtype_runs_weights_without_a_dtype_in_bfloat16_without_starting_the_runtime(sim):
    """--dtype auto: a GGUF file's blocks name no dtype and run in bfloat16; a checkpoint's own dtype stays."""
    platform = SimGpu()
    assert platform.default_dtype(None) == torch.bfloat16
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert platform.default_dtype(dtype) == dtype


def test_other_torch_builds_see_no_device(sim):
    sim.setattr(torch.version, "simgpu", None)
    assert SimGpu().device_count() == 0 and not SimGpu().is_available()


def test_an_initialized_runtime_is_asked_directly(sim):
    sim.setattr(torch.cuda, "is_initialized", lambda: True)
    sim.setattr(torch.cuda, "device_count", lambda: 5)
    assert SimGpu().device_count() == 5


def test_without_the_hook_devices_are_counted_in_a_child_process(sim):
    sim.setattr(torch.cuda, "_device_count_sim", lambda: -1)
    seen = []
    sim.setattr(gpu, "probe_in_subprocess", lambda device_type, envs: seen.append((device_type, envs)) or 3)
    sim.setenv("SIM_VISIBLE_DEVICES", "0,1,2")
    assert SimGpu().device_count() == 3
    assert seen == [("cuda", ("0,1,2",))]


def test_probe_subprocess_reads_the_childs_count():
    # The child runs this machine's CPU build of torch: no devices.
    assert gpu.probe_in_subprocess.__wrapped__("cuda", (None,)) == 0


def test_device_makes_the_local_rank_current_and_checks_it(sim):
    check_device_makes_the_rank_current(sim, SimGpu(), "SIM")
    sim.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"visible SIM devices: 0 \(valid local ranks: none\)"):
        SimGpu().device(0)


def test_kv_cache_budget_from_a_memory_snapshot(sim):
    """16 GiB card, 12 GiB free, torch holds 3 GiB (peak 2.5 GiB), model 2 GiB: 1 GiB outside torch."""
    synced = []
    sim.setattr(torch.cuda, "synchronize", lambda: synced.append(True))
    sim.setattr(torch.cuda, "mem_get_info", lambda device=None: (12 * GIB, 16 * GIB))
    sim.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GIB)
    sim.setattr(torch.cuda, "max_memory_allocated", lambda device=None: int(2.5 * GIB))
    platform = SimGpu()
    assert platform.total_memory_bytes() == 16 * GIB
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.9), model_memory_bytes=2 * GIB)
    headroom = int(1.6 * GIB)  # 10 % of a small card, below the 2 GiB default
    assert budget == int(16 * GIB * 0.9) - 1 * GIB - 2 * GIB - headroom
    assert synced == [True]  # pending work finished before memory was read
    sim.setenv(HEADROOM_ENV, "4")
    budget = platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.9), model_memory_bytes=2 * GIB)
    assert budget == int(16 * GIB * 0.9) - 1 * GIB - 2 * GIB - 4 * GIB
    with pytest.raises(ValueError, match=f"no GPU memory is left for the KV cache.*lower {HEADROOM_ENV}"):
        platform.kv_cache_memory_bytes(CacheConfig(gpu_memory_utilization=0.25), model_memory_bytes=2 * GIB)


def test_explicit_kv_cache_bytes_win_without_touching_the_device(sim):
    assert SimGpu().kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=123456), 10) == 123456
