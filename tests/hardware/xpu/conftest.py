"""XPU plugin fixtures: a plugin manager with cpu + kernels + xpu, and a simulated Intel GPU."""

import pytest
import torch

from support.simulated_gpu import manager_with

GiB = 1 << 30


@pytest.fixture
def xpu_manager():
    """cpu and runtime-kernels from their entry points, xpu registered by hand under its distribution name."""
    yield from manager_with("runtime_xpu", "xpu", "runtime-plugin-xpu")


@pytest.fixture
def fake_intel_gpu(monkeypatch):
    """torch.xpu with one device of 32 GiB, 8 GiB in use (6 GiB of it held by torch)."""
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "synchronize", lambda: None)
    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda device=None: (24 * GiB, 32 * GiB), raising=False)
    monkeypatch.setattr(torch.xpu, "memory_reserved", lambda device=None: 6 * GiB)
    monkeypatch.setattr(torch.xpu, "max_memory_allocated", lambda device=None: 5 * GiB)
