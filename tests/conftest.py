import os

import pytest

# Tests see every installed plugin unless a test narrows it.
os.environ.pop("RUNTIME_PLUGINS", None)


@pytest.fixture
def plugin_manager():
    """A fresh process-wide plugin manager, restored afterwards."""
    from runtime import plugins

    saved = plugins._manager
    manager = plugins.PluginManager(plugins.parse_allow_list(os.environ.get(plugins.ALLOW_LIST_ENV)))
    plugins.reset_plugin_manager(manager)
    yield manager
    plugins.reset_plugin_manager(saved)
