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


def make_distribution(root, dist_name: str, ep_name: str, module_name: str, source: str, version: str = "0.1"):
    """Write an installed-looking distribution (dist-info with an entry point) under ``root``."""
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[runtime]\n{ep_name} = {module_name}\n")
    (root / f"{module_name}.py").write_text(source)
