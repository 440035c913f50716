"""CLI and selection tests (the README's test set-up installs every hardware plugin)."""

import pytest


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
