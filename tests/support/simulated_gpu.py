"""Helpers for the GPU platforms' tests on a machine without their GPU (simulated devices)."""

from __future__ import annotations

import importlib

import pytest
import torch


def manager_with(module: str, name: str, distribution: str, entry_points=("cpu", "kernels")):
    """For a fixture to ``yield from``: the process-wide plugin manager with ``entry_points`` loaded
    as installed and the plugin ``module`` registered by hand under ``name`` and its distribution;
    the previous manager is restored afterwards."""
    from runtime import plugins

    saved = plugins._manager
    manager = plugins.PluginManager(list(entry_points))
    manager.register(importlib.import_module(module), name, "0.1.0", distribution)
    plugins.reset_plugin_manager(manager)
    try:
        yield manager
    finally:
        plugins.reset_plugin_manager(saved)


def check_device_makes_the_rank_current(monkeypatch, platform, label: str) -> None:
    """With 2 devices, ``platform.device(1)`` makes rank 1 current on its torch device module and
    restarts its peak-memory statistics; rank 2 is an error naming ``label`` and the count."""
    module, calls = platform.torch_module, []
    monkeypatch.setattr(module, "device_count", lambda: 2)
    monkeypatch.setattr(module, "set_device", lambda rank: calls.append(("set_device", rank)))
    monkeypatch.setattr(module, "reset_peak_memory_stats", lambda rank: calls.append(("reset_peak", rank)))
    assert platform.device(1) == torch.device(platform.device_type, 1)
    assert calls == [("set_device", 1), ("reset_peak", 1)]
    with pytest.raises(ValueError, match=rf"local rank 2 has no GPU; visible {label} devices: 2 \(valid local ranks: 0 to 1\)"):
        platform.device(2)
