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
        raise AssertionError(f"torch.cuda.{name} was called, which starts HIP")

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
    """A HIP build of torch whose amdsmi sees two devices, 16 GiB each, 4 GiB in use.

    Everything that would start HIP raises, so detection is checked not to touch it;
    a test that goes on to pick a device patches ``device_count`` itself.
    """
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-simulated")
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (12 * GiB, 16 * GiB))
    for name in ("init", "_lazy_init", "current_device", "is_available", "device_count", "set_device"):
        monkeypatch.setattr(torch.cuda, name, _must_not_run(name))
