"""ROCm plugin fixtures: a plugin manager with cpu + rocm, and a simulated AMD GPU.

runtime_rocm is pure Python: when it is not installed, it is imported from the source tree.
"""

import importlib.util
import pathlib
import sys

import pytest
import torch

if importlib.util.find_spec("runtime_rocm") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "hardware" / "rocm"))

GiB = 1 << 30


def _must_not_run(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"platform detection called torch.cuda.{name}, which initializes HIP")

    return fail


@pytest.fixture
def rocm_manager():
    """cpu from its entry point, rocm registered by hand under its distribution name."""
    import runtime_rocm
    from runtime import plugins

    saved = plugins._manager
    manager = plugins.PluginManager(["cpu"])
    manager.register(runtime_rocm, "rocm", "0.1.0", "runtime-plugin-rocm")
    plugins.reset_plugin_manager(manager)
    yield manager
    plugins.reset_plugin_manager(saved)


@pytest.fixture
def fake_amd_gpu(monkeypatch):
    """A HIP build of torch with two devices, 16 GiB each, 4 GiB in use; no HIP initialization allowed."""
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-simulated")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (12 * GiB, 16 * GiB))
    for name in ("init", "_lazy_init", "current_device", "is_available"):
        monkeypatch.setattr(torch.cuda, name, _must_not_run(name))
