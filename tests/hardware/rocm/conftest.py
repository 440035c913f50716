"""ROCm plugin fixtures: a plugin manager with cpu + kernels + rocm, and a simulated AMD GPU."""

import pytest
import torch

from support.simulated_gpu import manager_with

GiB = 1 << 30


def _must_not_run(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"torch.cuda.{name} was called, which starts HIP")

    return fail


@pytest.fixture
def rocm_manager():
    """cpu and runtime-kernels from their entry points, rocm registered by hand under its distribution name."""
    yield from manager_with("runtime_rocm", "rocm", "runtime-plugin-rocm")


@pytest.fixture
def fake_amd_gpu(monkeypatch):
    """A HIP build of torch whose amdsmi sees two devices, 16 GiB each, 4 GiB in use.

    Everything that would start HIP raises, so detection is checked not to touch it;
    a test that goes on to pick a device or read memory patches those queries itself.
    """
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-simulated")
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (12 * GiB, 16 * GiB))
    for name in ("init", "_lazy_init", "current_device", "is_available", "device_count", "set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, _must_not_run(name))
