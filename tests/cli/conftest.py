"""CLI and selection tests: the GPU plugins are pure Python, imported from the source tree when not installed."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for module, folder in (("runtime_rocm", "hardware/rocm"), ("runtime_xpu", "hardware/xpu")):
    if importlib.util.find_spec(module) is None:
        sys.path.insert(0, str(ROOT / folder))


@pytest.fixture
def unloaded_manager(monkeypatch):
    """No process-wide plugin manager yet, so the command loads one as a fresh process would."""
    from runtime import plugins

    # setenv records the original state, so a value that a command sets is undone too
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "")
    monkeypatch.delenv(plugins.ALLOW_LIST_ENV)
    saved = plugins._manager
    plugins.reset_plugin_manager(None)
    yield
    plugins.reset_plugin_manager(saved)
