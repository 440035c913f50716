"""XPU plugin fixtures: a plugin manager with cpu + xpu, and a simulated Intel GPU.

runtime_xpu is pure Python: when it is not installed, it is imported from the source tree.
"""

import importlib.util
import pathlib
import sys

import pytest
import torch

if importlib.util.find_spec("runtime_xpu") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "hardware" / "xpu"))

GiB = 1 << 30


@pytest.fixture
def xpu_manager():
    """cpu from its entry point, xpu registered by hand under its distribution name."""
    import runtime_xpu
    from runtime import plugins

    saved = plugins._manager
    manager = plugins.PluginManager(["cpu"])
    manager.register(runtime_xpu, "xpu", "0.1.0", "runtime-plugin-xpu")
    plugins.reset_plugin_manager(manager)
    yield manager
    plugins.reset_plugin_manager(saved)


@pytest.fixture
def fake_intel_gpu(monkeypatch):
    """torch.xpu with one device of 32 GiB, 8 GiB in use."""
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda device=None: (24 * GiB, 32 * GiB), raising=False)
