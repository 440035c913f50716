"""The plugin contract: hookspecs name real types, registrations are typed and checked."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

from runtime import LLM, SamplingParams, hookimpl, hookspecs
from runtime.plugins import REGISTRY_KINDS, PluginError
from runtime.testing.models import build_untokenized_model

from support.fake_components import FakeBackend as CompleteBackend


def _named_types(doc: str) -> list[str]:
    return re.findall(r":(?:class|data):`([\w.]+)`", doc)


@pytest.mark.parametrize("hook", [n for n in dir(hookspecs) if n.startswith("register_")])
def test_every_type_a_hookspec_names_exists(hook):
    doc = getattr(hookspecs, hook).__doc__
    names = [n for n in _named_types(doc) if n.startswith("runtime.")]
    if hook in REGISTRY_KINDS.keys():
        assert names, f"{hook} names no runtime type for what it registers"
    for dotted in names:
        module_name, _, attr = dotted.rpartition(".")
        module = importlib.import_module(module_name)
        assert hasattr(module, attr), f"{hook} names {dotted}, which does not exist"


def test_hookimpl_is_exported_and_matches_the_spec_project():
    assert hookimpl.project_name == hookspecs.hookspec.project_name == "runtime"


class NoForwardBackend:
    name = "no_forward"

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, metadata):
        return metadata


def test_a_class_lacking_a_method_is_refused_at_registration(plugin_manager):
    class Broken:
        @hookimpl
        def register_attention_backends(self, register):
            register("complete", CompleteBackend)
            register("no_forward", NoForwardBackend)

    with pytest.raises(PluginError, match=r"plugin 'broken' registered attention backend 'no_forward' "
                                          r"\(NoForwardBackend\), which lacks forward\(\)"):
        plugin_manager.register(Broken(), "broken")
    registry = plugin_manager.registry("attention_backend")
    assert "complete" not in registry and "broken" not in plugin_manager.infos  # nothing of it stays


def test_a_factory_product_lacking_a_method_is_refused_when_built(plugin_manager):
    class Lazy:
        @hookimpl
        def register_attention_backends(self, register):
            register("lazy_broken", lambda: NoForwardBackend())

    plugin_manager.register(Lazy(), "lazy")
    with pytest.raises(PluginError, match=r"plugin 'lazy' .* 'lazy_broken' .* lacks forward\(\)"):
        plugin_manager.registry("attention_backend").create("lazy_broken")


def test_register_callbacks_are_typed(plugin_manager):
    class Misspelled:
        @hookimpl
        def register_attention_backends(self, register):
            register("x", CompleteBackend, platform=["cpu"])  # the keyword is `platforms`

    with pytest.raises(PluginError, match=r"plugin 'misspelled' failed in register_attention_backends: "
                                          r"TypeError: .*unexpected keyword argument 'platform'"):
        plugin_manager.register(Misspelled(), "misspelled")
    sig = inspect.signature(_callback_of(plugin_manager, "register_attention_backends"))
    assert list(sig.parameters) == ["name", "factory", "platforms", "dtypes", "head_sizes"]


def _callback_of(manager, hook_name):
    seen = {}

    class Spy:
        @hookimpl
        def register_attention_backends(self, register):
            seen["register"] = register

    manager.register(Spy(), "spy")
    manager.unregister("spy")
    return seen["register"]


@pytest.mark.parametrize(
    "kind,contract_type",
    [
        ("quant_method", "runtime.quantization.QuantMethod"),
        ("proposer", "runtime.spec_decode.Proposer"),
        ("guided_backend", "runtime.structured_output.GuidedBackend"),
        ("kv_tier", "runtime.kv_transfer.KVTier"),
        ("executor", "runtime.executor.base.Executor"),
    ],
)
def test_feature_kinds_check_their_contract(plugin_manager, kind, contract_type):
    hook = next(h for h, k in REGISTRY_KINDS.items() if k == kind)

    class Empty:
        pass

    class Plugin:
        pass

    setattr(Plugin, hook, hookimpl(lambda self, register: register("empty", Empty)))
    with pytest.raises(PluginError, match=re.escape(contract_type)):
        plugin_manager.register(Plugin(), "feature")


def test_kv_connector_halves_are_checked_by_role(plugin_manager):
    from runtime.kv_transfer import KVConnectorRole

    class SchedulerHalf:
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return None

        def request_finished(self, request, block_ids):
            return False, None

    class Connectors:
        @hookimpl
        def register_kv_connectors(self, register):
            register("half", lambda config, role: SchedulerHalf())

    plugin_manager.register(Connectors(), "connectors")
    registry = plugin_manager.registry("kv_connector")
    half = registry.create("half", None, KVConnectorRole.SCHEDULER, contract="kv_connector_scheduler")
    assert isinstance(half, SchedulerHalf)
    with pytest.raises(PluginError, match=r"lacks register_kv_caches\(\), start_load_kv\(\)"):
        registry.create("half", None, KVConnectorRole.WORKER, contract="kv_connector_worker")


def test_builtin_components_satisfy_their_protocols():
    from runtime.executor.base import Executor
    from runtime.executor.uniproc import UniProcExecutor
    from runtime.models.interface import CausalLM
    from runtime.models.llama import LlamaForCausalLM

    assert issubclass(UniProcExecutor, Executor)
    assert issubclass(LlamaForCausalLM, CausalLM)


# ---------------------------------------------------------------- executors
def test_executor_registered_by_a_test_plugin_runs_generate(plugin_manager, tmp_path):
    """``factory(config)`` returns the executor; the engine drives it end to end."""
    from runtime.executor.uniproc import UniProcExecutor

    calls = {"built": 0, "steps": 0}

    class CountingExecutor:
        def __init__(self, config):
            calls["built"] += 1
            self.inner = UniProcExecutor(config)

        def initialize(self):
            return self.inner.initialize()

        def execute_model(self, scheduler_output):
            calls["steps"] += 1
            return self.inner.execute_model(scheduler_output)

        def shutdown(self):
            self.inner.shutdown()

    class ExecutorPlugin:
        @hookimpl
        def register_executors(self, register):
            register("counting", lambda config: CountingExecutor(config))

    plugin_manager.register(ExecutorPlugin(), "counting-executor")
    path = build_untokenized_model("llama", tmp_path / "llama")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    counted = LLM(path, skip_tokenizer_init=True, dtype="float32", executor="counting")
    outputs = counted.generate(prompts, params, use_tqdm=False)
    plain = LLM(path, skip_tokenizer_init=True, dtype="float32").generate(prompts, params, use_tqdm=False)
    assert calls["built"] == 1 and calls["steps"] >= 6
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)


def test_a_platform_without_its_abstract_methods_is_refused(plugin_manager):
    from runtime.platforms import Platform

    class HalfPlatform(Platform):
        name = "half"

        def is_available(self):
            return True

    class Plugin:
        @hookimpl
        def register_platforms(self, register):
            register(HalfPlatform())

    with pytest.raises(PluginError, match=r"plugin 'half-plugin' registered platform 'half' \(HalfPlatform\), "
                                          r"which lacks kv_cache_memory_bytes\(\)"):
        plugin_manager.register(Plugin(), "half-plugin")
    assert "half" not in plugin_manager.registry("platform")
