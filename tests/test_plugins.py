"""Plugin discovery, allow-lists, conflicts and error messages."""

import json
import sys

import pluggy
import pytest

from runtime import hookimpl, plugins
from runtime.cli.main import main as cli_main
from runtime.platforms import Platform, select_platform

from support.fake_components import FakeBackend
from support.plugin_dists import make_distribution


class FakePlatform(Platform):
    name = "fake"
    device_type = "cpu"
    priority = 100

    def is_available(self):
        return True

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):
        return 1 << 20


class FakePlugin:
    @hookimpl
    def register_platforms(self, register):
        register(FakePlatform())

    @hookimpl
    def register_attention_backends(self, register):
        register("fake_attn", FakeBackend, platforms=["fake"])


@pytest.fixture
def fake_plugin(plugin_manager):
    plugin_manager.register(FakePlugin(), "fake-plugin", "1.2.3")
    yield plugin_manager
    plugin_manager.unregister("fake-plugin")


def test_builtins_and_cpu_plugin_register(plugin_manager):
    assert "LlamaForCausalLM" in plugin_manager.registry("model")
    assert "uniproc" in plugin_manager.registry("executor")
    assert plugin_manager.registry("platform").component("cpu").plugin == "cpu"
    assert plugin_manager.registry("attention_backend").component("cpu_paged").options["platforms"] == ["cpu"]


def test_plugin_defined_in_a_test_is_selected_by_priority(fake_plugin):
    assert select_platform().name == "fake"
    assert select_platform("cpu").name == "cpu"
    assert fake_plugin.infos["fake-plugin"].registered == {"platform": ["fake"], "attention_backend": ["fake_attn"]}


def test_unregister_removes_components(fake_plugin):
    fake_plugin.unregister("fake-plugin")
    assert "fake" not in fake_plugin.registry("platform")
    assert select_platform().name == "cpu"


def test_unknown_name_lists_installed_and_providers(monkeypatch):
    # Only the CPU plugin loads, whatever else is installed here.
    manager = plugins.PluginManager(["cpu"])
    with pytest.raises(ValueError) as err:
        manager.registry("attention_backend").get("triton")
    msg = str(err.value)
    assert "unknown attention backend 'triton'; installed: cpu_paged" in msg
    assert "runtime-kernels provides 'triton'" in msg
    plugins.reset_plugin_manager(manager)
    try:
        with pytest.raises(ValueError, match="unknown platform 'tpu'; installed: cpu"):
            select_platform("tpu")
    finally:
        plugins.reset_plugin_manager(None)


def test_two_plugins_registering_one_name_is_an_error(plugin_manager):
    class Duplicate:
        @hookimpl
        def register_platforms(self, register):
            from runtime_cpu.platform import CpuPlatform

            register(CpuPlatform())

    with pytest.raises(plugins.PluginError, match="'cpu' is registered by two plugins: 'cpu' and 'dup'"):
        plugin_manager.register(Duplicate(), "dup")


def test_allow_list_empty_loads_none(monkeypatch):
    manager = plugins.PluginManager(plugins.parse_allow_list(""))
    assert "cpu" not in manager.registry("platform")
    assert "LlamaForCausalLM" in manager.registry("model")  # built-ins always load
    assert plugins.parse_allow_list(None) is None
    assert plugins.parse_allow_list(" cpu , x ") == ["cpu", "x"]


def test_allow_list_unknown_name_is_an_error():
    with pytest.raises(plugins.PluginError, match="not installed: nope; installed: .*cpu"):
        plugins.PluginManager(["nope"])


