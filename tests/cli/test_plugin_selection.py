"""Several hardware plugins at once: --platform, priorities, name conflicts, allow-lists."""

import json
import sys

import pluggy
import pytest
import torch

from runtime import plugins
from runtime.attention.backend import select_attention_backend
from runtime.cli import main as cli
from runtime.platforms import Platform, select_platform

import runtime_rocm
import runtime_xpu

from support.plugin_dists import make_distribution

from runtime import hookimpl
BUILTIN = plugins.BUILTIN_PLUGIN_NAME


class FakeCudaPlatform(Platform):
    """Stands in for runtime-plugin-cuda, which is not part of this test environment."""

    name = "cuda"
    device_type = "cpu"
    priority = 10  # as runtime_cuda.platform.CudaPlatform
    available = False

    def is_available(self):
        return self.available

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):
        return 1 << 20


class FakeCudaPlugin:
    @hookimpl
    def register_platforms(self, register):
        register(FakeCudaPlatform())


@pytest.fixture
def devices(monkeypatch):
    """Switch simulated devices on: ``devices("rocm", "xpu")``."""

    def simulate(*names):
        monkeypatch.setattr(FakeCudaPlatform, "available", "cuda" in names)
        monkeypatch.setattr(torch.version, "hip", "6.2-simulated" if "rocm" in names else None)
        monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 1 if "rocm" in names else 0)
        monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.xpu, "device_count", lambda: 1 if "xpu" in names else 0)

    simulate()
    return simulate


@pytest.fixture
def gpu_manager():
    """cpu, a fake cuda, rocm and xpu, in the order entry points load (sorted by name)."""
    saved = plugins._manager
    manager = plugins.PluginManager(["cpu"])
    manager.register(FakeCudaPlugin(), "cuda", "0.0", "runtime-plugin-cuda-fake")
    manager.register(runtime_rocm, "rocm", "0.1.0", "runtime-plugin-rocm")
    manager.register(runtime_xpu, "xpu", "0.1.0", "runtime-plugin-xpu")
    plugins.reset_plugin_manager(manager)
    yield manager
    plugins.reset_plugin_manager(saved)


@pytest.mark.parametrize(
    "available,expected",
    [((), "cpu"), (("xpu",), "xpu"), (("rocm",), "rocm"), (("rocm", "xpu"), "rocm"), (("cuda", "xpu"), "cuda")],
)
def test_auto_detection_picks_the_highest_priority_available(gpu_manager, devices, available, expected):
    devices(*available)
    assert select_platform().name == expected


def test_platform_flag_picks_one(gpu_manager, devices):
    devices("rocm", "xpu")
    assert [select_platform(name).name for name in ("xpu", "rocm", "cpu")] == ["xpu", "rocm", "cpu"]
    with pytest.raises(ValueError, match="platform 'cuda' is installed but not available on this machine; available: cpu, rocm, xpu"):
        select_platform("cuda")
    with pytest.raises(ValueError, match="unknown platform 'tpu'; installed: cpu, cuda, rocm, xpu"):
        select_platform("tpu")


def test_same_name_from_two_distributions_names_both_packages(tmp_path, monkeypatch):
    source = (
        "import pluggy\nfrom runtime.platforms import Platform\n"
        "class P(Platform):\n    name = 'gpu0'\n    def is_available(self):\n        return False\n"
        "    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):\n        return 0\n"
        "@pluggy.HookimplMarker('runtime')\ndef register_platforms(register):\n    register(P())\n"
    )
    make_distribution(tmp_path, "runtime-plugin-vendor-a", "vendor-a", "vendor_a_plugin_mod", source)
    make_distribution(tmp_path, "runtime-plugin-vendor-b", "vendor-b", "vendor_b_plugin_mod", source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(plugins.PluginError) as err:
            plugins.PluginManager(["vendor-a", "vendor-b"])
        assert str(err.value).startswith(
            "platform 'gpu0' is registered by two plugins: 'vendor-a' and 'vendor-b' "
            "(packages runtime-plugin-vendor-a and runtime-plugin-vendor-b)"
        )
        assert "vendor-a" in plugins.PluginManager(["vendor-a"]).infos  # either one alone loads
    finally:
        sys.modules.pop("vendor_a_plugin_mod", None)
        sys.modules.pop("vendor_b_plugin_mod", None)


def test_a_plugin_reusing_the_rocm_name_is_an_error(gpu_manager):
    class MyRocm:
        @hookimpl
        def register_platforms(self, register):
            from runtime_rocm.platform import RocmPlatform

            register(RocmPlatform())

    with pytest.raises(plugins.PluginError, match=r"\(packages runtime-plugin-rocm and runtime-plugin-my-rocm\)"):
        gpu_manager.register(MyRocm(), "my-rocm", "1.0", "runtime-plugin-my-rocm")


def test_triton_is_registered_once_for_every_gpu_platform(devices):
    """runtime-kernels registers it; runtime-plugin-cuda, -rocm and -xpu register only their platforms."""
    manager = plugins.PluginManager(["cpu", "cuda", "kernels", "rocm", "xpu"])  # all from their entry points
    owners = [(name, info.registered.get("attention_backend", [])) for name, info in manager.infos.items()]
    assert [(name, names) for name, names in owners if "triton" in names] == [("kernels", ["triton"])]
    for gpu in ("cuda", "rocm", "xpu"):
        assert manager.infos[gpu].registered == {"platform": [gpu]}
    component = manager.registry("attention_backend").component("triton")
    assert component.options["platforms"] == ["cuda", "rocm", "xpu"]
    saved = plugins._manager
    plugins.reset_plugin_manager(manager)
    try:
        for gpu in ("rocm", "xpu"):  # simulated devices; each platform's default backend is that one triton
            devices(gpu)
            backend = select_attention_backend(None, select_platform(), torch.float16, head_size=64)
            assert type(backend).__module__ == "runtime_kernels.attention_backend" and backend.name == "triton"
    finally:
        plugins.reset_plugin_manager(saved)


def _listed_plugins(capsys) -> set[str]:
    return {row["name"] for row in json.loads(capsys.readouterr().out)}


def test_plugins_flag_limits_loading(unloaded_manager, capsys):
    assert cli.main(["--plugins", "cpu", "plugins", "--json"]) == 0
    assert _listed_plugins(capsys) == {BUILTIN, "cpu"}


def test_plugins_flag_after_the_subcommand(unloaded_manager, capsys):
    assert cli.main(["plugins", "--plugins", "", "--json"]) == 0
    assert _listed_plugins(capsys) == {BUILTIN}  # '' loads none; the core always loads


def test_serve_plugins_flag_loads_only_those(unloaded_manager):
    argv = cli._apply_plugin_allow_list(["serve", "model-folder", "--plugins", "cpu"])
    args = cli.build_parser().parse_args(argv)  # builds the process-wide manager
    assert args.plugins == "cpu" and args.func.__module__ == "runtime.cli.serve"
    manager = plugins.get_plugin_manager()
    assert set(manager.infos) == {BUILTIN, "cpu"}
    assert manager.registry("platform").names() == ["cpu"]