def test_broken_plugin_is_reported_by_name(tmp_path, monkeypatch):
    make_distribution(tmp_path, "runtime-plugin-broken", "broken", "broken_plugin_mod", "raise ImportError('missing libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(plugins.PluginError, match=r"plugin 'broken' \(broken_plugin_mod\) failed to load: ImportError: missing libfoo"):
        plugins.PluginManager(None)
    # the allow-list keeps a broken plugin out
    manager = plugins.PluginManager(["cpu"])
    assert "cpu" in manager.registry("platform")
    sys.modules.pop("broken_plugin_mod", None)


def test_entry_point_plugin_with_version(tmp_path, monkeypatch):
    source = (
        "import pluggy\nfrom runtime.platforms import Platform\n"
        "hookimpl = pluggy.HookimplMarker('runtime')\n"
        "class P(Platform):\n    name = 'ep'\n    def is_available(self):\n        return False\n"
        "    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):\n        return 0\n"
        "@hookimpl\ndef register_platforms(register):\n    register(P())\n"
    )
    make_distribution(tmp_path, "runtime-plugin-ep", "ep", "ep_plugin_mod", source, version="2.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = plugins.PluginManager(["ep"])
    info = manager.infos["ep"]
    assert (info.distribution, info.version) == ("runtime-plugin-ep", "2.0")
    plugins.reset_plugin_manager(manager)
    try:
        with pytest.raises(ValueError, match="'ep' is installed but not available"):
            select_platform("ep")
    finally:
        plugins.reset_plugin_manager(None)
        sys.modules.pop("ep_plugin_mod", None)


def test_plugins_command_json(plugin_manager, capsys):
    assert cli_main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["cpu"]["registered"]["platform"] == ["cpu"]
    assert rows["cpu"]["distribution"] == "runtime-plugin-cpu"
    assert "register_platforms" in rows["cpu"]["hooks"]
    assert cli_main(["plugins", "--hook", "register_models"]) == 0
    out = capsys.readouterr().out
    assert "runtime (built-in)" in out and "cpu" not in out.split("\n")[0]
    assert cli_main(["plugins", "--hook", "register_nothing"]) == 2
    assert "unknown hook 'register_nothing'" in capsys.readouterr().err


def test_register_routes_adds_plugin_routes(plugin_manager):
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from runtime.entrypoints.openai.api_server import build_app
    from runtime.metrics import EngineMetrics

    class RoutesPlugin:
        @hookimpl
        def register_routes(self, app):
            @app.get("/plugin/hello")
            def hello():
                return {"hello": "from a plugin"}

    plugin_manager.register(RoutesPlugin(), "routes-plugin")
    engine = SimpleNamespace(metrics=EngineMetrics("m"), model_config=SimpleNamespace(served_model_name="m"), is_dead=False)
    app = build_app(SimpleNamespace(), engine)
    assert TestClient(app).get("/plugin/hello").json() == {"hello": "from a plugin"}


def test_plugin_management_works_beside_a_broken_plugin(tmp_path, monkeypatch, capsys):
    make_distribution(tmp_path, "runtime-plugin-broken2", "broken2", "broken2_plugin_mod", "raise ImportError('gone')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RUNTIME_PLUGINS", raising=False)
    plugins.reset_plugin_manager(None)
    try:
        assert cli_main(["plugins"]) == 2
        assert "plugin 'broken2' (broken2_plugin_mod) failed to load" in capsys.readouterr().err
        # uninstalling must not need the broken plugin to import
        assert cli_main(["plugins", "uninstall", "no-such-plugin", "-y"]) != 0
        err = capsys.readouterr().err
        assert "failed to load" not in err and "no-such-plugin" in err
    finally:
        plugins.reset_plugin_manager(None)
        sys.modules.pop("broken2_plugin_mod", None)


def test_provider_hint_says_whether_the_package_is_installed(monkeypatch):
    registry = plugins.PluginManager(["cpu"]).registry("attention_backend")
    # runtime-kernels is installed by the test set-up but not loaded by this allow-list
    assert "installed but not loaded: add its plugin to RUNTIME_PLUGINS" in registry.unknown_message("triton")
    monkeypatch.setattr(plugins, "_is_installed", lambda distribution: False)
    assert "install it from the runtime source tree with `pip install -e kernels`" in registry.unknown_message("triton")

